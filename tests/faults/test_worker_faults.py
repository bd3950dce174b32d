"""Dead, hung and stopped workers, with real processes: kill -9, SIGSTOP, SIGTERM.

Each test runs `tapeline run --role all` (supervised children, watchdog included) with a lease of a
few seconds, submits a 32 s real video, interferes with a process mid-transcode, and checks the
committed log: the job completes once, with one published output set.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from producers.submit import publish, upload
from tapeline.samples import sample_video
from tests.conftest import wait_for
from tests.faults.conftest import job_row
from tests.integration.helpers import committed_events, keys_under, of_job

pytestmark = pytest.mark.integration


def submit(settings, path):
    submission = upload(settings, path)
    publish(settings, submission.event)
    return submission.job_id


def wait_transcoding(settings, job_id, min_frames=50, timeout_s=60):
    """Wait until the transcode attempt reports progress (frames advancing in heartbeats)."""
    return wait_for(lambda: (lambda r: r if r and r["state"] == "running" and r["stage"] == "transcode"
                             and (r["progress_frames"] or 0) >= min_frames else None)(job_row(settings, job_id)),
                    timeout_s, "the transcode to be under way")


def wait_state(settings, job_id, state="completed", timeout_s=180):
    return wait_for(lambda: (lambda r: r if r and r["state"] == state else None)(job_row(settings, job_id)),
                    timeout_s, f"job {job_id} to be {state}")


def assert_completed_once(settings, job_id):
    events = of_job(committed_events(settings), job_id)
    assert len(of_job(events, job_id, "JobCompleted")) == 1
    published = [e for e in of_job(events, job_id, "AttemptSucceeded") if e.stage == "publish"]
    assert len(published) == 1
    assert keys_under(settings, f"published/{job_id}/") == {o.key for o in published[0].outputs}
    return events


def test_kill_9_transcode_worker_mid_job(fault_settings, fault_pipeline, long_video):
    job_id = submit(fault_settings, long_video)
    wait_transcoding(fault_settings, job_id)
    worker = fault_pipeline.children()["transcode"]
    killed_at = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    wait_state(fault_settings, job_id)
    events = assert_completed_once(fault_settings, job_id)
    stalls = of_job(events, job_id, "StallDetected")
    # The supervisor saw its child die and the attempt was retried at once (not after the lease).
    assert [(s.kind, s.stalled_attempt) for s in stalls] == [("worker_exited", 1)]
    assert "killed by SIGKILL" in stalls[0].detail
    started = [(e.stage, e.attempt) for e in of_job(events, job_id, "AttemptStarted")]
    assert started == [("transcode", 1), ("transcode", 2), ("thumbnails", 1), ("publish", 1)]
    assert time.monotonic() - killed_at < 120


def test_sigstop_ffmpeg_is_caught_by_progress_not_liveness(fault_settings, long_video, tmp_path):
    """A stopped ffmpeg: its worker heartbeats on with frozen counters. Before the verdict every
    view lists the attempt as suspect with its seconds of the allowance and what the worker sees of
    ffmpeg (stopped); the verdict is no_progress, its `StallDetected` carries that tool state, the
    diagnosis and `tapeline status` say "ffmpeg was stopped by a signal", and after the retry the
    stall stays listed with its outcome (issue 45 items 1 and 2). The no-progress timeout is 30 s
    here (8 s in the other fault tests) so the suspect stretch, past half of it, outlasts two CLI calls."""
    from fastapi.testclient import TestClient

    from cli.wiring import build_app
    from projections import read_model as read
    from tests.conftest import Pipeline, tapeline_cli

    settings = fault_settings.model_copy(update={"no_progress_timeout_s": 30.0})
    pipeline = Pipeline(settings, tmp_path / "run.log").start()
    client = TestClient(build_app(settings), base_url="http://localhost")  # the read API and dashboard, in-process
    entered = False
    try:
        job_id = submit(settings, long_video)
        wait_transcoding(settings, job_id, timeout_s=150)  # (a loaded 2-core host starts a pipeline slowly)
        client.__enter__()  # (the projections exist now)
        entered = True
        ffmpeg = ffmpeg_of(pipeline.children()["transcode"])
        os.kill(ffmpeg, signal.SIGSTOP)
        try:
            # (a) suspect before the verdict: in the read API (polled: fast), on the dashboard's job
            # page and in the metric at the same moment, then in `tapeline stalled --json` and
            # `tapeline status JOB --json`.
            def suspect_listed():
                rows = [r for r in client.get("/api/stalled").json() if r["job_id"] == job_id]
                found = next((r for r in rows if r["kind"] == "suspect" and r["tool_state"]
                              and r["tool_state"]["process_state"] == "T"), None)
                return found and (found, client.get(f"/jobs/{job_id}").text, client.get("/metrics").text)
            api, page, metrics = wait_for(suspect_listed, 40, "the attempt listed as suspect, ffmpeg seen stopped")
            assert api["reason"].startswith("no progress for ") and api["allowance_s"] == 30.0
            assert 'id="suspect"' in page and "ffmpeg was stopped by a signal" in page
            assert 'tapeline_attempts_suspect{suspect_of="no_progress"} 1.0' in metrics
            rows = json.loads(tapeline_cli(settings, "stalled", "--json").stdout)
            status = json.loads(tapeline_cli(settings, "status", job_id, "--json").stdout)
            suspect = next(r for r in rows if r["job_id"] == job_id and r["kind"] == "suspect")
            assert suspect["suspect_of"] == "no_progress" and suspect["allowance_s"] == 30.0
            assert 15.0 < suspect["since_s"] <= 30.0 and suspect["remaining_s"] == round(30.0 - suspect["since_s"], 3)
            assert re.match(r"no progress for \d+ s of the 30 s allowance; ffmpeg was stopped by a signal "
                            r"\(process state T\)", suspect["reason"]), suspect["reason"]
            assert status["suspect"]["attempt"] == 1 and status["suspect"]["reason"].startswith("no progress for ")
            wait_for(lambda: any(s.kind == "no_progress" for s in of_job(committed_events(settings), job_id,
                                                                          "StallDetected")), 60, "a no_progress stall")
        finally:
            try:
                os.kill(ffmpeg, signal.SIGCONT)
            except ProcessLookupError:
                pass
        wait_state(settings, job_id)
        events = assert_completed_once(settings, job_id)
        stalls = of_job(events, job_id, "StallDetected")
        assert [(s.kind, s.stalled_attempt) for s in stalls] == [("no_progress", 1)]
        # The stalled attempt's worker was alive and heartbeating all along.
        assert len([e for e in of_job(events, job_id, "Heartbeat") if e.attempt == 1]) >= 3
        # (b) why it stopped: the stall carries what the worker last saw of ffmpeg.
        seen = stalls[0].tool_state
        assert seen is not None and (seen.tool, seen.process_state) == ("ffmpeg", "T")
        assert seen.last_progress and "frame=" in seen.last_progress
        status = json.loads(tapeline_cli(settings, "status", job_id, "--json").stdout)
        assert status["stall_evidence"]["kind"] == "no_progress" and status["stall_evidence"]["attempt"] == 1
        assert status["stall_evidence"]["lines"][0].startswith("ffmpeg was stopped by a signal (process state T)")
        assert status["stall_evidence"]["lines"][1].startswith("last progress: frame=")
        assert "ffmpeg was stopped by a signal" in status["diagnosis"]["stall"]
        text = tapeline_cli(settings, "status", job_id).stdout
        assert "at the no_progress stall of transcode attempt 1:" in text and "ffmpeg was stopped by a signal" in text
        # After the verdict and the retry, the stall stays listed with what was done about it.
        with read.open_reader(settings) as conn:
            recent = [r for r in read.stall_list(conn, settings.recent_stalls_s) if r["job_id"] == job_id]
        assert [(r["kind"], r["stall_kind"], r["attempt"], r["outcome"], r["job_state"]) for r in recent] == [
            ("recent_stall", "no_progress", 1, "retried as attempt 2", "completed")]
        assert "ffmpeg was stopped by a signal" in recent[0]["reason"]
        detail = client.get(f"/api/jobs/{job_id}").json()
        assert detail["stall_evidence"]["lines"] == status["stall_evidence"]["lines"] and detail["suspect"] is None
        listed = [r for r in client.get("/api/stalled").json() if r["job_id"] == job_id]
        assert [(r["kind"], r["outcome"]) for r in listed] == [("recent_stall", "retried as attempt 2")]
    finally:
        if entered:
            client.__exit__(None, None, None)
        pipeline.stop()
        print(pipeline.log_text()[-6000:])


def test_sigterm_yields_and_the_next_attempt_starts_at_once(fault_settings, fault_pipeline, long_video):
    job_id = submit(fault_settings, long_video)
    wait_transcoding(fault_settings, job_id)
    os.kill(fault_pipeline.children()["transcode"], signal.SIGTERM)
    wait_state(fault_settings, job_id)
    events = assert_completed_once(fault_settings, job_id)
    assert of_job(events, job_id, "StallDetected") == []
    yielded = of_job(events, job_id, "AttemptYielded")
    assert [e.attempt for e in yielded] == [1]
    started = [e for e in of_job(events, job_id, "AttemptStarted") if e.stage == "transcode"]
    assert [e.attempt for e in started] == [1, 2]


def ffmpeg_of(worker: int, timeout_s: float = 10.0) -> int:
    """The pid of the ffmpeg the worker process `worker` runs (waits up to `timeout_s` seconds)."""
    return wait_for(lambda: [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == worker
                             and _name(int(p)) == "ffmpeg"], timeout_s, "the worker's ffmpeg")[0]


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def test_checks_after_the_encode_longer_than_the_lease_keep_the_attempt_alive(fault_settings, tmp_path):
    """After ffmpeg ends there is nothing to heartbeat from: the last uploads, the ffprobe check of
    every rendition, the playlists. Here each playlist's ffprobe takes 2 s (a wrapper on PATH), so
    that phase lasts about twice the 4 s lease. Heartbeats from a thread (`Attempt.keepalive`) keep
    the one attempt alive: no stall, no second attempt."""
    from tests.conftest import Pipeline

    wrappers = tmp_path / "bin"
    wrappers.mkdir()
    real = subprocess.run(["which", "ffprobe"], capture_output=True, text=True, check=True).stdout.strip()
    (wrappers / "ffprobe").write_text(f'#!/bin/sh\ncase "$*" in *.m3u8) sleep 2 ;; esac\nexec {real} "$@"\n')
    (wrappers / "ffprobe").chmod(0o755)
    settings = fault_settings.model_copy(update={"no_progress_timeout_s": 30.0})
    pipeline = Pipeline(settings, tmp_path / "run.log",
                        extra_env={"PATH": f"{wrappers}:{os.environ['PATH']}"}).start()
    try:
        job_id = submit(settings, sample_video("bigbuckbunny.mp4"))
        wait_state(settings, job_id)
        events = assert_completed_once(settings, job_id)
    finally:
        pipeline.stop()
    assert of_job(events, job_id, "StallDetected") == []
    assert [e.attempt for e in of_job(events, job_id, "AttemptStarted") if e.stage == "transcode"] == [1]
    # Heartbeats went on between the encode's last checkpoint and the attempt's success.
    transcode = [e for e in events if e.job_id == job_id and e.stage == "transcode"]
    last_checkpoint = max(i for i, e in enumerate(transcode) if e.event_type == "CheckpointRecorded")
    succeeded = next(i for i, e in enumerate(transcode) if e.event_type == "AttemptSucceeded")
    beats = [e for e in transcode[last_checkpoint:succeeded] if e.event_type == "Heartbeat"]
    assert len(beats) >= 4, [e.event_type for e in transcode[last_checkpoint:succeeded]]


def test_a_download_longer_than_the_lease_and_the_no_progress_timeout_keeps_the_attempt_alive(fault_settings,
                                                                                               tmp_path):
    """Between the claim and ffmpeg's start nothing reported progress: a source that downloads for
    longer than the lease (4 s) and the no-progress timeout (8 s) had its healthy attempt declared
    stalled, and the next one too. Here the download is followed by a 12 s pause (a slow store,
    `TAPELINE_DELAY_POINTS`); heartbeats from a thread hold the lease, and a grace of the source's
    size over `download_min_bytes_per_s` (about 30 s here) holds off the no-progress timeout."""
    from tests.conftest import Pipeline

    clip = sample_video("bigbuckbunny.mp4")
    settings = fault_settings.model_copy(update={"download_min_bytes_per_s": clip.stat().st_size / 30})
    pipeline = Pipeline(settings, tmp_path / "run.log",
                        extra_env={"TAPELINE_DELAY_POINTS": "transcode.download:12"}).start()
    try:
        job_id = submit(settings, clip)
        wait_state(settings, job_id)
        events = assert_completed_once(settings, job_id)
    finally:
        pipeline.stop()
    assert of_job(events, job_id, "StallDetected") == []
    assert [e.attempt for e in of_job(events, job_id, "AttemptStarted") if e.stage == "transcode"] == [1]
    beats = [e for e in of_job(events, job_id, "Heartbeat") if e.stage == "transcode"]
    early = [e for e in beats if e.frames_done == 0 and e.progress_grace_s]
    assert len(early) >= 12, [(e.frames_done, e.progress_grace_s) for e in beats[:20]]  # every 0.5 s of the pause
    assert all(abs(e.progress_grace_s - 30.0) < 0.01 for e in early)

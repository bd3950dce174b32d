"""Error classes end to end (issue 5, item 8) for the retryable classes the input tests do not
cover: each run through the real pipeline, asserting the terminal event, the attempts, and the
reason shown by `tapeline timeline` and `tapeline submit --wait --json`.

- out_of_memory: ffmpeg killed with SIGKILL mid-encode (what the OOM killer does) -> retried;
- timeout: ffmpeg past its wall-clock limit on every attempt -> dead-lettered when attempts run out;
- unknown: an unclassified failure on every attempt -> dead-lettered;
- broker_transient: the projector is down, so nothing can be reconciled -> the processors wait and
  read the record again (no crash, no attempt used), and the job completes once it is back.
"""

from __future__ import annotations

from tests.faults.conftest import OTHER_STAGES

import json
import os
import signal

import pytest

from tapeline.samples import sample_video
from tests.conftest import Pipeline, tapeline_cli, wait_for
from tests.faults.test_worker_faults import assert_completed_once, ffmpeg_of, submit, wait_state, wait_transcoding
from tests.integration.helpers import committed_events, of_job

pytestmark = pytest.mark.integration


def test_ffmpeg_killed_like_the_oom_killer_is_out_of_memory_and_retried(fault_settings, long_video, tmp_path):
    settings = fault_settings.model_copy(update={"retry_backoff_s": (1.0,), "retry_jitter": 0.0})
    pipeline = Pipeline(settings, tmp_path / "run.log").start()
    try:
        job_id = submit(settings, long_video)
        wait_transcoding(settings, job_id)
        worker = pipeline.children()["transcode"]
        ffmpeg = ffmpeg_of(worker)
        os.kill(ffmpeg, signal.SIGKILL)
        wait_state(settings, job_id, timeout_s=180)
        events = assert_completed_once(settings, job_id)
        workers_after = pipeline.children()["transcode"]
    finally:
        pipeline.stop()
    assert workers_after == worker  # the worker survived its ffmpeg
    [failed] = of_job(events, job_id, "AttemptFailed")
    assert (failed.attempt, failed.error_class, failed.retryable) == (1, "out_of_memory", True)
    assert "ffmpeg exited with -9" in failed.reason
    assert [e.attempt for e in of_job(events, job_id, "AttemptStarted") if e.stage == "transcode"] == [1, 2]


@pytest.mark.parametrize("error_class", ["timeout", "unknown"])
def test_a_retryable_failure_on_every_attempt_ends_dead_lettered(fault_settings, tmp_path, error_class):
    settings = fault_settings.model_copy(update={"max_attempts": 2, "retry_backoff_s": (0.5,), "retry_jitter": 0.0})
    env = {}
    if error_class == "timeout":
        settings = settings.model_copy(update={"ffmpeg_timeout_s": 0.2, "ffmpeg_timeout_factor": 0.0})
        expected = "wall-clock limit"
    else:
        env = {"TAPELINE_FAIL_POINTS": "transcode.download:unknown"}
        expected = "injected failure at transcode.download"
    pipeline = Pipeline(settings, tmp_path / "run.log", extra_env=env).start()
    try:
        done = tapeline_cli(settings, "submit", str(sample_video("bigbuckbunny.mp4")), "--wait", "--json",
                            "--timeout", "180")
    finally:
        pipeline.stop()
    summary = json.loads(done.stdout)
    assert done.returncode != 0  # the job did not complete
    assert (summary["state"], summary["error_class"], summary["attempts"]) == ("dead_lettered", error_class, 2)
    assert expected in summary["reason"]
    job_id = summary["job_id"]
    events = of_job(committed_events(settings), job_id)
    failed = of_job(events, job_id, "AttemptFailed")
    assert [(e.attempt, e.error_class, e.retryable) for e in failed] == [(1, error_class, True), (2, error_class, True)]
    [dead] = of_job(events, job_id, "JobDeadLettered")
    assert (dead.error_class, dead.attempts) == (error_class, 2)
    timeline = tapeline_cli(settings, "timeline", job_id)
    assert "JobDeadLettered" in timeline.stdout and f"error_class={error_class}" in timeline.stdout


def test_a_stopped_projector_makes_the_processors_wait_not_crash(fault_settings, roles):
    settings = fault_settings.model_copy(update={"caught_up_timeout_s": 2.0})
    roles.settings = settings
    running = {role: roles.start(role) for role in ("intake", "transcode", *OTHER_STAGES, "watchdog")}
    job_id = submit(settings, sample_video("carphone_pristine.mp4"))
    # Nothing can be reconciled against the projection (the watchdog's ticks alone keep it behind):
    # the intake (and a worker holding an item) reads its record again after a pause.
    wait_for(lambda: roles.logs().count("reading it again") >= 2, 90, "a processor to read its record again twice")
    assert {role: p.poll() for role, p in running.items()} == {role: None for role in running}
    roles.start("projector")
    wait_state(settings, job_id, timeout_s=120)
    events = assert_completed_once(settings, job_id)
    assert {role: p.poll() for role, p in running.items()} == {role: None for role in running}  # never crashed
    assert [(e.stage, e.attempt) for e in of_job(events, job_id, "AttemptStarted")] == [
        ("transcode", 1), ("thumbnails", 1), ("publish", 1)]
    assert of_job(events, job_id, "AttemptFailed") == []

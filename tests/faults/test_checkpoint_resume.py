"""kill -9 of a transcode worker after k checkpoints: the next attempt reuses them (issue 4, item 7).

`tapeline run --role all` (supervised children, watchdog included) with a lease of a few seconds
transcodes a 32 s real video in 4 s segments; once every rendition has at least two recorded
checkpoints the transcode child is killed with SIGKILL. The watchdog declares the lease expired,
the restarted worker claims attempt 2, verifies attempt 1's checkpoints in S3 and encodes only the
rest. Asserted from the committed log: which segments each attempt produced, which objects the
final outputs name, one JobCompleted, and published renditions that are frame-exact and decode.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import psycopg
import pytest

from tests.conftest import tapeline_cli, wait_for
from tests.faults.test_worker_faults import assert_completed_once, submit, wait_state
from tests.integration.helpers import decodes, ffprobe_duration, of_job

pytestmark = pytest.mark.integration

VIDEO = ("720p", "480p", "360p", "240p")


def checkpoints_of_attempt(settings, job_id: str, attempt: int) -> dict[str, list[int]]:
    """{rendition: segment indexes} of the applied CheckpointRecorded events of one transcode attempt."""
    with psycopg.connect(settings.database_url) as conn:
        rows = conn.execute("SELECT payload FROM lifecycle_evidence WHERE job_id = %s AND stage = 'transcode' "
                            "AND attempt = %s AND event_type = 'CheckpointRecorded' AND applied", (job_id, attempt))
        found: dict[str, list[int]] = {}
        for (payload,) in rows:
            found.setdefault(payload["rendition"], []).append(payload["segment_index"])
    return found


def video_frames(url: str) -> int:
    done = subprocess.run(["ffprobe", "-v", "error", "-count_packets", "-select_streams", "v:0", "-show_entries",
                           "stream=nb_read_packets", "-of", "json", url], capture_output=True, text=True, check=True,
                          timeout=120)
    return int(json.loads(done.stdout)["streams"][0]["nb_read_packets"])


def test_kill_9_after_two_checkpoints_resumes_from_them(fault_settings, fault_pipeline, long_video):
    source_frames = video_frames(str(long_video))
    job_id = submit(fault_settings, long_video)
    recorded = wait_for(lambda: (lambda c: c if all(len(c.get(r, [])) >= 2 for r in VIDEO) else None)(
        checkpoints_of_attempt(fault_settings, job_id, 1)), 120, "two checkpoints of every rendition", interval_s=0.05)
    os.kill(fault_pipeline.children()["transcode"], signal.SIGKILL)
    wait_state(fault_settings, job_id)
    events = assert_completed_once(fault_settings, job_id)

    # The first attempt was cut short by the kill: the supervisor saw the worker exit, a second attempt finished.
    assert [(s.kind, s.stalled_attempt) for s in of_job(events, job_id, "StallDetected")] == [("worker_exited", 1)]
    first = checkpoints_of_attempt(fault_settings, job_id, 1)
    second = checkpoints_of_attempt(fault_settings, job_id, 2)
    total = len(set(first.get("720p", [])) | set(second["720p"]))
    assert total == 8  # 31.7 s of media in 4 s segments
    assert all(first[r][:2] == [0, 1] for r in VIDEO) and all(len(recorded[r]) >= 2 for r in VIDEO)
    assert "audio" not in first  # audio is checkpointed as a whole, at the end of a run
    # Attempt 2 encoded only the segments after the ones every rendition had recorded, and redid at
    # most one segment per rendition (one attempt 1 finished in some renditions but not all).
    reused_up_to = min(len(first[r]) for r in VIDEO)
    print(f"checkpoints at the kill: {recorded}; attempt 1 recorded {first}; attempt 2 encoded {second}")
    for rendition in VIDEO:
        assert first[rendition] == list(range(len(first[rendition])))
        assert second[rendition] == list(range(reused_up_to, total)), rendition
        assert len(set(first[rendition]) & set(second[rendition])) <= 1
    assert sorted(second["audio"]) == list(range(8))

    # The transcode outputs name attempt 1's objects for the reused segments, attempt 2's for the rest.
    succeeded = [e for e in of_job(events, job_id, "AttemptSucceeded") if e.stage == "transcode"]
    assert [e.attempt for e in succeeded] == [2]
    keys = {o.key for o in succeeded[0].outputs}
    for rendition in VIDEO:
        for index in range(total):
            owner = 1 if index < reused_up_to else 2
            assert f"work/{job_id}/transcode/{owner}/{rendition}/seg_{index:05d}.ts" in keys, (rendition, index)
    assert len(keys) == len(VIDEO) * total + 8 + len(VIDEO) + 1  # segments, audio segments, playlists

    # The published renditions are whole: every source frame once, the source's duration, clean decode.
    published = of_job(events, job_id, "Published")[0]
    for rendition in published.renditions:
        assert video_frames(rendition.url) == source_frames, rendition.name
        assert abs(ffprobe_duration(rendition.url) - ffprobe_duration(str(long_video), "v:0")) <= 0.05
        clean = decodes(rendition.url)
        assert clean.returncode == 0 and clean.stderr == "", clean.stderr

    # `tapeline timeline` shows every checkpoint per attempt and what the success reused.
    timeline = json.loads(tapeline_cli(fault_settings, "timeline", job_id, "--json").stdout)
    shown = [(r["attempt"], r["detail"].split(" ")[:2]) for r in timeline if r["event_type"] == "CheckpointRecorded"
             and r["applied"]]
    assert sorted(shown) == sorted([(1, [r, f"#{i}"]) for r in first for i in first[r]] +
                                   [(2, [r, f"#{i}"]) for r in second for i in second[r]])
    success = next(r for r in timeline if r["event_type"] == "AttemptSucceeded" and r["stage"] == "transcode")
    span = f"0-{reused_up_to - 1}" if reused_up_to > 1 else "0"
    assert success["detail"].endswith("reused=" + "; ".join(f"{r} {span} (attempt 1)" for r in sorted(VIDEO)))

    # Waste is net of reuse (issue 26 item 2): attempt 1's run up to its last checkpoint that attempt 2
    # took over is not counted as wasted, in `tapeline status JOB` as in the API and the job page.
    status = json.loads(tapeline_cli(fault_settings, "status", job_id, "--json").stdout)
    first_attempt = next(a for a in status["attempt_history"] if (a["stage"], a["attempt"]) == ("transcode", 1))
    reused_objects = sum(1 for key in keys if f"/transcode/1/" in key)
    assert first_attempt["outcome"] == "stalled" and first_attempt["reused_segments"] == reused_objects > 0
    assert 0.0 <= first_attempt["wasted_s"] < first_attempt["gross_wasted_s"] == first_attempt["duration_s"]

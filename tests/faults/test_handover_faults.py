"""Zombies, stalled handoffs and idle workers, with each role as its own real process."""

from __future__ import annotations

from domain import pipeline
from domain.pipeline import STAGE_NAMES

import os
import signal
import time

import pytest

from tests.conftest import wait_for
from tests.faults.conftest import OTHER_STAGES, job_row
from tests.faults.test_worker_faults import assert_completed_once, submit, wait_state, wait_transcoding
from tests.integration.helpers import committed_events, of_job

pytestmark = pytest.mark.integration


def test_sigstop_worker_past_its_lease_is_fenced_on_waking(fault_settings, roles, long_video):
    for role in ("projector", "intake", "watchdog", *OTHER_STAGES):
        roles.start(role)
    first = roles.start("transcode")
    job_id = submit(fault_settings, long_video)
    wait_transcoding(fault_settings, job_id)
    os.killpg(first.pid, signal.SIGSTOP)  # the worker and its ffmpeg freeze, past the lease
    roles.start("transcode")  # a second worker takes the next attempt
    wait_for(lambda: (lambda r: r if r and r["stage"] == "transcode" and r["attempt"] == 2
                      and r["state"] == "running" else None)(job_row(fault_settings, job_id)), 60,
             "attempt 2 to start on the second worker")
    os.killpg(first.pid, signal.SIGCONT)  # the zombie wakes up mid-encode
    wait_state(fault_settings, job_id)
    events = assert_completed_once(fault_settings, job_id)
    assert [(s.kind, s.stalled_attempt) for s in of_job(events, job_id, "StallDetected")] == [("lease_expired", 1)]
    # Nothing the zombie wrote after waking changed state: no success of attempt 1 was applied.
    assert [e.attempt for e in of_job(events, job_id, "AttemptSucceeded") if e.stage == "transcode"] in ([2], [2, 1])
    row = job_row(fault_settings, job_id)
    assert row["attempts"] == 2
    # Attempt 2 resumes from attempt 1's checkpoints: an output of attempt 1 is allowed only if it was
    # checkpointed before the lease expired; everything else is attempt 2's own.
    stall_position = events.index(of_job(events, job_id, "StallDetected")[0])
    checkpointed_before_stall = {e.object_key for e in of_job(events[:stall_position], job_id, "CheckpointRecorded")
                                 if e.attempt == 1}
    keys = [output["key"] for output in row["outputs"] if output["key"].startswith(f"work/{job_id}/transcode/")]
    assert [k for k in keys if not (k.startswith(f"work/{job_id}/transcode/2/") or k in checkpointed_before_stall)] == []
    assert any(k.startswith(f"work/{job_id}/transcode/2/") for k in keys)
    wait_for(lambda: "fenced" in roles.logs() or "no longer owns" in roles.logs(), 30, "the zombie to stop itself")


def test_stopped_publish_processor_shows_a_stalled_handoff_and_completes_once_after_restart(
        fault_settings, roles, long_video):
    from tapeline.samples import sample_video
    from projections import read_model as read

    for role in ("projector", "intake", "watchdog", *(s for s in STAGE_NAMES if s != "publish")):
        roles.start(role)
    job_id = submit(fault_settings, sample_video("carphone_pristine.mp4"))
    wait_for(lambda: (lambda r: r if r and r["stage"] == "publish" and r["state"] == "queued" else None)(
        job_row(fault_settings, job_id)), 60, "transcode to hand over to publish")
    def listed() -> list[dict]:
        return [s for s in read.stalls(conn) if s["job_id"] == job_id and s["kind"] == "handoff"]

    with read.open_reader(fault_settings) as conn:
        # The watchdog re-drives the handoff once handoff_timeout_s has passed; the job stays listed
        # after that, while no worker claims it (before migration 019 it left the view at each re-drive).
        stall = wait_for(lambda: [s for s in listed() if s["redrives"] >= 1], 60, "a re-driven handoff listed")[0]
        assert stall["stage"] == "publish" and stall["attempt"] == 1
        for _ in range(10):  # over 2 s: listed throughout
            time.sleep(0.2)
            assert listed(), "the re-driven handoff left stalled_handoffs before a worker claimed it"
    roles.start("publish")
    wait_state(fault_settings, job_id)
    events = assert_completed_once(fault_settings, job_id)
    assert [(e.stage, e.attempt) for e in of_job(events, job_id, "AttemptStarted")] == [
        (s, 1) for s in pipeline.profile_stages(pipeline.DEFAULT_PROFILE)]
    assert "handoff" in [s.kind for s in of_job(events, job_id, "StallDetected")]


def test_idle_worker_starts_a_new_job_while_another_is_busy(fault_settings, roles, long_video):
    from tapeline.samples import sample_video

    for role in ("projector", "intake", "watchdog", *OTHER_STAGES, "transcode", "transcode"):
        roles.start(role)
    long_job = submit(fault_settings, long_video)
    wait_transcoding(fault_settings, long_job)
    short_job = submit(fault_settings, sample_video("carphone_pristine.mp4"))
    wait_state(fault_settings, short_job, timeout_s=120)
    wait_state(fault_settings, long_job)
    log = committed_events(fault_settings)
    short_started = of_job(log, short_job, "AttemptStarted")[0]
    long_started = of_job(log, long_job, "AttemptStarted")[0]
    long_done = [e for e in of_job(log, long_job, "AttemptSucceeded") if e.stage == "transcode"][0]
    # The short job was claimed by the other worker while the long one was still transcoding.
    assert short_started.worker != long_started.worker
    assert short_started.occurred_at < long_done.occurred_at, \
        f"short job claimed at {short_started.occurred_at}, long transcode ended at {long_done.occurred_at}"
    queued = [e for e in of_job(log, short_job, "StageQueued") if e.stage == "transcode"][0]
    print(f"short job waited {(short_started.occurred_at - queued.occurred_at).total_seconds():.2f} s for a worker")

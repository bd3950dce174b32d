"""SIGKILL inside a Kafka transaction (named crash points), with supervised restarts."""

from __future__ import annotations

import pytest

from tapeline.samples import sample_video
from tests.conftest import Pipeline, wait_for
from tests.faults.test_worker_faults import assert_completed_once, submit, wait_state
from tests.integration.helpers import committed_events, of_job

pytestmark = pytest.mark.integration


def crash_pipeline(settings, tmp_path, point):
    env = {"TAPELINE_CRASH_POINTS": point, "TAPELINE_CRASH_ONCE_DIR": str(tmp_path / "crashed")}
    return Pipeline(settings, tmp_path / "run.log", extra_env=env).start()


def test_crash_between_send_offsets_and_commit_processes_the_upload_once(fault_settings, tmp_path):
    pipeline = crash_pipeline(fault_settings, tmp_path, "intake.after_send_offsets")
    try:
        job_id = submit(fault_settings, sample_video("carphone_pristine.mp4"))
        wait_for(lambda: (tmp_path / "crashed" / "intake.after_send_offsets").exists(), 60, "the crash")
        wait_state(fault_settings, job_id, timeout_s=120)
        events = assert_completed_once(fault_settings, job_id)
        assert len(of_job(events, job_id, "JobAccepted")) == 1
        assert "child exited; restarting" in pipeline.log_text()
    finally:
        pipeline.stop()


def test_kill_inside_a_heartbeat_transaction_is_fenced_and_aborted_by_the_rescue(fault_settings, tmp_path,
                                                                                 long_video):
    """The worker dies with a heartbeat transaction open. The supervisor's rescue opens the attempt's
    transactional id, which fences the dead producer and aborts that transaction, so readers are not
    held until `transaction.timeout.ms`; the attempt is retried as `worker_exited`."""
    pipeline = crash_pipeline(fault_settings, tmp_path, "transcode.Heartbeat.after_produce")
    try:
        job_id = submit(fault_settings, long_video)
        marker = tmp_path / "crashed" / "transcode.Heartbeat.after_produce"
        wait_for(marker.exists, 60, "the worker to die inside a heartbeat transaction")
        crashed_at = marker.stat().st_mtime
        stall = wait_for(lambda: [e for e in of_job(committed_events(fault_settings), job_id, "StallDetected")],
                         90, "the stall to be detected behind the open transaction")[0]
        detected_after = stall.occurred_at.timestamp() - crashed_at
        print(f"stall detected {detected_after:.2f} s after the kill (lease {fault_settings.lease_s} s, "
              f"transaction timeout {fault_settings.transaction_timeout_ms / 1000} s)")
        assert stall.kind == "worker_exited" and stall.stalled_attempt == 1
        wait_state(fault_settings, job_id)
        events = assert_completed_once(fault_settings, job_id)
        # The heartbeat inside the killed transaction was aborted: never visible to read_committed readers.
        sequences = [e.sequence for e in of_job(events, job_id, "Heartbeat") if e.attempt == 1 and e.stage == "transcode"]
        assert sequences == sorted(set(sequences))
    finally:
        pipeline.stop()

"""A transient failure is retried after its backoff, dispatched by the watchdog on the log clock."""

from __future__ import annotations

import pytest

from tapeline.samples import sample_video
from tests.conftest import Pipeline
from tests.faults.test_worker_faults import assert_completed_once, submit, wait_state
from tests.integration.helpers import of_job

pytestmark = pytest.mark.integration


def test_transient_failure_is_retried_after_its_backoff_once(fault_settings, tmp_path):
    import psycopg

    settings = fault_settings.model_copy(update={"retry_backoff_s": (3.0,), "retry_jitter": 0.0})
    env = {"TAPELINE_FAIL_POINTS": "transcode.download:storage_transient",
           "TAPELINE_CRASH_ONCE_DIR": str(tmp_path / "faults")}
    pipeline = Pipeline(settings, tmp_path / "run.log", extra_env=env).start()
    try:
        job_id = submit(settings, sample_video("carphone_pristine.mp4"))
        wait_state(settings, job_id, timeout_s=120)
        events = assert_completed_once(settings, job_id)
    finally:
        pipeline.stop()
    failed = of_job(events, job_id, "AttemptFailed")
    assert [(e.attempt, e.error_class, e.retryable) for e in failed] == [(1, "storage_transient", True)]
    retry = of_job(events, job_id, "RetryScheduled")[0]
    assert retry.next_attempt == 2 and (retry.not_before - retry.occurred_at).total_seconds() == 3.0
    assert [e.attempt for e in of_job(events, job_id, "AttemptStarted") if e.stage == "transcode"] == [1, 2]
    with psycopg.connect(settings.database_url) as conn:
        times = dict(conn.execute(
            "SELECT event_type, min(broker_ts) FROM lifecycle_evidence WHERE job_id = %s AND"
            " ((event_type = 'RetryScheduled') OR (event_type = 'AttemptStarted' AND attempt = 2 AND stage = 'transcode'))"
            " GROUP BY event_type", (job_id,)).fetchall())
    waited = (times["AttemptStarted"] - times["RetryScheduled"]).total_seconds()
    assert waited >= 3.0, f"attempt 2 started {waited:.2f} s after the retry was scheduled, before its backoff"

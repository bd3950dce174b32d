"""The S3 endpoint stops answering for longer than one backoff step, then comes back: attempts fail
as `storage_transient`, are retried by the policy, and the job completes once (issue 5, item 8).

The endpoint is a private moto_server for this module, paused with SIGSTOP: the shared one keeps
objects in memory and other tests use it, so it is never paused or restarted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import psycopg
import pytest

from tapeline.samples import sample_video
from tapeline.settings import Settings
from tests.conftest import Pipeline, private_moto_server, wait_for
from tests.faults.conftest import job_row
from tests.faults.test_worker_faults import assert_completed_once, submit, wait_state
from tests.integration.helpers import of_job

pytestmark = pytest.mark.integration


@pytest.fixture()
def private_s3(isolated: Settings, tmp_path: Path) -> Iterator[tuple[Settings, subprocess.Popen]]:
    """A moto_server of this test's own (it gets paused), with short S3 timeouts and fast retries."""
    with private_moto_server(isolated, tmp_path, s3_read_timeout_s=1.0, s3_connect_timeout_s=1.0, s3_max_attempts=1,
                             max_attempts=6, retry_backoff_s=(2.0,), retry_jitter=0.0, tick_interval_s=0.5) as running:
        yield running


def failures(settings: Settings, job_id: str) -> list[tuple[int, str]]:
    with psycopg.connect(settings.database_url) as conn:
        return conn.execute("SELECT attempt, payload->>'error_class' FROM lifecycle_evidence WHERE job_id = %s"
                            " AND event_type = 'AttemptFailed' ORDER BY broker_ts", (job_id,)).fetchall()


def test_storage_outage_longer_than_a_backoff_step_then_back_completes_once(private_s3, tmp_path):
    settings, server = private_s3
    pipeline = Pipeline(settings, tmp_path / "run.log").start()
    try:
        job_id = submit(settings, sample_video("carphone_pristine.mp4"))
        wait_for(lambda: (lambda r: r if r and r["stage"] == "transcode" else None)(job_row(settings, job_id)),
                 120, "the job to reach transcode")
        os.kill(server.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            wait_for(lambda: len(failures(settings, job_id)) >= 2, 90, "two attempts to fail while S3 is down")
        finally:
            os.kill(server.pid, signal.SIGCONT)
        outage_s = time.monotonic() - stopped_at
        row = wait_state(settings, job_id, timeout_s=180)
        events = assert_completed_once(settings, job_id)
    finally:
        pipeline.stop()
        print(pipeline.log_text()[-4000:])
    assert outage_s > 2.0  # longer than one backoff step
    failed = of_job(events, job_id, "AttemptFailed")
    assert len(failed) >= 2 and {(e.stage, e.error_class, e.retryable) for e in failed} == {
        ("transcode", "storage_transient", True)}
    retries = of_job(events, job_id, "RetryScheduled")
    assert [r.next_attempt for r in retries] == [e.attempt + 1 for e in failed]
    assert all((r.not_before - r.occurred_at).total_seconds() == 2.0 for r in retries)
    started = [e.attempt for e in of_job(events, job_id, "AttemptStarted") if e.stage == "transcode"]
    assert started == list(range(1, len(failed) + 2))  # one attempt per failure, plus the one that succeeded
    assert row["state"] == "completed" and row["attempts"] >= 3

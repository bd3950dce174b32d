"""A crashed host's attempt is judged when its lease ends, not up to a watchdog period later.

The watchdog ticks every `tick_s` (lease/8 by default: 15 s at the default 120 s lease) and wakes
sooner when a lease ends before its next tick (`domain/policy/stall.py` `next_wake_s`). Here the
period is 3 s, most of the 4 s lease: a watchdog that only ticked on its period would judge the
expired lease up to 3 s late (on average 1.5 s); waking at the lease's end it takes well under 1 s.
Real processes: the transcode worker is killed with SIGKILL, with nobody to see it die.
"""

from __future__ import annotations

import os
import signal

import psycopg
import pytest

from tests.conftest import wait_for
from tests.faults.test_worker_faults import submit, wait_transcoding
from tests.faults.conftest import Roles

pytestmark = pytest.mark.integration
TICK_S = 3.0


def broker_times(settings, job_id: str) -> tuple[float, float] | None:
    """(end of attempt 1's lease, broker time of its StallDetected(lease_expired)), epoch seconds."""
    with psycopg.connect(settings.database_url, row_factory=psycopg.rows.dict_row) as conn:
        stall = conn.execute("SELECT broker_ts FROM lifecycle_evidence WHERE job_id = %s AND attempt = 1"
                             " AND event_type = 'StallDetected' AND payload->>'kind' = 'lease_expired'",
                             (job_id,)).fetchone()
        if stall is None:
            return None
        last = conn.execute("SELECT max(broker_ts) AS at FROM lifecycle_evidence WHERE job_id = %s AND attempt = 1"
                            " AND event_type IN ('AttemptStarted', 'Heartbeat') AND broker_ts < %s",
                            (job_id, stall["broker_ts"])).fetchone()
    return last["at"].timestamp() + settings.lease_s, stall["broker_ts"].timestamp()


def test_an_expired_lease_is_judged_at_its_end_between_two_ticks(fault_settings, tmp_path, long_video):
    settings = fault_settings.model_copy(update={"tick_interval_s": TICK_S})
    roles = Roles(settings, tmp_path)
    try:
        for role in ("projector", "intake", "watchdog"):
            roles.start(role)
        worker = roles.start("transcode")
        job_id = submit(settings, long_video)
        wait_transcoding(settings, job_id)
        os.killpg(worker.pid, signal.SIGKILL)  # the host is gone: only its lease tells
        lease_end, detected = wait_for(lambda: broker_times(settings, job_id), 30, "StallDetected(lease_expired)")
        assert 0.0 < detected - lease_end < 1.0, (
            f"judged {detected - lease_end:.2f} s after the lease ended (watchdog period {TICK_S:g} s)")
    finally:
        roles.stop_all()
        print(roles.logs())

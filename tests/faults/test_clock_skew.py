"""Workers whose clocks are two minutes fast and two minutes slow: no false stall, no duplicate.
Leases are judged on the broker's clock (LogAppendTime), never a worker's.

The skew is applied with `TAPELINE_CLOCK_OFFSET_S` (every wall-clock read of Tapeline's code goes
through `tapeline.clock.system_clock`). libfaketime was tried first: librdkafka's timed waits break under
it (metadata requests time out at once with -120 s, hang with +120 s), so a worker cannot run there.
"""

from __future__ import annotations

from tests.faults.conftest import OTHER_STAGES

import psycopg
import pytest

from tests.faults.test_worker_faults import assert_completed_once, submit, wait_state
from tests.integration.helpers import committed_events, of_job

pytestmark = pytest.mark.integration


def test_skewed_worker_clocks_cause_no_false_stall_and_no_duplicate(fault_settings, roles, long_video):
    for role in ("projector", "intake", "watchdog", *OTHER_STAGES):
        roles.start(role)
    roles.start("transcode", env={"TAPELINE_CLOCK_OFFSET_S": "120"})
    roles.start("transcode", env={"TAPELINE_CLOCK_OFFSET_S": "-120"})
    jobs = [submit(fault_settings, long_video) for _ in range(2)]
    for job_id in jobs:
        wait_state(fault_settings, job_id, timeout_s=240)
    log = committed_events(fault_settings)
    for job_id in jobs:
        assert_completed_once(fault_settings, job_id)
        assert of_job(log, job_id, "StallDetected") == []
        assert [e.attempt for e in of_job(log, job_id, "AttemptStarted") if e.stage == "transcode"] == [1]
    # Both skews were really in effect: writer clocks differ from the broker's by about two minutes.
    with psycopg.connect(fault_settings.database_url) as conn:
        skews = sorted(round(r[0]) for r in conn.execute(
            "SELECT extract(epoch FROM occurred_at - broker_ts) FROM lifecycle_evidence"
            " WHERE event_type = 'AttemptStarted' AND stage = 'transcode' AND job_id = ANY(%s)", (jobs,)))
    assert len(skews) == 2 and skews[0] <= -110 and skews[1] >= 110, skews

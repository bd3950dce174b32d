"""`processors.operator.cancel_events` (pure): one JobCancelled with who and why, or nothing."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from processors.operator import cancel_events
from domain.lifecycle import TERMINAL_STATES, evolve
from domain import events as ev
from tapeline.settings import Settings
from tests.fakeclock import FixedClock

SETTINGS = Settings(topic_prefix="unit")
CLOCK = FixedClock()  # the writer's clock of the decided events


def row(state="running", stage="transcode", attempt=2):
    return {"job_id": "j1", "upload_id": "u1", "state": state, "stage": stage, "attempt": attempt,
            "claim_token": "tok", "attempts": attempt, "events": 5, "yields": 0, "budget_base": 0}


@pytest.mark.parametrize("state", ["accepted", "queued", "running", "retry_scheduled"])
def test_an_open_job_gets_one_job_cancelled_with_operator_and_reason(state):
    [(topic, event)] = cancel_events(row(state), "alice", "wrong file", SETTINGS, "operator@test", clock=CLOCK)
    assert topic == "unit.jobs"
    assert isinstance(event, ev.JobCancelled)
    assert (event.job_id, event.stage, event.attempt, event.operator, event.reason, event.claim_token) == \
        ("j1", "transcode", 2, "alice", "wrong file", None)
    assert (event.dedup_key, event.correlation_id, event.recorded_by) == \
        ("j1:transcode:2:JobCancelled", "u1", "operator@test")
    folded = evolve(row(state), event, datetime(2025, 1, 1, tzinfo=timezone.utc))
    assert folded.applied and folded.row["state"] == "cancelled" and folded.row["reason"] == "wrong file"


@pytest.mark.parametrize("state", sorted(TERMINAL_STATES))
def test_an_ended_job_or_no_job_gets_nothing(state):
    assert cancel_events(row(state), "alice", "late", SETTINGS, "operator@test", clock=CLOCK) == []
    assert cancel_events(None, "alice", "late", SETTINGS, "operator@test", clock=CLOCK) == []

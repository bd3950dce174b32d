"""`domain.policy.withdrawal` (pure): which ended jobs keep their published outputs, what is withdrawn,
and the operator's answer after a cancel that raced a publish (issue 44 item 1)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from domain.lifecycle import STATES
from domain.policy.withdrawal import (WITHDRAWN_STATES, PublishedObject, Withdrawal, ending_answer, must_withdraw,
                                      plan_withdrawal)

T0 = datetime(2026, 12, 7, 4, 0, 1, 500_000, tzinfo=timezone.utc)
T1 = datetime(2026, 12, 7, 4, 0, 3, tzinfo=timezone.utc)
FOUND = [PublishedObject("published/j1/master.m3u8", T1), PublishedObject("published/j1/240p/seg_00000.ts", T0)]


@pytest.mark.parametrize("state", ["cancelled", "failed", "rejected"])
def test_a_job_that_ended_otherwise_than_completed_has_its_outputs_withdrawn(state):
    assert must_withdraw(state)
    plan = plan_withdrawal(state, FOUND)
    assert plan.keys == ("published/j1/240p/seg_00000.ts", "published/j1/master.m3u8")  # key order
    assert plan.public_since == T0 and plan


@pytest.mark.parametrize("state", ["completed", "accepted", "queued", "running", "retry_scheduled", "dead_lettered",
                                   "needs_review", None])
def test_completed_live_and_reopenable_jobs_keep_their_outputs(state):
    # A replayed dead letter or a resolved review publishes the same objects again: nothing to withdraw yet.
    assert not must_withdraw(state)
    assert plan_withdrawal(state, FOUND) == Withdrawal((), None)


def test_every_state_is_judged_and_completed_is_the_only_final_state_kept():
    assert WITHDRAWN_STATES == {"cancelled", "failed", "rejected"}
    assert WITHDRAWN_STATES < set(STATES)


def test_nothing_found_is_nothing_withdrawn():
    plan = plan_withdrawal("cancelled", [])
    assert not plan and plan.public_since is None


def test_the_answer_says_nothing_more_when_nothing_was_public():
    done = "cancelled (publish attempt 1, was running)"
    assert ending_answer(done, Withdrawal((), None)) == done


def test_the_answer_of_a_cancel_that_lost_the_race_says_since_when_and_that_they_are_withdrawn():
    answer = ending_answer("cancelled (publish attempt 1, was running)", plan_withdrawal("cancelled", FOUND))
    assert answer == ("cancelled (publish attempt 1, was running); 2 output(s) were already public at "
                      "2026-12-07 04:00:01 UTC (published/ of this job) and are withdrawn (OutputsWithdrawn)")

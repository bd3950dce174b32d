"""When a job's published outputs are withdrawn, and what a cancel that raced a publish answers:
pure rules (issue 44 item 1; docs/design.md "Cancel, fail and publish: who wins").

A publish attempt promotes objects to `published/{job}/` one by one; an operator's cancel (or a
`tapeline dlq fail`) can be committed while it does, and the projection only shows it a moment
later. The publish checks the projection before each object and before its completion
(`Attempt.check_still_owner`, the same fencing point as its provider call), so it stops within one
object of seeing the ending; what it promoted before that stays public unless someone removes it.
The rule: **an ending wins over a publish**. Outputs under `published/{job}/` stay public only while
the job is completed, or may still complete (live, or reopenable: `dead_lettered`, `needs_review`,
whose replay publishes the same objects again); once the job is in another final state
(`cancelled`, `failed`, `rejected`) they are withdrawn: deleted from the bucket and recorded as
`OutputsWithdrawn`. Withdrawing is the alternative to refusing the cancel: an operator who cancels
("wrong file", a customer's request) expects the file not to be public, whatever the publish had
reached.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Iterable

from domain.lifecycle import FINAL_STATES

KEPT_FINAL_STATE = "completed"
"""The one final state whose published outputs stay public."""

WITHDRAWN_STATES: frozenset[str] = FINAL_STATES - {KEPT_FINAL_STATE}
"""Job states whose outputs under `published/{job}/` are withdrawn: the final states but completed
(schemas/lifecycle.json `final_states`: cancelled, failed, rejected)."""


def must_withdraw(state: str | None) -> bool:
    """Whether a job in `state` (its projected `job_state.state`; None: unknown job) must have no
    public outputs. Pure. Live and reopenable states keep them: a running or replayed publish
    promotes the same objects again, idempotently."""
    return state in WITHDRAWN_STATES


@dataclass(frozen=True)
class PublishedObject:
    """One object found under `published/{job}/`: its key and when the store says it was written
    (UTC)."""

    key: str
    last_modified: datetime


@dataclass(frozen=True)
class Withdrawal:
    """What to withdraw of one job: the keys (key order) and when the first of them became public
    (the earliest `last_modified`; None when there is nothing)."""

    keys: tuple[str, ...]
    public_since: datetime | None

    def __bool__(self) -> bool:
        return bool(self.keys)


def plan_withdrawal(state: str | None, found: Iterable[PublishedObject]) -> Withdrawal:
    """The objects of a job in `state` to withdraw, of those `found` under its `published/{job}/`
    prefix: all of them when `must_withdraw(state)`, else none. Pure."""
    objects = sorted(found, key=lambda o: o.key) if must_withdraw(state) else []
    return Withdrawal(tuple(o.key for o in objects), min((o.last_modified for o in objects), default=None))


def ending_answer(done: str, withdrawal: Withdrawal) -> str:
    """The operator's answer to an action that ended a job (`done`, e.g. "cancelled (publish attempt
    1, was running)"), truthful about a publish it raced: when outputs had already been made public,
    it says since when and that they are withdrawn. Pure. Times in UTC, to the second."""
    if not withdrawal:
        return done
    since = withdrawal.public_since.strftime("%Y-%m-%d %H:%M:%S UTC") if withdrawal.public_since else "an unknown time"
    return (f"{done}; {len(withdrawal.keys)} output(s) were already public at {since} (published/ of this job) "
            f"and are withdrawn (OutputsWithdrawn)")

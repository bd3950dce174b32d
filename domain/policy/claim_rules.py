"""Whether a worker may claim a work item, and whether a running attempt still owns its job: pure
decisions over the projected job row (`job_state`, dict) the worker reads once the projection has
caught up (processors/worker.py, claim protocol steps 1 and 3; the attempt's checks in
processors/attempt.py). The rules are docs/design.md "The lease protocol"."""

from __future__ import annotations

from typing import Any

from domain import events as ev
from domain.lifecycle import TERMINAL_STATES, position


def should_skip(row: dict[str, Any] | None, item: ev.WorkItem) -> str | None:
    """Why a work item must not be claimed, or None when it may. Pure.

    An item of the job's current attempt may be claimed only while the projection shows that attempt
    `queued` (its `StageQueued` applied, nobody's `AttemptStarted` yet). Once claimed it is `running`
    with a claim token, and once it ended (failed and `retry_scheduled`, stalled, yielded) it is never
    claimed again, whatever produced the duplicate item (a re-drive, a replay raced by another, a
    producer retry): the next try is always a new attempt with its own `StageQueued` (issue 26 item 7)."""
    if row is None:
        return "unknown job"
    if row["state"] in TERMINAL_STATES:
        return f"job already ended ({row['state']})"
    current = position(row, row["stage"], row["attempt"])
    wanted = position(row, item.stage, item.attempt)
    if wanted < current:
        return f"stale work item: job is at {row['stage']} attempt {row['attempt']}"
    if wanted == current and row["state"] == "running" and row.get("claim_token"):
        return "attempt already claimed"
    if wanted == current and row["state"] != "queued":
        return f"attempt already ended (job is {row['state']} after {row['stage']} attempt {row['attempt']})"
    return None


def projection_behind(row: dict[str, Any] | None, item: ev.WorkItem) -> bool:
    """Whether the projected row has not yet applied the `StageQueued` of `item`. Pure."""
    if row is None:
        return True
    if row["state"] in TERMINAL_STATES:
        return False
    return position(row, row["stage"], row["attempt"]) < position(row, item.stage, item.attempt)


def superseded_reason(row: dict[str, Any] | None, stage: str, attempt: int, claim_token: str) -> str | None:
    """Why a running attempt no longer owns its job (seen in the projection), or None. Pure.

    A row that has not yet caught up with our own claim (same attempt, no token yet) is not a reason.
    """
    if row is None:
        return None
    if row["state"] in TERMINAL_STATES:
        return f"job ended ({row['state']})"
    if position(row, row["stage"], row["attempt"]) > position(row, stage, attempt):
        return f"superseded by {row['stage']} attempt {row['attempt']}"
    if row["attempt"] == attempt and row.get("claim_token") not in (None, claim_token):
        return "another claim owns this attempt"
    return None

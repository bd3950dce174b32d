"""Pure shapes of projection rows, shared by the read helpers (`projections/read_model.py`, over a
PostgreSQL connection) and the processors (over the `JobStore` port, which imports no client
library): a dead letter's attempt counts and the tiers' backlog. `projections.read_model` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from domain.policy.tiers import TIERS


def letter_attempts(row: dict[str, Any]) -> dict[str, Any]:
    """A dead-letter row with `attempts_text` (`attempts_text`) and `attempts` = the stage's attempts the job had started when it was
    dead-lettered (its attempt number: a replayed job keeps counting, so a job replayed and out of
    attempts again shows 6, not 3) and `budget_attempts` = those of the budget it ran out of (the
    `JobDeadLettered.attempts` the writer recorded). A record's dead letter has neither. Pure."""
    recorded = row.get("attempts")
    attempt = row.get("attempt")
    total = max(recorded, attempt) if recorded is not None and attempt is not None else recorded
    return {**row, "attempts": total, "budget_attempts": recorded, "attempts_text": attempts_text(total, recorded)}


def attempts_text(attempts: int | None, budget_attempts: int | None) -> str:
    """A dead letter's attempts in the words the CLI and the dashboard both show: `6 (3 counted
    against its last budget)` for a replayed job, `3` for a first dead letter, `-` for a record's. Pure."""
    if not attempts:
        return "-"
    if budget_attempts and budget_attempts != attempts:
        return f"{attempts} ({budget_attempts} counted against its last budget)"
    return str(attempts)


@dataclass(frozen=True)
class TierBacklog:
    """One priority tier's load, from `job_state`: jobs `waiting` (accepted, queued or
    retry_scheduled), `running`, and `completed_recently` (in the last `window_s` seconds)."""

    tier: str
    waiting: int
    running: int
    completed_recently: int
    window_s: float

    @property
    def backlog(self) -> int:
        """Jobs accepted and not yet ended: waiting + running."""
        return self.waiting + self.running

    def drain_estimate_s(self, excess: int = 1) -> float | None:
        """Seconds until `excess` jobs of this tier have ended at the recent completion rate
        (completed_recently / window_s); None when nothing completed in the window."""
        if self.completed_recently <= 0:
            return None
        return excess * self.window_s / self.completed_recently


def tier_backlogs(rows: list[dict[str, Any]], window_s: float) -> dict[str, TierBacklog]:
    """Every tier of `TIERS` (zeros for a tier without a row) -> its `TierBacklog`, from the rows of
    the `tier_backlog` query (`tier`, `waiting`, `running`, `completed_recently`) measured over the
    last `window_s` seconds. Pure."""
    found = {row["tier"]: row for row in rows}
    result = {}
    for tier in TIERS:
        row = found.get(tier) or {}
        result[tier] = TierBacklog(tier, int(row.get("waiting") or 0), int(row.get("running") or 0),
                                   int(row.get("completed_recently") or 0), window_s)
    return result

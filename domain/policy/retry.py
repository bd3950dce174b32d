"""The retry decision (docs/design.md "Error classes" and "Retry policy"); the error classes and how
each is retried are the one table `domain/error_classes.py` `ERROR_CLASSES`.

`retry_decision(error_class, attempt, policy)` is pure: what to do after attempt number `attempt`
(1-based, graceful yields not counted) failed. Defaults from docs/design.md: at most 3 attempts, backoff
60 s, 300 s, 900 s (the last repeats), with +-10 % jitter; a stall (`worker_lost`, `progress_stalled`)
is retried at once; input errors and the submitter's quota are never retried. A schedule may be set
per error class.
"""

from __future__ import annotations

import random
from datetime import timedelta
from dataclasses import dataclass, field
from enum import Enum

from domain import events as ev
from domain.error_classes import error_class as error_class_row
from domain.error_classes import AT_ONCE, AT_ONCE_FREE, ERROR_CLASSES, ErrorClass  # noqa: F401 (re-exported)


STALL_ERROR_CLASSES: dict[str, str] = {
    "lease_expired": "worker_lost",  # no heartbeat within the lease: the worker (or its host) is gone
    "worker_exited": "worker_lost",  # its supervisor saw the process die
    "no_progress": "progress_stalled",  # the worker was alive and heartbeating; its ffmpeg stopped advancing
    "region_lost": "region_lost",  # the attempt's region failed over (tapeline region failover)
}
"""The error class a stalled attempt's retry or dead letter records, named after what was seen
(events before this table recorded `worker_lost` for every stall; they read as before). The
`attempts` view (migration 023) maps `StallDetected.kind` the same way: tests/unit/test_decisions.py
checks that the two agree."""

STALL_BACKOFF_S: dict[str, tuple[float, ...]] = {c.name: (0.0,) for c in ERROR_CLASSES.values()
                                                 if c.retried in (AT_ONCE, AT_ONCE_FREE)}
"""The classes the error table retries at once (the stalls): the default per-class schedules."""


def stall_error_class(kind: str) -> str:
    """The error class of a stall of `kind` (`STALL_ERROR_CLASSES`; an unknown kind is `worker_lost`)."""
    return STALL_ERROR_CLASSES.get(kind, "worker_lost")


class Action(str, Enum):
    RETRY = "retry"
    FAIL = "fail"  # not retryable: JobFailed
    DEAD_LETTER = "dead_letter"  # retryable but out of attempts, or a class that goes to an operator at once


@dataclass(frozen=True)
class RetryDecision:
    action: Action
    next_attempt: int | None
    delay_s: float  # seconds to wait before the next attempt (0: at once)


@dataclass(frozen=True)
class RetryPolicy:
    """Max attempts and backoff (seconds per retry: the first retry waits `backoff_s[0]`, ...; the
    last entry repeats), jitter as a fraction, and optional per-class schedules."""

    max_attempts: int = 3
    backoff_s: tuple[float, ...] = (60.0, 300.0, 900.0)
    jitter: float = 0.1
    backoff_by_class: dict[str, tuple[float, ...]] = field(default_factory=lambda: dict(STALL_BACKOFF_S))


def retry_decision(error_class: str, attempt: int, policy: RetryPolicy,
                   rng: random.Random | None = None) -> RetryDecision:
    """What to do after attempt number `attempt` (1-based) failed with `error_class`.

    Unknown class names count as `unknown` (retryable). `rng` draws the jitter (a seeded one in
    tests); the delay is `schedule[attempt - 1]` (last entry repeating) times 1 +- jitter.
    """
    spec = error_class_row(error_class)
    if not spec.retryable:  # ends the job now, with its class's terminal event
        return RetryDecision(Action.DEAD_LETTER if spec.terminal_event == "JobDeadLettered" else Action.FAIL, None, 0.0)
    if attempt >= policy.max_attempts:
        return RetryDecision(Action.DEAD_LETTER, None, 0.0)
    schedule = policy.backoff_by_class.get(spec.name, policy.backoff_s) or (0.0,)
    base = schedule[min(attempt, len(schedule)) - 1]
    spread = (rng or random).uniform(-policy.jitter, policy.jitter) if base > 0 else 0.0
    return RetryDecision(Action.RETRY, attempt + 1, max(0.0, base * (1 + spread)))


def retry_scheduled(delay_s: float, stamp: ev.Stamp, **fields) -> ev.RetryScheduled:
    """A `RetryScheduled` written at `stamp.occurred_at` (the writer's clock, UTC) whose `not_before`
    is `delay_s` seconds later.

    Only the difference is used: the projector adds it to the event's broker time, so the due time
    is on the log clock whatever the writer's clock says.
    """
    return ev.RetryScheduled.new(stamp, not_before=stamp.occurred_at + timedelta(seconds=delay_s), **fields)

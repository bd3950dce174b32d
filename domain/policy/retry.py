"""Error classes and the retry decision, as data (docs/design.md "Error classes" and "Retry policy").

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


@dataclass(frozen=True)
class ErrorClass:
    name: str
    retryable: bool
    terminal_event: str  # event that ends the job when this class is not retried
    from_the_file: bool = True  # the source file can cause it: the same file failing the same way (in another
    # job, or again after a replay) points at the file; False for the infrastructure's own classes


ERROR_CLASSES: dict[str, ErrorClass] = {c.name: c for c in (
    ErrorClass("invalid_input", False, "JobFailed"),
    ErrorClass("unsupported_media", False, "JobFailed"),
    ErrorClass("limits_exceeded", False, "JobFailed"),
    ErrorClass("quota_exceeded", False, "JobRejected", from_the_file=False),
    ErrorClass("provider_throttled", True, "JobDeadLettered", from_the_file=False),
    ErrorClass("storage_transient", True, "JobDeadLettered", from_the_file=False),
    # A published key holds other bytes (another deployment's job, or a stale object in a shared
    # bucket): a retry writes to the same key and meets the same object, so it goes to an operator
    # at once, reopenable once the object is dealt with.
    ErrorClass("output_conflict", False, "JobDeadLettered", from_the_file=False),
    ErrorClass("broker_transient", True, "JobDeadLettered", from_the_file=False),
    ErrorClass("timeout", True, "JobDeadLettered"),
    ErrorClass("out_of_memory", True, "JobDeadLettered"),
    ErrorClass("worker_lost", True, "JobDeadLettered"),
    ErrorClass("progress_stalled", True, "JobDeadLettered"),
    # An attempt lost with its region (a failover): retried at once in the region that took over,
    # and its attempt is given back (domain/lifecycle.py FREE_STALL_KINDS).
    ErrorClass("region_lost", True, "JobDeadLettered", from_the_file=False),
    ErrorClass("unknown", True, "JobDeadLettered"),
)}

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

STALL_BACKOFF_S: dict[str, tuple[float, ...]] = {name: (0.0,) for name in set(STALL_ERROR_CLASSES.values())}
"""A stall is retried at once (docs/design.md, error class table): the default per-class schedules."""


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
    spec = ERROR_CLASSES.get(error_class, ERROR_CLASSES["unknown"])
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

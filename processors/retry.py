"""Error classes and the retry decision, as data (DESIGN.md "Error classes" and "Retry policy").

The walking skeleton retries a retryable failure at once as the next attempt, bounded by
`max_attempts`; backoff schedules and `not_before` come with the retry-policy work (issue 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class ErrorClass:
    name: str
    retryable: bool
    terminal_event: str  # event that ends the job when this class is not retried


ERROR_CLASSES: dict[str, ErrorClass] = {c.name: c for c in (
    ErrorClass("invalid_input", False, "JobFailed"),
    ErrorClass("unsupported_media", False, "JobFailed"),
    ErrorClass("limits_exceeded", False, "JobFailed"),
    ErrorClass("quota_exceeded", False, "JobRejected"),
    ErrorClass("provider_throttled", True, "JobDeadLettered"),
    ErrorClass("storage_transient", True, "JobDeadLettered"),
    ErrorClass("broker_transient", True, "JobDeadLettered"),
    ErrorClass("timeout", True, "JobDeadLettered"),
    ErrorClass("out_of_memory", True, "JobDeadLettered"),
    ErrorClass("worker_lost", True, "JobDeadLettered"),
    ErrorClass("unknown", True, "JobDeadLettered"),
)}


class Action(str, Enum):
    RETRY = "retry"
    FAIL = "fail"  # not retryable: JobFailed
    DEAD_LETTER = "dead_letter"  # retryable but out of attempts


@dataclass(frozen=True)
class RetryDecision:
    action: Action
    next_attempt: int | None
    delay_s: float


def retry_decision(error_class: str, attempt: int, max_attempts: int) -> RetryDecision:
    """What to do after attempt number `attempt` (1-based) failed with `error_class`.

    Unknown class names count as `unknown` (retryable).
    """
    spec = ERROR_CLASSES.get(error_class, ERROR_CLASSES["unknown"])
    if not spec.retryable:
        return RetryDecision(Action.FAIL, None, 0.0)
    if attempt >= max_attempts:
        return RetryDecision(Action.DEAD_LETTER, None, 0.0)
    return RetryDecision(Action.RETRY, attempt + 1, 0.0)

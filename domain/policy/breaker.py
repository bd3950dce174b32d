"""The per-provider circuit breaker and quota windows, as pure functions over frozen values.

Breaker states (one per provider, shared by every publish process through PostgreSQL, see
`processors/provider_guard.py`):

- `closed`: posts go through. A 429 or a 5xx (or no answer) opens it.
- `open` until `until`: no post is attempted; an attempt that meets it is deferred to `until`.
  The cooldown is the provider's `Retry-After` when it sent one, else
  `base_cooldown_s * 2 ** (failures - 1)` capped at `max_cooldown_s` (`failures`: consecutive).
- `half_open` until `until` (the probe's deadline): exactly one job (`probe_job`) may post; any
  other attempt is deferred to the deadline. The probe's success closes the breaker; its failure
  reopens it with a longer cooldown. A probe that never reports (its worker died) lapses at the
  deadline and the next attempt becomes the probe.

Every function takes `now` (UTC, the PostgreSQL clock in production) and returns the new state or
None when nothing changes; `version` increases by one with each change, so the projection keeps
the latest change whatever order its partitions are replayed in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Literal

State = Literal["closed", "open", "half_open"]


@dataclass(frozen=True)
class Breaker:
    """One provider's breaker. `until`: end of the cooldown (open) or the probe's deadline
    (half_open), None when closed. `failures`: consecutive failures that opened it."""

    state: State = "closed"
    until: datetime | None = None
    failures: int = 0
    probe_job: str | None = None
    version: int = 0
    reason: str = ""
    http_status: int | None = None


@dataclass(frozen=True)
class BreakerPolicy:
    """Cooldowns in seconds: the first failure without `Retry-After` waits `base_cooldown_s`, each
    further consecutive one twice as long, at most `max_cooldown_s`; a probe holds the half-open
    breaker for at most `probe_timeout_s`."""

    base_cooldown_s: float = 5.0
    max_cooldown_s: float = 300.0
    probe_timeout_s: float = 20.0

    def cooldown_s(self, failures: int, retry_after_s: float | None) -> float:
        """Seconds to stay open after the `failures`-th consecutive failure (1-based)."""
        if retry_after_s is not None:
            return max(0.0, retry_after_s)  # the provider said when: honour it exactly
        return min(self.max_cooldown_s, self.base_cooldown_s * 2 ** max(0, failures - 1))


@dataclass(frozen=True)
class Admission:
    """What the breaker says to one attempt: `post` (closed), `probe` (it is the half-open probe),
    or `wait` until `until`. `change` is the new breaker state when admitting changed it."""

    decision: Literal["post", "probe", "wait"]
    until: datetime | None = None
    change: Breaker | None = None


def admit(breaker: Breaker, job_id: str, now: datetime, policy: BreakerPolicy) -> Admission:
    """May `job_id` post now? Pure."""
    if breaker.state == "closed":
        return Admission("post")
    probe_until = now + timedelta(seconds=policy.probe_timeout_s)
    if breaker.state == "open":
        if breaker.until is not None and now < breaker.until:
            return Admission("wait", breaker.until)
        return Admission("probe", probe_until, _change(breaker, "half_open", probe_until, probe_job=job_id,
                                                       reason="cooldown over: one probe post", http_status=None))
    # half_open
    if breaker.probe_job == job_id:
        return Admission("probe", breaker.until)  # the probe's own retry (it never reported)
    if breaker.until is not None and now < breaker.until:
        return Admission("wait", breaker.until)
    return Admission("probe", probe_until, _change(breaker, "half_open", probe_until, probe_job=job_id,
                                                   reason=f"probe by {breaker.probe_job} lapsed: a new probe",
                                                   http_status=None))


def on_success(breaker: Breaker, job_id: str) -> Breaker | None:
    """A post (or a lookup) answered normally. Only the half-open probe closes the breaker; a
    success of a post that was in flight when it opened changes nothing. Pure."""
    if breaker.state == "half_open" and breaker.probe_job == job_id:
        return _change(breaker, "closed", None, failures=0, probe_job=None, reason="probe succeeded",
                       http_status=None)
    return None


def on_abandoned(breaker: Breaker, job_id: str, now: datetime) -> Breaker | None:
    """The half-open probe's attempt stopped without a provider answer (a review stop, fenced): the
    probe lapses now, so the next attempt probes instead of waiting for its deadline. Pure."""
    if breaker.state == "half_open" and breaker.probe_job == job_id:
        return _change(breaker, "half_open", now, probe_job=None, reason=f"probe by {job_id} stopped without an answer",
                       http_status=None)
    return None


def on_failure(breaker: Breaker, job_id: str, now: datetime, policy: BreakerPolicy, *, http_status: int | None,
               retry_after_s: float | None, detail: str) -> Breaker | None:
    """A post failed with 429, 5xx or no answer (`http_status` None). Opens (or reopens, with the
    next longer cooldown) the breaker; while already open, only a later end of cooldown extends
    it. Pure."""
    if breaker.state == "open":
        until = now + timedelta(seconds=policy.cooldown_s(max(1, breaker.failures), retry_after_s))
        if breaker.until is not None and until <= breaker.until:
            return None
        return _change(breaker, "open", until, reason=f"still failing: {detail}", http_status=http_status)
    failures = breaker.failures + 1
    until = now + timedelta(seconds=policy.cooldown_s(failures, retry_after_s))
    what = "probe failed" if breaker.state == "half_open" and breaker.probe_job == job_id else "post failed"
    return _change(breaker, "open", until, failures=failures, probe_job=None, reason=f"{what}: {detail}",
                   http_status=http_status)


def _change(breaker: Breaker, state: State, until: datetime | None, **fields) -> Breaker:
    return replace(breaker, state=state, until=until, version=breaker.version + 1, **fields)


@dataclass(frozen=True)
class QuotaWait:
    """A full quota window: `window` (`minute` or `day`), its length in seconds, the limit, the
    posts counted in it and when the oldest of them leaves it (the next slot frees)."""

    window: str
    window_s: float
    limit: int
    used: int
    until: datetime


def quota_wait(ends: list[datetime], now: datetime, windows: list[tuple[str, float, int | None]]) -> QuotaWait | None:
    """Whether one more post would exceed a quota. Pure.

    `ends`: when each earlier post (or reservation) ended at the provider, UTC (a post in flight
    ends `now` at the earliest); a post occupies its window until `end + window_s`, so the provider,
    whatever moment it received a post at, never sees more than `limit` inside any `window_s`.
    `windows`: `(name, window_s, limit)`, a limit of None meaning no quota. Returns the window whose
    slot frees last, or None when every window has room.
    """
    worst: QuotaWait | None = None
    for name, window_s, limit in windows:
        if limit is None:
            continue
        occupying = sorted(end for end in ends if end + timedelta(seconds=window_s) > now)
        if len(occupying) < limit:
            continue
        if limit <= 0:
            frees = now + timedelta(seconds=window_s)  # no post at all: look again a window later
        else:
            frees = occupying[len(occupying) - limit] + timedelta(seconds=window_s)
        wait = QuotaWait(name, window_s, limit, len(occupying), frees)
        if worst is None or wait.until > worst.until:
            worst = wait
    return worst

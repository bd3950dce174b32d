"""A provider's circuit breaker and quotas, shared by every publish process through PostgreSQL.

Protocol around one provider call (inside the in-flight slot of `ProviderLimits`):
  Step 1. admit, in one PostgreSQL transaction holding the provider's advisory lock
          (`PROVIDER_GATE_LOCK`), with `now` from the database's clock:
          a. the breaker (`provider_state`, pure rules in `domain/policy/breaker.py`): open -> defer to
             the end of the cooldown; half-open with another attempt's probe -> defer to the probe's
             deadline; open past its cooldown -> this attempt becomes the probe;
          b. the quotas (`provider_calls` reservations plus projected `Published` events): a full
             window -> defer to when its oldest post leaves it;
          c. a breaker change is committed as `ProviderBreakerChanged` on the attempt's fenced
             producer, then applied to `provider_state` (the projector applies the same event again,
             idempotently); a reservation row is inserted;
          A deferral raises `ProviderDeferred`: nothing was changed, claimed or posted.
  Step 2. the caller makes the call;
  Step 3. report, under the same lock: the reservation ends (`posted` / `failed`; deleted when the
          call never reached the provider), and the breaker changes: 429, 5xx or no answer opens or
          reopens it, the probe's success closes it. A failed attempt's retry waits until the end
          of the cooldown (`retry_after_s` of the raised error).
Because check-and-reserve runs under one lock and reservations are written before the call, two
publish processes can never both take the last slot of a window, and a post occupies its window
from before it is sent until `window` after it answered, so the provider never counts more than the
quota in any window of that length, whatever moment it receives each post.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Callable

import structlog

from domain.policy.breaker import Breaker, BreakerPolicy, admit, on_abandoned, on_failure, on_success, quota_wait
from domain.lifecycle import PAYLOAD_OMITS
from domain import events as ev
from domain.errors import Fenced, ProviderDeferred, ProviderError
from tapeline.settings import Settings
from tapeline.ports import Clock, JobStore, LockTimeout

log = structlog.get_logger("tapeline.provider_guard")

PROVIDER_GATE_LOCK = 0x7A9E_0030
"""Advisory-lock class id of a provider's check-and-reserve step (object id: crc32 of its name)."""

MIN_DEFER_S = 0.1
"""A deferral waits at least this long (seconds): never a retry loop at full speed."""

ADMIT_LOCK_TIMEOUT_S = 10.0
"""Admission waits at most this long for the provider's lock (seconds), then defers the attempt."""


@dataclass(frozen=True)
class Ticket:
    """An admitted call: its reservation row and whether it is the half-open probe."""

    call_id: int
    probe: bool


def breaker_change_params(event: ev.ProviderBreakerChanged) -> dict[str, Any]:
    """Parameters of the `apply_provider_breaker_changed` query for `event`: its evidence payload (the
    fields without a column, `writes.PAYLOAD_OMITS` left out) and the envelope values the function
    takes from an evidence row's columns (event_id, job_id, occurred_at)."""
    return {"payload": event.model_dump_json(exclude=PAYLOAD_OMITS), "event_id": event.event_id,
            "job_id": event.job_id, "occurred_at": event.occurred_at}


def breaker_from_row(row: dict[str, Any] | None) -> Breaker:
    """The breaker a `provider_state` row describes (closed when the provider has no row). Pure."""
    if row is None:
        return Breaker()
    return Breaker(state=row["state"], until=row["until"], failures=row["failures"], probe_job=row["probe_job"],
                   version=row["version"], reason=row["reason"], http_status=row["http_status"])


class ProviderGuard:
    """The breaker and quotas of one provider for one attempt (see the module docstring).

    `jobs`: the job store (its named operations on the live projection schema; `transaction()` for
    each step).
    `record`: commits events on the attempt's fenced producer (raises `Fenced`).
    `make_event`: `make_event(cls, **fields)` builds an event of the attempt.
    `clock`: the time of a deferral made without the database's clock (its lock was busy).
    """

    def __init__(self, jobs: JobStore, provider: str, settings: Settings, job_id: str,
                 record: Callable[[list[ev.Event]], None], make_event: Callable[..., ev.Event], *,
                 clock: Clock) -> None:
        self.jobs, self.provider, self.job_id, self.clock = jobs, provider, job_id, clock
        self.record, self.make_event = record, make_event
        self.policy = BreakerPolicy(base_cooldown_s=settings.webhook_cooldown_s,
                                    max_cooldown_s=settings.webhook_cooldown_max_s,
                                    probe_timeout_s=settings.webhook_probe_timeout_s)
        self.windows = [("minute", settings.webhook_quota_window_s, settings.webhook_quota),
                        ("day", settings.webhook_daily_window_s, settings.webhook_daily_quota)]
        # A reservation whose worker died occupies its window as if its call ended this long after
        # it began (the call cannot outlive its process; its timeouts bound it while alive).
        self.stale_s = 3 * settings.webhook_timeout_s + 5.0
        self.lock_id = zlib.crc32(provider.encode()) - 2**31  # a signed int4

    def _lock(self, timeout_s: float | None = None) -> datetime:
        """Take the provider's lock (call inside a transaction; `timeout_s`: raise
        `LockTimeout` after that long); returns the database's clock."""
        if timeout_s is not None:
            self.jobs.run("transaction_lock_timeout", {"timeout": f"{int(timeout_s * 1000)}ms"})
        row = self.jobs.one("provider_gate_lock", {"lock_class": PROVIDER_GATE_LOCK, "lock_id": self.lock_id})
        return row["now"]

    def breaker(self) -> Breaker:
        return breaker_from_row(self.jobs.one("provider_breaker", {"provider": self.provider}))

    def _change(self, old: Breaker, new: Breaker) -> None:
        """Step 1c / 3: commit the change as an event, then apply it to `provider_state`."""
        event = self.make_event(ev.ProviderBreakerChanged, sequence=f"{self.provider}.{new.version}",
                                provider=self.provider, from_state=old.state, to_state=new.state, until=new.until,
                                reason=new.reason[:500], http_status=new.http_status, failures=new.failures,
                                version=new.version)
        self.record([event])
        self.jobs.run("apply_provider_breaker_changed", breaker_change_params(event))
        log.warning("provider breaker changed", provider=self.provider, from_state=old.state, to_state=new.state,
                    until=new.until.isoformat() if new.until else None, reason=new.reason)

    def _defer(self, now: datetime, until: datetime, wait: str, message: str, **fields: Any) -> ProviderDeferred:
        return ProviderDeferred(message, provider=self.provider, wait=wait, until=until,
                                retry_after_s=max(MIN_DEFER_S, (until - now).total_seconds()), **fields)

    def admit(self, attempt: int, claim_token: str | None) -> Ticket:
        """Step 1. Returns the reservation; raises `ProviderDeferred` (nothing changed) or `Fenced`."""
        try:
            return self._admit(attempt, claim_token)
        except LockTimeout as exc:  # another process holds the lock too long (a slow broker)
            now = self.clock.now()
            raise self._defer(now, now + timedelta(seconds=1), "in_flight",
                              f"{self.provider}: admission lock busy for {ADMIT_LOCK_TIMEOUT_S:g} s") from exc

    def _admit(self, attempt: int, claim_token: str | None) -> Ticket:
        with self.jobs.transaction():
            now = self._lock(ADMIT_LOCK_TIMEOUT_S)
            breaker = self.breaker()
            admission = admit(breaker, self.job_id, now, self.policy)
            if admission.decision == "wait":
                wait = "cooldown" if breaker.state == "open" else "probe"
                what = (f"breaker open until {admission.until:%H:%M:%S.%f} UTC ({breaker.reason})" if wait == "cooldown"
                        else f"breaker half-open: job {breaker.probe_job} probes until {admission.until:%H:%M:%S.%f} UTC")
                raise self._defer(now, admission.until, wait, f"{self.provider} {what}")
            since = now - timedelta(seconds=max(w for _, w, _ in self.windows))
            ends = [r["ends_at"] for r in self.jobs.all("provider_call_ends", {
                "provider": self.provider, "now": now, "stale_s": self.stale_s, "since": since})]
            full = quota_wait(ends, now, self.windows)
            if full is not None:
                raise self._defer(now, full.until, "quota",
                                  f"{self.provider} quota reached: {full.used} posts in the last {full.window_s:g} s "
                                  f"(limit {full.limit} per {full.window}); next slot at {full.until:%H:%M:%S.%f} UTC",
                                  window=full.window, window_s=full.window_s, limit=full.limit, used=full.used)
            if admission.change is not None:
                self._change(breaker, admission.change)
            call_id = self.jobs.one("reserve_provider_call", {
                "provider": self.provider, "job_id": self.job_id, "attempt": attempt, "claim_token": claim_token,
                "now": now})["id"]
            self.jobs.run("forget_provider_calls", {"provider": self.provider,
                                                    "before": since - timedelta(seconds=self.stale_s)})
        return Ticket(call_id, admission.decision == "probe")

    def succeeded(self, ticket: Ticket) -> None:
        """Step 3 after the provider answered normally (a post, or a lookup that found it)."""
        with self.jobs.transaction():
            self._lock()
            self.jobs.run("finish_provider_call", {"id": ticket.call_id, "outcome": "posted"})
            breaker = self.breaker()
            change = on_success(breaker, self.job_id)
            if change is not None:
                self._change(breaker, change)

    def failed(self, ticket: Ticket, error: ProviderError) -> None:
        """Step 3 after the call failed. A provider failure (429, 5xx, no answer) opens the breaker
        and sets `error.retry_after_s` to the end of its cooldown (seconds from now)."""
        with self.jobs.transaction():
            now = self._lock()
            if getattr(error, "sent", True) is False:
                self.jobs.run("release_provider_call", {"id": ticket.call_id})
            else:
                self.jobs.run("finish_provider_call", {"id": ticket.call_id, "outcome": "failed"})
            breaker = self.breaker()
            status = getattr(error, "http_status", None)
            if error.error_class != "provider_throttled":  # another 4xx: the provider is up, our request is not
                change = on_success(breaker, self.job_id)
            else:
                change = on_failure(breaker, self.job_id, now, self.policy, http_status=status,
                                    retry_after_s=error.retry_after_s, detail=str(error)[:200])
            if change is not None:
                self._change(breaker, change)
                breaker = change
            if error.error_class == "provider_throttled" and breaker.state == "open" and breaker.until is not None:
                error.retry_after_s = max(MIN_DEFER_S, (breaker.until - now).total_seconds())

    def abandoned(self, ticket: Ticket) -> None:
        """Step 3 when the attempt stopped without a provider answer (a review stop, fenced, a bug):
        the reservation keeps its slot as if the call was made (it may have been); a probe lapses at
        once. Best effort: a fenced attempt cannot record the lapse, and the probe's deadline ends it."""
        with self.jobs.transaction():
            now = self._lock()
            self.jobs.run("finish_provider_call", {"id": ticket.call_id, "outcome": "failed"})
            breaker = self.breaker()
            change = on_abandoned(breaker, self.job_id, now) if ticket.probe else None
            if change is not None:
                try:
                    self._change(breaker, change)
                except Fenced:
                    log.info("fenced: the probe lapses at its deadline instead")


def deferred_event(make_event: Callable[..., ev.Event], deferral: ProviderDeferred) -> ev.Event:
    """The `PublishDeferred` of a deferral (committed with the attempt's failure)."""
    return make_event(ev.PublishDeferred, provider=deferral.provider, wait=deferral.wait, until=deferral.until,
                      window=deferral.window, window_s=deferral.window_s, limit=deferral.limit, used=deferral.used,
                      detail=str(deferral)[:500])

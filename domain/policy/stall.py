"""What a stall is: the one rule, its kinds and its thresholds.

Tapeline notices a job that stops moving while every process still answers its health check. The
rule, judged on the **log clock** (the broker time of the newest record of the job's partition of
the lifecycle log; never a machine's clock):

- a running attempt is stalled when
  - `lease_expired`: its lease ended (`leased_until` = last claim or heartbeat + the lease, seconds)
    before the log clock: its process died, froze or lost the network; or else
  - `no_progress`: its heartbeats arrive, but its progress counters (frames, seconds of output)
    have not moved for `no_progress_timeout_s` plus the attempt's own `progress_grace_s` (the
    seconds of a step that reports no frames, such as the checks after an encode);
- `worker_exited`: a supervisor saw the process that held the attempt exit, or a restarted worker
  found an attempt held by an earlier incarnation of its own identity (`processors/rescue.py`;
  decided there, on the spot, without a clock);
- a queued stage is a stalled `handoff` when nobody claimed it for `handoff_timeout_s` since it was
  queued (or last re-driven): the watchdog sends its work item again;
- an upload is `expected_work_missing` when no job came of it within `intake_timeout_s` on the
  newest log clock of all partitions;
- but an attempt whose lease or progress deadline fell after a **log outage** began (the log
  refused the watchdog's ticks: a broker outage) is not judged until one lease after the log
  accepted writes again (`excused_by_outage`): its heartbeats could not be written either.

Before the verdict, a running attempt is **suspect** (`attempt_suspect`, issue 45) once its progress
counters, or its heartbeats, have been still for more than `suspect_fraction` of their allowance:
the views and the dashboard show "no progress for 95 s of the 120 s allowance" while the watchdog
has yet to act.

The SQL views `stalled_attempts`, `stalled_handoffs`, `expected_work_missing` and `suspect_attempts`
(migrations 016, 019, 020, 032) select the candidates with the same comparisons, so the watchdog reads few rows; the
watchdog decides with the functions below (`processors/watchdog.py` `run_once`), and
`tests/integration/test_stall_rule.py` checks the views select exactly what these functions call
stalled.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

StallKind = Literal["lease_expired", "no_progress", "worker_exited", "handoff", "expected_work_missing",
                    "region_lost"]

STALL_KINDS: tuple[StallKind, ...] = ("lease_expired", "no_progress", "worker_exited", "handoff",
                                      "expected_work_missing", "region_lost")
"""Every `StallDetected.kind` (the watchdog's metric exports each at 0 before the first one)."""

ATTEMPT_STALL_KINDS: tuple[StallKind, ...] = ("lease_expired", "no_progress", "worker_exited", "region_lost")
"""The kinds that end a running attempt (a retry or a dead letter follows)."""


@dataclass(frozen=True)
class StallThresholds:
    """The watchdog's thresholds, seconds (settings `TAPELINE_NO_PROGRESS_TIMEOUT_S`,
    `TAPELINE_HANDOFF_TIMEOUT_S`, `TAPELINE_INTAKE_TIMEOUT_S`; written to the `stall_policy` table
    at the watchdog's start so the views use the same numbers)."""

    no_progress_timeout_s: float = 120.0
    handoff_timeout_s: float = 120.0
    intake_timeout_s: float = 120.0
    suspect_fraction: float = 0.5
    """An attempt is suspect once its progress counters (or its heartbeats) have been still for more
    than this fraction of their allowance (`attempt_suspect`; setting `TAPELINE_SUSPECT_FRACTION`)."""


@dataclass(frozen=True)
class AttemptStall:
    """A running attempt that stopped moving: `kind`, and `since_s`, seconds on the log clock since
    its last claim or heartbeat (lease_expired) or since its progress counters last moved
    (no_progress)."""

    kind: StallKind
    since_s: float


def attempt_stall(*, leased_until: datetime | None, last_heartbeat_at: datetime | None,
                  progress_at: datetime | None, progress_grace_s: float | None, now: datetime,
                  thresholds: StallThresholds) -> AttemptStall | None:
    """Whether a running attempt is stalled at log-clock time `now` (aware datetimes, broker time).

    An expired lease wins over frozen progress (a dead process also reports no progress). A missing
    time (None) never makes a stall by itself. Returns None when the attempt is moving."""
    if leased_until is not None and leased_until < now:
        since = now - (last_heartbeat_at or leased_until)
        return AttemptStall("lease_expired", since.total_seconds())
    if progress_at is not None:
        allowed = timedelta(seconds=thresholds.no_progress_timeout_s + (progress_grace_s or 0.0))
        if progress_at + allowed < now:
            return AttemptStall("no_progress", (now - progress_at).total_seconds())
    return None


@dataclass(frozen=True)
class AttemptSuspicion:
    """A running attempt not judged stalled yet but on its way: `kind` is what is running out
    (`no_progress`: its progress counters have not moved; `lease`: no heartbeat arrived),
    `still_s` seconds on the log clock since they last moved (or since the last heartbeat), of
    `allowance_s` seconds allowed before the watchdog's verdict (the no-progress timeout plus the
    attempt's grace; the lease)."""

    kind: Literal["no_progress", "lease"]
    still_s: float
    allowance_s: float

    @property
    def remaining_s(self) -> float:
        """Seconds left before the verdict, at least 0."""
        return max(0.0, self.allowance_s - self.still_s)

    def words(self) -> str:
        """e.g. "no progress for 95 s of the 120 s allowance", "no heartbeat for 70 s of the 120 s lease"."""
        if self.kind == "lease":
            return f"no heartbeat for {self.still_s:.0f} s of the {self.allowance_s:.0f} s lease"
        return f"no progress for {self.still_s:.0f} s of the {self.allowance_s:.0f} s allowance"


def attempt_suspect(*, leased_until: datetime | None, last_heartbeat_at: datetime | None,
                    progress_at: datetime | None, progress_grace_s: float | None, now: datetime,
                    thresholds: StallThresholds) -> AttemptSuspicion | None:
    """Whether a running attempt is suspect at log-clock time `now` (aware datetimes, broker time):
    not stalled yet (`attempt_stall` says None), but its progress counters have been still for more
    than `thresholds.suspect_fraction` of the no-progress allowance (`no_progress_timeout_s` + the
    attempt's `progress_grace_s`), or no heartbeat arrived for more than that fraction of its lease
    (`leased_until` - `last_heartbeat_at`). Of both, the one nearer its verdict (the least time
    left). The view `suspect_attempts` (migration 032) pre-selects the same rows. None when the
    attempt moves, or is stalled already (the watchdog's business)."""
    if attempt_stall(leased_until=leased_until, last_heartbeat_at=last_heartbeat_at, progress_at=progress_at,
                     progress_grace_s=progress_grace_s, now=now, thresholds=thresholds) is not None:
        return None
    found = []
    if progress_at is not None:
        allowance = thresholds.no_progress_timeout_s + (progress_grace_s or 0.0)
        still = (now - progress_at).total_seconds()
        if still > thresholds.suspect_fraction * allowance:
            found.append(AttemptSuspicion("no_progress", still, allowance))
    if leased_until is not None and last_heartbeat_at is not None:
        lease = (leased_until - last_heartbeat_at).total_seconds()
        silent = (now - last_heartbeat_at).total_seconds()
        if lease > 0 and silent > thresholds.suspect_fraction * lease:
            found.append(AttemptSuspicion("lease", silent, lease))
    return min(found, key=lambda s: s.remaining_s) if found else None


def handoff_redrive_due(*, queued_at: datetime | None, now: datetime, thresholds: StallThresholds) -> bool:
    """Whether a queued stage waited past `handoff_timeout_s` on the log clock since it was queued
    or last re-driven (`queued_at`), so its work item is sent again."""
    return queued_at is not None and queued_at + timedelta(seconds=thresholds.handoff_timeout_s) < now


def work_missing(*, uploaded_at: datetime, has_job: bool, now: datetime | None, thresholds: StallThresholds) -> bool:
    """Whether an upload (first copy at broker time `uploaded_at`) should have become a job by
    `now`, the newest log clock of all partitions (None before any record: nothing is judged)."""
    return (not has_job and now is not None
            and uploaded_at + timedelta(seconds=thresholds.intake_timeout_s) < now)


def attempt_deadline(*, leased_until: datetime | None, progress_at: datetime | None,
                     progress_grace_s: float | None, thresholds: StallThresholds) -> datetime | None:
    """The log-clock time after which a running attempt is stalled if nothing more arrives: the end
    of its lease, or the end of its no-progress allowance, whichever comes first (None: neither is
    known). `attempt_stall` says "stalled" once the log clock is past this time."""
    ends = [leased_until] if leased_until is not None else []
    if progress_at is not None:
        ends.append(progress_at + timedelta(seconds=thresholds.no_progress_timeout_s + (progress_grace_s or 0.0)))
    return min(ends) if ends else None


WAKE_MARGIN_S = 0.02
"""Seconds past a deadline the watchdog wakes, so the tick it writes then is stamped after it."""


def next_wake_s(*, tick_s: float, elapsed_s: float, due_in_s: list[float]) -> float:
    """Seconds the watchdog waits before its next tick.

    `tick_s`: the regular period; `elapsed_s`: seconds since the last tick began; `due_in_s`: the
    deadlines still to come (`attempt_deadline`, a scheduled retry's due time), each in seconds
    after the last tick's log clock. The next tick comes at the regular time, or just after the
    earliest deadline when that is sooner, so a lease that ends between two ticks is judged when it
    ends rather than up to a whole period later (the period is lease/8: 15 s at the default 120 s
    lease). Deadlines already reached (<= 0) were judged by the last tick and are ignored."""
    wait = tick_s - elapsed_s
    upcoming = [d for d in due_in_s if d > 0]
    if upcoming:
        wait = min(wait, min(upcoming) + WAKE_MARGIN_S - elapsed_s)
    return max(0.0, wait)


@dataclass(frozen=True)
class LogOutage:
    """A stretch in which the lifecycle log refused the watchdog's writes (its ticks failed or took
    far longer than a tick: partitions or the transaction coordinator without a leader), in
    log-clock time: `ended_at`, the newest log clock once a tick landed again, and `began_at`,
    that minus how long the ticks were refused (measured by the watchdog on its monotonic clock)."""

    began_at: datetime
    ended_at: datetime


def excused_by_outage(deadline: datetime, outage: LogOutage | None, now: datetime, lease_s: float) -> bool:
    """Whether a stall whose `deadline` (an attempt's `leased_until`, or its last progress plus the
    no-progress allowance) fell after a log outage began is not judged at log-clock time `now`: not
    until one lease (`lease_s`, seconds) after the log accepted writes again, since the attempt's
    heartbeats were refused as the watchdog's ticks were. A worker that is really gone is still
    caught, one lease later. Pure. Issue 24: a broker outage itself must not cost an attempt."""
    return outage is not None and deadline >= outage.began_at and now < outage.ended_at + timedelta(seconds=lease_s)


def stalled_row(job: dict[str, Any], kind: str, detail: str, now: datetime) -> dict[str, Any]:
    """A stalled-attempt row (the `stalled_attempts` view's shape, which the watchdog's `run_once`
    judges) for the running attempt of the projected `job` (a `job_state` row), of `kind` with
    `detail`. `since_s`: seconds from the attempt's last progress (else its last heartbeat) to
    `now`, 0 when it has neither. The rows the rescuer (`worker_exited`) and a failover
    (`region_lost`) make outside the view."""
    last = job.get("progress_at") or job.get("last_heartbeat_at")
    return {"job_id": job["job_id"], "stage": job["stage"], "attempt": job["attempt"], "kind": kind,
            "detail": detail, "last_progress_at": job.get("progress_at"),
            "since_s": max(0.0, (now - last).total_seconds()) if last else 0.0,
            "leased_until": job.get("leased_until"), "progress_frames": job.get("progress_frames"),
            "log_partition": job.get("log_partition")}

"""Operator actions: replay a dead-lettered job with a fresh attempt budget, fail one for good
(optionally crediting the submitter's quota back), resolve a job in needs_review, cancel a job.

Each action is a pure `*_events(row, ...)` core and an impure runner that reads the job's row from a
caught-up projection and commits the events in one Kafka transaction on `<app>.operator.<job_id>`
(`replay_dead_letters`, `resolve_review`, `cancel_job`). The CLI and the read API's actions call the
same runners.

Exactly once, whoever acts at the same moment (issue 26 item 7). Every action on a job, of any kind,
from any process, writes with the one transactional id `operator_transactional_id(job)`, and opens
it (`init_transactions`) *before* it reads the job: the transaction coordinator fences the producer
of any action on that job still in flight, so of two actions racing, the later-opened one reads a
projection that already holds everything the other committed, and the earlier one, if it had not
committed yet, is fenced and commits nothing. The one fenced waits for the winner's event to be
projected and reports it ("already replayed by ... at ..."): one effect, one event, a clear answer
for the other.
Actions emit events only; they never write projections (docs/design.md "Parts").

Replay is idempotent at three levels: a dead letter already marked replayed is left alone; a job
that is no longer dead-lettered (replayed by someone else, or completed) gets no events; and the
events carry dedup keys of the dead-lettered attempt (`{job}:{stage}:{attempt}:JobReplayed`, and the
next attempt's `StageQueued`), so two racing operators start one attempt.
"""

from __future__ import annotations

import getpass
import socket
from dataclasses import dataclass
from typing import Any, Callable

import structlog

from processors.runtime import Outgoing, Runtime, transact
from processors.watchdog import queue_attempt
from tapeline.rows import letter_attempts
from domain.lifecycle import REOPENABLE_STATES, TERMINAL_STATES
from domain import events as ev
from domain.errors import NoSuchJob, NotCancellable, NotReplayable
from tapeline.settings import Settings
from tapeline.ports import Clock, EventLog, JobStore, ObjectStorage
from tapeline.crashpoints import delay_point
from domain.errors import Fenced

log = structlog.get_logger("tapeline.operator")


@dataclass(frozen=True)
class ActionAdapters:
    """The adapters one operator action runs on, fresh for each action (`tapeline/wiring.py`
    `OperatorService` builds them): `events` and `jobs` are closed when the action ends; `storage`
    builds the bucket's adapter when the action needs it; `clock` stamps the events."""

    events: EventLog
    jobs: JobStore
    storage: Callable[[], ObjectStorage]
    clock: Clock


def default_operator() -> str:
    """`user@host` of whoever runs the command (recorded in `JobReplayed`)."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


def operator_transactional_id(settings: Settings, job_id: str) -> str:
    """The transactional id of every operator action on `job_id`: one per job, so that opening it
    fences any other action on the job still in flight (see the module docstring)."""
    return f"{settings.app_name}.operator.{job_id}"


def done_by(timeline: list[dict[str, Any]], event_types: tuple[str, ...]) -> str | None:
    """"by OPERATOR at YYYY-MM-DD HH:MM:SS UTC" of the latest applied event of `event_types` in a
    job's timeline (rows of the `job_timeline` operation, broker time), or None when there is none.
    Pure."""
    done = [row for row in timeline if row["event_type"] in event_types and row["applied"]]
    if not done:
        return None
    last = done[-1]
    operator = (last.get("payload") or {}).get("operator") or last["recorded_by"]
    return f"by {operator} at {last['broker_ts']:%Y-%m-%d %H:%M:%S} UTC"


def _dead_letter(jobs: JobStore, dead_letter_id: str) -> dict[str, Any] | None:
    """One dead letter (the `dead_letter_by_id` operation) with its attempt counts
    (`tapeline.rows.letter_attempts`), or None; what `tapeline.read.dead_letter` returns."""
    row = jobs.one("dead_letter_by_id", {"id": dead_letter_id})
    return letter_attempts(row) if row is not None else None


def winner(runtime: Runtime, job_id: str, event_types: tuple[str, ...], seen: int, timeout_s: float) -> str:
    """After this action was fenced by another one on the same job: "already done by ... at ..."
    once the other's event (one of `event_types`, beyond the `seen` already in the timeline) is
    projected, waiting at most `timeout_s` seconds; else a sentence saying another action is under
    way. Never raises for a slow projection."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            runtime.job_row(job_id)  # catch up first
            timeline = runtime.jobs.all("job_timeline", {"job_id": job_id})
            if sum(1 for row in timeline if row["event_type"] in event_types and row["applied"]) > seen:
                return f"already done {done_by(timeline, event_types)}"
        except Exception as exc:  # noqa: BLE001 - the answer is informative only
            log.warning("could not read the action that took over", job_id=job_id, error=str(exc))
        if time.monotonic() > deadline:
            return (f"another operator action on job {job_id} took over while this one ran; this one did "
                    f"nothing (see `tapeline timeline {job_id}`)")
        time.sleep(0.2)


def applied_count(runtime: Runtime, job_id: str, event_types: tuple[str, ...]) -> int:
    """How many applied events of `event_types` the job's projected timeline has."""
    return sum(1 for row in runtime.jobs.all("job_timeline", {"job_id": job_id}) if row["event_type"] in event_types and row["applied"])


def replay_events(row: dict[str, Any] | None, dead_letter_id: str, operator: str, reason: str,
                  settings: Settings, recorded_by: str, *, clock: Clock) -> list[Outgoing]:
    """The events that replay a dead-lettered (or needs-review) job, stamped by `clock`. Pure.

    `JobReplayed` (operator, reason, dead letter id; stage and attempt of the attempt that ended
    the job, so its dedup key is unique per dead letter) + `StageQueued` + `WorkItem` of the same
    stage's next attempt. The projection restarts the attempt budget at the replayed attempt
    (`fold.attempts_used`). Returns [] when the job is not in a reopenable state: replaying twice,
    or replaying a job that completed meanwhile, changes nothing.
    """
    if row is None or row["state"] not in REOPENABLE_STATES:
        return []
    common = dict(job_id=row["job_id"], recorded_by=recorded_by, correlation_id=row["upload_id"])
    replayed = ev.JobReplayed.new(clock.stamp(), stage=row["stage"], attempt=row["attempt"], operator=operator, reason=reason,
                                  dead_letter_id=dead_letter_id, **common)
    return [(settings.jobs_topic, replayed)] + queue_attempt(row, row["stage"], row["attempt"] + 1,
                                                             dict(common, causation_id=replayed.event_id), settings,
                                                             clock=clock)


@dataclass(frozen=True)
class ReplayOutcome:
    """What `replay_dead_letters` did with one dead letter: `replayed` (with the new attempt) or
    `skipped` with the reason."""

    dead_letter_id: str
    job_id: str | None
    replayed: bool
    detail: str
    next_attempt: int | None = None


def replay_dead_letters(settings: Settings, ids: list[str], operator: str, reason: str, *,
                        adapters: ActionAdapters) -> list[ReplayOutcome]:
    """Replay each dead letter in `ids` (see `replay_events`), one Kafka transaction per job, on `adapters`.

    Raises `NotReplayable` for an unknown id or a record dead letter (an undecodable record has no
    job to reopen: `tapeline dlq show` gives its bytes and source position), before anything is
    produced; `ServiceUnavailable` when the projection does not catch up.
    """
    runtime = Runtime(settings, "operator", events=adapters.events, jobs=adapters.jobs)
    outcomes: list[ReplayOutcome] = []
    try:
        letters = []
        for dead_letter_id in ids:
            letter = _dead_letter(runtime.jobs, dead_letter_id)
            if letter is None:
                raise NotReplayable(f"no dead letter {dead_letter_id!r} (see `tapeline dlq list`)")
            if letter["kind"] != "job":
                raise NotReplayable(
                    f"dead letter {dead_letter_id} is an undecodable record ({letter['error']}); it has no job to "
                    f"replay. Inspect it with `tapeline dlq show {dead_letter_id}` and fix its producer")
            letters.append(letter)
        for letter in letters:
            outcomes.append(_replay_one(settings, runtime, letter, operator, reason, adapters.clock))
    finally:
        runtime.close()
    return outcomes


def _replay_one(settings: Settings, runtime: Runtime, letter: dict[str, Any], operator: str,
                reason: str, clock: Clock) -> ReplayOutcome:
    """Replay one job dead letter, exactly once whoever else acts on the job (module docstring)."""
    job_id = letter["job_id"]
    producer = runtime.events.transactional_producer(operator_transactional_id(settings, job_id))  # first: fences
    fenced = False
    try:
        row = runtime.job_row(job_id)  # then the caught-up read: holds every action committed before
        letter = _dead_letter(runtime.jobs, letter["id"]) or letter
        seen = applied_count(runtime, job_id, ("JobReplayed",))
        delay_point("operator.after_read")
        if letter["replayed_at"] is not None:
            return ReplayOutcome(letter["id"], job_id, False, f"already replayed by {letter['replayed_by']} at "
                                                              f"{letter['replayed_at']:%Y-%m-%d %H:%M:%S} UTC")
        outgoing = replay_events(row, letter["id"], operator, reason, settings, runtime.recorded_by, clock=clock)
        if not outgoing:
            state = row["state"] if row else "unknown"
            return ReplayOutcome(letter["id"], job_id, False, f"job is {state}: nothing to replay")
        try:
            transact(producer, lambda: runtime.produce(producer, outgoing), name="operator.replay")
        except Fenced:
            fenced = True
            detail = winner(runtime, job_id, ("JobReplayed",), seen, settings.caught_up_timeout_s)
            log.info("dead letter replay lost to another action", dead_letter_id=letter["id"], job_id=job_id,
                     detail=detail)
            return ReplayOutcome(letter["id"], job_id, False, detail)
    finally:
        if not fenced:  # a fenced producer is in librdkafka's fatal state: flush would raise, and has nothing to send
            producer.flush(5)
    next_attempt = row["attempt"] + 1
    log.info("dead letter replayed", dead_letter_id=letter["id"], job_id=job_id, operator=operator,
             next_attempt=next_attempt)
    return ReplayOutcome(letter["id"], job_id, True, f"{row['stage']} attempt {next_attempt} queued", next_attempt)


def resolve_review_events(row: dict[str, Any] | None, operator: str, reason: str, posted_ref: str | None,
                          provider: str, settings: Settings, recorded_by: str, *, clock: Clock) -> list[Outgoing]:
    """The events that resolve a job in needs_review, stamped by `clock`. Pure.

    `posted_ref` given (the operator found the post at the provider): `JobReplayed` + `Published`
    (that provider, that ref, the origin's master URL) + `JobCompleted`: the job completes without
    another post. Otherwise (the operator checked that no post exists; the caller has released the
    claim marker): `JobReplayed` + the next publish attempt, which creates a fresh marker and posts.
    Returns [] when the job is not in needs_review.
    """
    if row is None or row["state"] != "needs_review":
        return []
    common = dict(job_id=row["job_id"], recorded_by=recorded_by, correlation_id=row["upload_id"])
    replayed = ev.JobReplayed.new(clock.stamp(), stage=row["stage"], attempt=row["attempt"], operator=operator, reason=reason,
                                  dead_letter_id=None, **common)
    out: list[Outgoing] = [(settings.jobs_topic, replayed)]
    caused = dict(common, causation_id=replayed.event_id)
    if posted_ref is None:
        return out + queue_attempt(row, row["stage"], row["attempt"] + 1, caused, settings, clock=clock)
    renditions = [ev.Rendition(**r) for r in (row.get("renditions") or [])]
    master_key = f"published/{row['job_id']}/master.m3u8"
    return out + [
        (settings.jobs_topic, ev.Published.new(clock.stamp(), stage="publish", attempt=row["attempt"], sequence=f"{provider}-review",
                                               provider=provider, provider_ref=posted_ref, master_key=master_key,
                                               master_url=row.get("master_url") or "", renditions=renditions,
                                               **caused)),
        (settings.jobs_topic, ev.JobCompleted.new(clock.stamp(), stage="publish", attempt=row["attempt"],
                                                  master_url=row.get("master_url") or "",
                                                  media_duration_s=row.get("source_duration_s"), **caused)),
    ]


def resolve_review(settings: Settings, job_id: str, operator: str, reason: str, posted_ref: str | None,
                   provider: str = "webhook", *, adapters: ActionAdapters) -> str:
    """Resolve one needs_review job (see `resolve_review_events`) on `adapters`; returns what was done.

    Without `posted_ref` the claim marker `markers/{job}/{provider}.json` is deleted first (the
    operator vouches that the provider has no post), so the next attempt may post. Raises
    `NotReplayable` when the job is not in needs_review.
    """
    from processors.publish import marker_key

    runtime = Runtime(settings, "operator", events=adapters.events, jobs=adapters.jobs)
    try:
        producer = runtime.events.transactional_producer(operator_transactional_id(settings, job_id))  # first: fences
        row = runtime.job_row(job_id)  # then the caught-up read (module docstring)
        seen = applied_count(runtime, job_id, ("JobReplayed",))
        delay_point("operator.after_read")
        if row is None or row["state"] != "needs_review":
            already = done_by(runtime.jobs.all("job_timeline", {"job_id": job_id}), ("JobReplayed",)) if row else None
            raise NotReplayable(f"job {job_id} is {row['state'] if row else 'unknown'}, not needs_review"
                                + (f" (resolved {already})" if already else ""))
        if posted_ref is None:
            adapters.storage().delete(marker_key(job_id, provider))
        outgoing = resolve_review_events(row, operator, reason, posted_ref, provider, settings, runtime.recorded_by,
                                         clock=adapters.clock)
        try:
            transact(producer, lambda: runtime.produce(producer, outgoing), name="operator.review")
        except Fenced:
            raise NotReplayable(f"job {job_id}: {winner(runtime, job_id, ('JobReplayed',), seen, settings.caught_up_timeout_s)}") from None
    finally:
        runtime.close()
    if posted_ref is None:
        return f"marker released; publish attempt {row['attempt'] + 1} queued"
    return f"recorded post {posted_ref} at {provider}; job completed"


def cancel_events(row: dict[str, Any] | None, operator: str, reason: str, settings: Settings,
                  recorded_by: str, *, clock: Clock) -> list[Outgoing]:
    """The events that cancel a job: one `JobCancelled` (operator, reason; stamped by `clock`) on its current stage and
    attempt, so its dedup key is `{job}:{stage}:{attempt}:JobCancelled`. Pure.

    Returns [] when the job has no row or has ended (completed, rejected, failed, cancelled,
    dead_lettered, needs_review): the projection would not apply it (a dead-lettered or needs-review
    job is reopened only by `JobReplayed`), so cancelling twice changes nothing. A running attempt
    learns of it at its next heartbeat (the job ended) and stops its ffmpeg.
    """
    if row is None or row["state"] in TERMINAL_STATES:
        return []
    return [(settings.jobs_topic, ev.JobCancelled.new(clock.stamp(), job_id=row["job_id"], stage=row["stage"], attempt=row["attempt"],
                                                      operator=operator, reason=reason, recorded_by=recorded_by,
                                                      correlation_id=row["upload_id"]))]


def cancel_job(settings: Settings, job_id: str, operator: str, reason: str, *, adapters: ActionAdapters) -> str:
    """Cancel one job (see `cancel_events`) in one Kafka transaction on `adapters`; returns what was done.

    Raises `NoSuchJob` for an unknown job, `NotCancellable` for one that has ended, and
    `ServiceUnavailable` when the projection does not catch up with the job's partition.
    """
    runtime = Runtime(settings, "operator", events=adapters.events, jobs=adapters.jobs)
    try:
        producer = runtime.events.transactional_producer(operator_transactional_id(settings, job_id))  # first: fences
        row = runtime.job_row(job_id)  # then the caught-up read (module docstring)
        if row is None:
            raise NoSuchJob(f"no job {job_id} in the projections (not submitted, or intake not caught up)")
        seen = applied_count(runtime, job_id, ("JobCancelled",))
        delay_point("operator.after_read")
        outgoing = cancel_events(row, operator, reason, settings, runtime.recorded_by, clock=adapters.clock)
        if not outgoing:
            already = done_by(runtime.jobs.all("job_timeline", {"job_id": job_id}), ("JobCancelled",)) if row["state"] == "cancelled" else None
            raise NotCancellable(f"job {job_id} was already cancelled {already}" if already else
                                 f"job {job_id} is {row['state']}: it has ended and cannot be cancelled")
        try:
            transact(producer, lambda: runtime.produce(producer, outgoing), name="operator.cancel")
        except Fenced:  # no flush: a fenced producer is in librdkafka's fatal state (flush raises, nothing to send)
            raise NotCancellable(f"job {job_id}: {winner(runtime, job_id, ('JobCancelled',), seen, settings.caught_up_timeout_s)}") from None
        producer.flush(5)
    finally:
        runtime.close()
    log.info("job cancelled", job_id=job_id, operator=operator, stage=row["stage"], attempt=row["attempt"])
    return f"cancelled ({row['stage']} attempt {row['attempt']}, was {row['state']})"


def fail_events(row: dict[str, Any] | None, dead_letter_id: str, operator: str, reason: str, refund: bool,
                settings: Settings, recorded_by: str, *, clock: Clock) -> list[Outgoing]:
    """The events that end a dead-lettered job as failed for good, stamped by `clock`. Pure.

    The fold reopens a dead-lettered job only by `JobReplayed`, so: `JobReplayed` (operator, "to fail
    it for good: reason", the dead letter, which leaves the pending list) + `JobFailed` (the dead
    letter's error class, "failed for good by OPERATOR: reason", `operator`, `dead_letter_id`,
    `refunded`; caused by that JobReplayed) in one transaction, both on the dead-lettered attempt: no
    attempt is queued. `refunded` takes the job out of its submitter's daily quota count (the
    `submitter_jobs_between` query), once, whatever is repeated: the job is counted or it is not.
    Returns [] when the job is not dead_lettered.
    """
    if row is None or row["state"] != "dead_lettered":
        return []
    common = dict(job_id=row["job_id"], stage=row["stage"], attempt=row["attempt"], recorded_by=recorded_by,
                  correlation_id=row["upload_id"])
    replayed = ev.JobReplayed.new(clock.stamp(), operator=operator, reason=f"to fail it for good: {reason}",
                                  dead_letter_id=dead_letter_id, **common)
    failed = ev.JobFailed.new(clock.stamp(), sequence="operator", error_class=row["error_class"] or "unknown",
                              reason=f"failed for good by {operator}: {reason}"
                                     + (" (quota refunded)" if refund else ""),
                              operator=operator, dead_letter_id=dead_letter_id, refunded=refund,
                              causation_id=replayed.event_id, **common)
    return [(settings.jobs_topic, replayed), (settings.jobs_topic, failed)]


@dataclass(frozen=True)
class FailOutcome:
    """What `fail_dead_letters` did with one dead letter: `failed` now (`refunded` or not) or not,
    with a sentence saying what or why not."""

    dead_letter_id: str
    job_id: str | None
    failed: bool
    refunded: bool
    detail: str


def already_failed(runtime: Runtime, job_id: str, state: str) -> str:
    """Why a job is not failed again: "already failed by OP at T (quota refunded)" or its state."""
    timeline = runtime.jobs.all("job_timeline", {"job_id": job_id})
    done = [r for r in timeline if r["event_type"] == "JobFailed" and r["applied"]]
    if state == "failed" and done:
        payload = done[-1].get("payload") or {}
        refunded = " (quota refunded)" if payload.get("refunded") else " (no refund)"
        return f"already failed {done_by(timeline, ('JobFailed',))}{refunded}: nothing changed"
    return f"job is {state}, not dead_lettered: nothing changed"


def fail_dead_letters(settings: Settings, ids: list[str], operator: str, reason: str, refund: bool, *,
                      adapters: ActionAdapters) -> list[FailOutcome]:
    """End each dead-lettered job in `ids` as failed for good (see `fail_events`), one Kafka
    transaction per job on `<app>.operator.<job_id>` (opened before the caught-up read: racing
    actions on a job take effect once). Idempotent: a job already failed is left alone and the
    outcome says by whom and whether its quota was refunded. Raises `NotReplayable` for an unknown
    id or a record dead letter, before anything is produced."""
    runtime = Runtime(settings, "operator", events=adapters.events, jobs=adapters.jobs)
    outcomes: list[FailOutcome] = []
    try:
        letters = []
        for dead_letter_id in ids:
            letter = _dead_letter(runtime.jobs, dead_letter_id)
            if letter is None:
                raise NotReplayable(f"no dead letter {dead_letter_id!r} (see `tapeline dlq list`)")
            if letter["kind"] != "job":
                raise NotReplayable(f"dead letter {dead_letter_id} is an undecodable record ({letter['error']}); "
                                    f"it has no job to fail")
            letters.append(letter)
        for letter in letters:
            outcomes.append(_fail_one(settings, runtime, letter, operator, reason, refund, adapters.clock))
    finally:
        runtime.close()
    return outcomes


def _fail_one(settings: Settings, runtime: Runtime, letter: dict[str, Any], operator: str, reason: str,
              refund: bool, clock: Clock) -> FailOutcome:
    job_id = letter["job_id"]
    producer = runtime.events.transactional_producer(operator_transactional_id(settings, job_id))  # first: fences
    fenced = False
    try:
        row = runtime.job_row(job_id)  # then the caught-up read (module docstring)
        seen = applied_count(runtime, job_id, ("JobFailed", "JobReplayed"))
        delay_point("operator.after_read")
        outgoing = fail_events(row, letter["id"], operator, reason, refund, settings, runtime.recorded_by, clock=clock)
        if not outgoing:
            return FailOutcome(letter["id"], job_id, False, False,
                               already_failed(runtime, job_id, row["state"] if row else "unknown"))
        try:
            transact(producer, lambda: runtime.produce(producer, outgoing), name="operator.fail")
        except Fenced:
            fenced = True
            detail = winner(runtime, job_id, ("JobFailed", "JobReplayed"), seen, settings.caught_up_timeout_s)
            return FailOutcome(letter["id"], job_id, False, False, detail)
    finally:
        if not fenced:
            producer.flush(5)
    log.info("dead-lettered job failed for good", dead_letter_id=letter["id"], job_id=job_id, operator=operator,
             refunded=refund)
    return FailOutcome(letter["id"], job_id, True, refund,
                       "failed for good" + ("; the submitter's quota is credited back" if refund else ""))

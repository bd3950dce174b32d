"""Operator actions: replay a dead-lettered job with a fresh attempt budget, fail one for good
(optionally crediting the submitter's quota back), dismiss the dead letter of an undecodable record,
resolve a job in needs_review, cancel a job.

Each action is a pure `*_events(row, ...)` core (`processors/operator_events.py`) and an impure
runner here that reads the job's row from a
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

from processors.operator_events import (cancel_events, dismiss_events, done_by, fail_events, replay_events,
                                        resolve_review_events)
from processors.runtime import Runtime, transact
from tapeline.partitioner import partition_for
from tapeline.rows import letter_attempts
from domain.errors import NoSuchDeadLetter, NoSuchJob, NotCancellable, NotReplayable, ServiceUnavailable, StorageError
from domain.policy.withdrawal import ending_answer
from processors.withdraw import withdraw, withdrawn_event
from tapeline.settings import Settings
from tapeline.ports import Clock, EventLog, JobStore, ObjectStorage, Writer
from tapeline.crashpoints import delay_point
from domain.errors import Fenced

log = structlog.get_logger("tapeline.operator")


@dataclass(frozen=True)
class ActionAdapters:
    """The adapters one operator action runs on, fresh for each action (`cli/wiring.py`
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


def _dead_letter(jobs: JobStore, dead_letter_id: str) -> dict[str, Any] | None:
    """One dead letter (the `dead_letter_by_id` operation) with its attempt counts
    (`tapeline.rows.letter_attempts`), or None; what `projections.read_model.dead_letter` returns."""
    row = jobs.one("dead_letter_by_id", {"id": dead_letter_id})
    return letter_attempts(row) if row is not None else None


def _each_letter(settings: Settings, adapters: ActionAdapters, ids: list[str],
                 refusal: Callable[[dict[str, Any]], str | None],
                 act: Callable[[Runtime, dict[str, Any]], Any]) -> list[Any]:
    """`act(runtime, letter)` for each dead letter of `ids`, in order, on one operator `Runtime` over
    `adapters` (closed at the end); every letter is read before the first act. Raises
    `NoSuchDeadLetter` for an unknown id and `NotReplayable` with `refusal(letter)`'s sentence for one
    the action does not apply to (`refusal` returns None for the others), before anything is written."""
    runtime = Runtime(settings, "operator", events=adapters.events, jobs=adapters.jobs)
    try:
        letters = []
        for dead_letter_id in ids:
            letter = _dead_letter(runtime.jobs, dead_letter_id)
            if letter is None:
                raise NoSuchDeadLetter(f"no dead letter {dead_letter_id!r} (see `tapeline dlq list`)")
            if (why := refusal(letter)) is not None:
                raise NotReplayable(why)
            letters.append(letter)
        return [act(runtime, letter) for letter in letters]
    finally:
        runtime.close()


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
    return _each_letter(settings, adapters, ids, lambda letter: None if letter["kind"] == "job" else (
        f"dead letter {letter['id']} is an undecodable record ({letter['error']}); it has no job to replay. "
        f"Inspect it with `tapeline dlq show {letter['id']}` and fix its producer, then dismiss it "
        f"(`tapeline dlq dismiss`)"),
        lambda runtime, letter: _replay_one(settings, runtime, letter, operator, reason, adapters.clock))


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
        log.info("job cancelled", job_id=job_id, operator=operator, stage=row["stage"], attempt=row["attempt"])
        return withdraw_after_ending(settings, runtime, producer, adapters, job_id, "operator cancel",
                                     f"cancelled ({row['stage']} attempt {row['attempt']}, was {row['state']})")
    finally:
        runtime.close()


def withdraw_after_ending(settings: Settings, runtime: Runtime, producer: Writer, adapters: ActionAdapters, job_id: str,
                          withdrawn_by: str, done: str) -> str:
    """After an operator action ended job `job_id` (its events committed on `producer`): once the
    ending is projected (a running publish sees it at its next check and stops), withdraw what a
    publish had made public (`processors/withdraw.py`, rule `domain/policy/withdrawal.py`) and record
    `OutputsWithdrawn` on `producer`. Returns the operator's answer: `done`, and when outputs had
    been public, since when and that they are withdrawn. Never raises for the withdrawal: the ending
    is committed either way, and a publish worker still running withdraws when it stops."""
    try:
        ended = runtime.job_row(job_id)
        plan = withdraw(adapters.storage(), job_id, ended["state"] if ended else None)
    except (ServiceUnavailable, StorageError) as exc:
        log.warning("published outputs not checked after the ending", job_id=job_id, error=str(exc))
        return (f"{done}; whether outputs were already public could not be checked now ({exc}): "
                f"see `tapeline timeline {job_id}`")
    if not plan:
        return done
    event = withdrawn_event(ended, plan, withdrawn_by, runtime.recorded_by, clock=adapters.clock)
    try:
        transact(producer, lambda: runtime.produce(producer, [(settings.jobs_topic, event)]), name="operator.withdraw")
    except Fenced:  # another action on the job opened its writer meanwhile: the bucket is clean, say so
        log.warning("outputs withdrawn but OutputsWithdrawn not recorded: another action took the job's writer",
                    job_id=job_id, keys=len(plan.keys))
        return ending_answer(done, plan) + " (not recorded: another operator action took over)"
    return ending_answer(done, plan)


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
    return _each_letter(settings, adapters, ids, lambda letter: None if letter["kind"] == "job" else (
        f"dead letter {letter['id']} is an undecodable record ({letter['error']}); it has no job to fail "
        f"(dismiss it: `tapeline dlq dismiss`)"),
        lambda runtime, letter: _fail_one(settings, runtime, letter, operator, reason, refund, adapters))


def _fail_one(settings: Settings, runtime: Runtime, letter: dict[str, Any], operator: str, reason: str,
              refund: bool, adapters: ActionAdapters) -> FailOutcome:
    clock = adapters.clock
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
    detail = withdraw_after_ending(settings, runtime, producer, adapters, job_id, "operator fail",
                                   "failed for good" + ("; the submitter's quota is credited back" if refund else ""))
    return FailOutcome(letter["id"], job_id, True, refund, detail)


@dataclass(frozen=True)
class DismissOutcome:
    """What `dismiss_dead_letters` did with one dead letter: `dismissed` now or not, with a sentence
    saying what or why not."""

    dead_letter_id: str
    dismissed: bool
    detail: str


def dismiss_dead_letters(settings: Settings, ids: list[str], operator: str, reason: str, *,
                         adapters: ActionAdapters) -> list[DismissOutcome]:
    """Dismiss each dead letter of an undecodable record in `ids` (`dismiss_events`): a
    `DeadLetterDismissed` on the dead-letter topic, one Kafka transaction per dead letter on
    `<app>.operator.<dead letter id>`, opened before the caught-up read of the dead letter (as for a
    job: two racing dismissals write one event). The raw record stays; the dead letter stops being
    pending. Idempotent: one already dismissed is left alone and the outcome says by whom.

    Raises `NoSuchDeadLetter` for an unknown id and `NotReplayable` for a job's dead letter (replay
    or fail it instead), before anything is produced; `ServiceUnavailable` when the projection does
    not catch up within `caught_up_timeout_s` seconds."""
    return _each_letter(settings, adapters, ids, lambda letter: None if letter["kind"] != "job" else (
        f"dead letter {letter['id']} is job {letter['job_id']}'s: replay it or fail it for good (`tapeline dlq "
        f"replay` / `tapeline dlq fail`); only an undecodable record's dead letter is dismissed"),
        lambda runtime, letter: _dismiss_one(settings, runtime, letter, operator, reason, adapters.clock))


def _dismiss_one(settings: Settings, runtime: Runtime, letter: dict[str, Any], operator: str, reason: str,
                 clock: Clock) -> DismissOutcome:
    dead_letter_id = letter["id"]
    producer = runtime.events.transactional_producer(operator_transactional_id(settings, dead_letter_id))  # fences
    fenced = False
    try:
        partition = partition_for(dead_letter_id, runtime.partitions(settings.dlq_topic))
        runtime.wait_caught_up(partition, settings.caught_up_timeout_s, topic=settings.dlq_topic)
        letter = _dead_letter(runtime.jobs, dead_letter_id) or letter
        delay_point("operator.after_read")
        outgoing = dismiss_events(letter, operator, reason, settings, runtime.recorded_by, clock=clock)
        if not outgoing:
            return DismissOutcome(dead_letter_id, False, f"already dismissed by {letter['dismissed_by']} at "
                                                         f"{letter['dismissed_at']:%Y-%m-%d %H:%M:%S} UTC")
        try:
            transact(producer, lambda: runtime.produce(producer, outgoing), name="operator.dismiss")
        except Fenced:
            fenced = True
            return DismissOutcome(dead_letter_id, False, "another operator dismissed it at the same moment; this "
                                                         "action wrote nothing (see `tapeline dlq show`)")
    finally:
        if not fenced:
            producer.flush(5)
    log.info("dead letter dismissed", dead_letter_id=dead_letter_id, operator=operator)
    return DismissOutcome(dead_letter_id, True, f"dismissed: {reason}")

"""The claim of a work item, top to bottom (docs/design.md "The lease protocol"; Steps 0, 5 and 6 run
in the worker loop, `processors/worker.py`):
  Step 0. choose: keep the head record of each work-topic partition (partition paused) and take the
          head of the tier `tiers.choose_tier` picks: the highest tier with work, unless a lower one
          has been passed over `tier_starvation_limit` times in a row (processors/tier_heads.py);
  Step 1. reconcile: wait until the projection has caught up with the job's partition of the
          lifecycle log, then skip an item whose job ended, whose stage passed, whose attempt is
          stale or already claimed (`should_skip`, pure: domain/policy/claim_rules.py);
  Step 2. fence: the attempt's transactional producer (`<app>.<stage>.<job_id>`) calls
          `init_transactions`, which aborts and fences any older producer of the same job;
  Step 3. check once more after fencing (a zombie may have committed just before);
  Step 4. claim: one transaction with `AttemptStarted` (fresh claim token, lease) and the work
          item's offset;
  Step 5. leave the consumer group while busy (no head-of-line blocking, no max.poll.interval),
          do the work outside any transaction, heartbeating in small transactions;
  Step 6. complete: one transaction with the outcome events (no offsets), then rejoin the group.

The pure rules are `domain/policy/claim_rules.py` (`should_skip`, `projection_behind`); this module does
the reads and the one transaction, with the helpers it needs beside it.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable

import structlog

from domain import events as ev
from domain.errors import DecodeError, Fenced, SchemaError
from domain.policy.claim_rules import projection_behind, should_skip
from processors.runtime import AttemptIdentity, Runtime, transact
from tapeline import logs
from tapeline.ports import Clock, EventLogError, Offset, Reader, Record, Writer
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.worker")


@dataclass(frozen=True)
class Claimed:
    """A claimed attempt: who it is, the fencing producer that holds it, its work item, and the
    job's projected row as of Step 3."""

    identity: AttemptIdentity
    producer: Writer
    item: ev.WorkItem
    row: dict[str, Any] | None


def claim(runtime: Runtime, consumer: Reader, message: Record, *, settings: Settings, stage: str, clock: Clock,
          lease_s: float, dead_letter: Callable[[Runtime, Reader, Record, Exception, list[Offset]], None]
          ) -> Claimed | None:
    """Steps 1-4 for one work-topic record of `stage`. Returns the claim, or None: the item was
    skipped (its offset committed past), undecodable (`dead_letter` sent it on with its offset), or
    the claim's transaction was aborted (the item is read again). Raises `ServiceUnavailable` or
    `EventLogError` when the projection or the log cannot answer before anything was claimed."""
    offsets = [message.next_offset()]
    try:
        item = ev.Event.from_record(runtime.codec.decode(message.value, **message.where))
        if not isinstance(item, ev.WorkItem) or item.stage != stage:
            raise SchemaError(f"{item.event_type} for stage {item.stage} on {message.topic}")
    except (DecodeError, SchemaError) as exc:
        dead_letter(runtime, consumer, message, exc, offsets)
        return None
    logs.bind(job_id=item.job_id, stage=stage, attempt=item.attempt)
    log.info("work item received", produced_ms_ago=int(time.time() * 1000 - message.timestamp_ms))
    steps = [time.monotonic()]  # when each claim step ended, for the "attempt claimed" log line
    # Step 1: reconcile against the caught-up projection
    reason = should_skip(row_covering(runtime, item, settings.caught_up_timeout_s), item)
    steps.append(time.monotonic())
    if reason is not None:
        log.info("work item skipped", reason=reason)
        commit_skipped(consumer, offsets)
        return None
    # Step 2: fence every older producer of this job's stage
    producer = runtime.events.transactional_producer(attempt_transactional_id(settings, stage, item.job_id))
    steps.append(time.monotonic())
    # Step 3: check once more after fencing
    row = runtime.job_row(item.job_id)
    reason = should_skip(row, item)
    if reason is not None:
        log.info("work item skipped after fencing", reason=reason)
        commit_skipped(consumer, offsets)
        return None
    identity = AttemptIdentity(job_id=item.job_id, stage=stage, attempt=item.attempt,
                               claim_token=new_claim_token(), recorded_by=runtime.recorded_by,
                               correlation_id=item.correlation_id, causation_id=item.event_id, clock=clock)
    started = identity.event(ev.AttemptStarted, lease_s=lease_s, worker=runtime.recorded_by,
                             work_topic=message.topic, work_partition=message.partition,
                             work_offset=message.offset)
    # Step 4: AttemptStarted and the work item's offset in one transaction
    try:
        transact(producer, lambda: runtime.produce(producer, [(settings.jobs_topic, started)]),
                 name=f"{stage}.claim", consumer=consumer, offsets=offsets)
    except (EventLogError, Fenced) as exc:
        # A rebalance between poll and claim (ILLEGAL_GENERATION, REBALANCE_IN_PROGRESS) or another
        # claimant: the transaction was aborted, nothing is visible, the offset is not committed,
        # so the item is delivered again (here or to its new owner) and reconciled again.
        log.info("claim aborted; the work item will be delivered again", error=str(exc))
        try:
            consumer.seek(message.topic, message.partition, message.offset)
        except EventLogError:
            pass  # no longer ours: its new owner starts from the committed offset
        return None
    steps.append(time.monotonic())
    reconcile_ms, fence_ms, commit_ms = (round(1000 * (b - a)) for a, b in zip(steps, steps[1:]))
    logs.bind(claim_token=identity.claim_token)
    log.info("attempt claimed", reconcile_ms=reconcile_ms, fence_ms=fence_ms, check_and_commit_ms=commit_ms)
    return Claimed(identity, producer, item, row)


def row_covering(runtime: Runtime, item: ev.WorkItem, timeout_s: float) -> dict[str, Any] | None:
    """Step 1's read: the job's row once the projection has applied the `StageQueued` committed with
    `item` (or as it is after `timeout_s` seconds).

    Every work item is committed in one transaction with its `StageQueued`, but the broker
    writes the commit markers of the two topics independently: a worker can read the item
    before the lifecycle log's last stable offset covers that event (seen: an idle worker
    skipped a brand-new job as "unknown"). So a row that is missing or older than the item
    means "not projected yet": read again until it catches up or the time is up.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        row = runtime.job_row(item.job_id)
        if not projection_behind(row, item) or time.monotonic() > deadline:
            return row
        time.sleep(0.05)


def attempt_transactional_id(settings: Settings, stage: str, job_id: str) -> str:
    """Step 2's id: the transactional id of every producer that writes for `job_id`'s `stage`
    attempts; the claimant of the next attempt (and the rescuer of a dead one) fences the previous
    one with it."""
    return f"{settings.app_name}.{stage}.{job_id}"


def new_claim_token() -> str:
    """A fresh unguessable claim token (128 random bits, URL-safe)."""
    return secrets.token_urlsafe(16)


def commit_skipped(consumer: Reader, offsets: list[Offset]) -> None:
    """Commit past a work item that was skipped (nothing produced, so no transaction is needed).

    A commit can fail while the group rebalances (ILLEGAL_GENERATION, REBALANCE_IN_PROGRESS); the
    item is then delivered again and skipped again, which is harmless, so the failure is logged,
    never fatal.
    """
    try:
        consumer.commit(offsets)
    except EventLogError as exc:
        log.info("commit of a skipped work item failed; it will be skipped again", error=str(exc))


def leave_group(consumer: Reader, timeout_s: float = 3.0) -> None:
    """Step 5's first move: unsubscribe and serve the consumer until its partitions are given up.

    With cooperative rebalancing the revocation (and so the leave) completes only while the
    application polls; a busy worker that stopped polling would hold its partitions until its
    session timed out, and every job queued there would wait (seen: 10 s, one session timeout).
    """
    consumer.unsubscribe()
    deadline = time.monotonic() + timeout_s
    while consumer.assignment() and time.monotonic() < deadline:
        consumer.poll(0.05)

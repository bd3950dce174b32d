"""The stage worker loop shared by the stages: choose a work item (Step 0), claim it (Steps 1-4,
`processors/claim.py`, which lists the whole protocol), work outside the consumer group with
heartbeats (Step 5), complete in one transaction and rejoin (Step 6).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import structlog

from processors import stage_outcome as outcome
from processors.attempt import Attempt
from processors import rescue
from processors.claim import claim, leave_group
from processors.runtime import Outgoing, Runtime, dead_letter_record, transact
from domain.policy.tiers import after_claim, choose_tier, tier_of
from processors.tier_heads import HeadBuffer
from domain.lifecycle import attempts_used
from domain import pipeline
from tapeline import logs
from domain.errors import Fenced, ServiceUnavailable, TapelineError
from tapeline.health import HealthState
from tapeline.settings import Settings
from tapeline.ports import (Clock, EventLog, EventLogError, WriterStuck, JobStore, ObjectStorage, Offset, Partition, PartitionEnd,
                            ReadError, Reader, Record)

log = structlog.get_logger("tapeline.worker")


def _log_assignment(what: str):
    """A rebalance callback that logs the partitions (cooperative-sticky: increments only)."""
    def callback(partitions: list[Partition]) -> None:
        if partitions:
            log.info(f"work partitions {what}", partitions=[f"{topic}[{partition}]" for topic, partition in partitions])
    return callback


class Yielded(Exception):
    """The worker is shutting down: the attempt stops at a clean point and hands over."""


class StageWorker:
    """Base of the transcode and publish workers. Subclasses set `stage` and implement `work`.

    `stop` is set by SIGTERM: the worker claims nothing more; `work` may raise `Yielded` to hand
    the attempt over (`AttemptYielded` + the next attempt queued at once, not counted as used).
    """

    stage = ""

    def __init__(self, settings: Settings, *, events: EventLog, jobs: JobStore, storage: ObjectStorage,
                 clock: Clock, health: HealthState | None = None) -> None:
        """The adapters (`cli/wiring.py` `build_processor`): `events`, the work topics and the
        lifecycle log (one transactional writer per claimed job, `<app>.<stage>.<job_id>`); `jobs`, the
        projection it reconciles against; `storage`, the bucket; `clock`, what its events are stamped
        with. `run` closes `events` and `jobs` when it ends."""
        self.settings = settings
        self.events, self.jobs, self.store, self.clock = events, jobs, storage, clock
        self.processed = 0
        self.current: Attempt | None = None
        self.dlq_producer = None  # created on the first undecodable work item
        self.stop = threading.Event()
        self.health = health or HealthState(self.stage, settings.instance_id)  # `tapeline run` serves it
        self.buffer: HeadBuffer | None = None  # the head work item of each partition (Step 0)
        self.passed_over: dict[str, int] = {}  # claims in a row another tier got while this one waited
        self.waiting_at_choice: set[str] = set()
        self.gather_ms = 0  # how long the last Step 0 polled for heads

    def work(self, attempt: Attempt, store: ObjectStorage) -> list[Outgoing]:
        """Do the stage's work for a claimed attempt; return the completion events."""
        raise NotImplementedError

    def run(self, stop: threading.Event) -> None:
        self.stop = stop
        settings = self.settings
        runtime = Runtime(settings, self.stage, health=self.health, stop=stop, events=self.events, jobs=self.jobs)
        store = self.store
        topics = settings.work_topics(self.stage)
        # fetch.wait.max.ms 100: a work item reaches an idle worker within 0.1 s (default 0.5 s).
        # enable.partition.eof: Step 0 learns which partitions have nothing waiting (processors/tier_heads.py).
        consumer = self.events.consumer(settings.stage_group(self.stage),
                                        **{"fetch.wait.max.ms": 100, "enable.partition.eof": True})
        self.buffer = HeadBuffer(consumer, settings.tier_gather_s)
        self.rescue_earlier_incarnations(runtime)
        self.subscribe(consumer, topics)
        self.health.mark_ready()
        try:
            while not stop.is_set():
                message = self.next_item(consumer)
                if message is None:
                    continue
                if self.stop.is_set():
                    break
                with logs.scope(**message.where):  # every line about this record says which
                    self.handle(runtime, store, consumer, message, topics)
        finally:
            consumer.close()
            runtime.close()

    def rescue_earlier_incarnations(self, runtime: Runtime) -> None:
        """`rescue.rescue_earlier_incarnations` for this stage (a worker restarted under its stable name)."""
        rescue.rescue_earlier_incarnations(self.settings, self.stage, runtime, self.clock)

    def subscribe(self, consumer: Reader, topics: list[str]) -> None:
        """Join the stage's group on every tier's work topic; revoked partitions lose their heads."""
        revoked = _log_assignment("revoked")

        def on_revoke(partitions: list[Partition]) -> None:
            revoked(partitions)
            if self.buffer is not None:
                self.buffer.forget(partitions)

        consumer.subscribe(topics, on_assign=_log_assignment("assigned"), on_revoke=on_revoke, on_lost=on_revoke)

    def next_item(self, consumer: Reader) -> Record | None:
        """Step 0: the work item to reconcile next, or None (nothing arrived within a poll).

        Gathers the head of every partition with work (`HeadBuffer.gather`), then takes the oldest
        head of the tier `choose_tier` picks.
        """
        buffer = self.buffer
        assert buffer is not None
        if not buffer.heads:
            message = self.poll_work(consumer, 0.5)
            if message is None:
                return None
            buffer.offer(message)
            if not buffer.heads:
                return None  # a partition-end event
        started = time.monotonic()
        buffer.gather(lambda timeout_s: self.poll_work(consumer, timeout_s))
        self.gather_ms = round(1000 * (time.monotonic() - started))
        self.waiting_at_choice = buffer.waiting()
        tier = choose_tier(self.waiting_at_choice, self.passed_over, self.settings.tier_starvation_limit)
        return buffer.take(tier) if tier is not None else None

    def poll_work(self, consumer: Reader, timeout_s: float) -> Record | PartitionEnd | None:
        """One work record or partition-end event, or None (nothing, or a consumer error, logged)."""
        message = consumer.poll(timeout_s)
        if message is None or isinstance(message, PartitionEnd):
            return message
        if isinstance(message, ReadError):
            log.warning("consumer error", error=message.reason)
            return None
        self.health.consumed_record(message)
        return message

    def handle(self, runtime: Runtime, store: ObjectStorage, consumer: Reader, message: Record,
               topics: list[str]) -> None:
        """Claim one work item and, when claimed, run the attempt outside the consumer group."""
        assert self.buffer is not None
        try:
            attempt = self.claim(runtime, consumer, message)
        except (ServiceUnavailable, EventLogError) as exc:
            # The projection or the log cannot answer (the projector is down; a partition has no
            # leader while a broker is replaced): nothing was claimed. Read the item again after a
            # pause rather than exit (no crash loop, no rejoin of the group).
            log.warning("cannot reconcile the work item now; reading it again", error=str(exc))
            try:
                consumer.seek(message.topic, message.partition, message.offset)
            except EventLogError:
                pass  # no longer ours: its new owner reads it from the committed offset
            self.buffer.release(message)
            self.stop.wait(1.0)
            return
        if attempt is None:
            self.buffer.release(message)  # skipped (committed past) or rewound: fetch its partition again
            return
        tier = tier_of(message.topic)
        log.info("tier claimed", tier=tier, waiting=sorted(self.waiting_at_choice), gather_ms=self.gather_ms,
                 passed_over={t: n for t, n in self.passed_over.items() if n})
        self.passed_over = after_claim(self.waiting_at_choice, self.passed_over, tier)
        self.buffer.clear()  # unclaimed heads are read again from the committed offsets after rejoining
        leave_group(consumer)  # Step 5: leave the group while busy
        rescue.record_holding(self.settings, attempt.identity)
        try:
            self.execute(attempt, store)
        finally:
            rescue.release_holding(self.settings)
            self.current = None
            self.health.clear_attempt()
            self.subscribe(consumer, topics)  # Step 6 done: free again

    def claim(self, runtime: Runtime, consumer: Reader, message: Record) -> Attempt | None:
        """Steps 1-4 for one work-topic record (`processors/claim.py` `claim`); returns the claimed
        attempt, now this worker's current one, or None (skipped, dead-lettered or to be read again)."""
        claimed = claim(runtime, consumer, message, settings=self.settings, stage=self.stage, clock=self.clock,
                        lease_s=self.lease_s, dead_letter=self.dead_letter)
        if claimed is None:
            return None
        self.current = Attempt(runtime, claimed.identity, claimed.producer, claimed.item,
                               uncounted=claimed.item.attempt - attempts_used(claimed.row, claimed.item.attempt))
        self.health.set_attempt(claimed.item.job_id, self.stage, claimed.item.attempt, claimed.identity.claim_token,
                                self.lease_s)
        return self.current

    def dead_letter(self, runtime: Runtime, consumer: Reader, message: Record, error: Exception,
                    offsets: list[Offset]) -> None:
        """Send an undecodable work-topic record, raw, to the dead-letter topic in one transaction
        with its offset, and move on (docs/design.md principle 6: no crash loop on one bad record).

        The producer's transactional id carries the process id: consume-produce transactions are
        fenced by the consumer group's generation (KIP-447), not by a stable id. On failure the
        record is read again from its committed offset and dead-lettered again.
        """
        record = dead_letter_record(message, error, self.stage, runtime.recorded_by, clock=self.clock)
        log.error("undecodable work item sent to the dead-letter topic", error=str(error))
        if self.dlq_producer is None:
            self.dlq_producer = runtime.events.transactional_producer(
                f"{self.settings.app_name}.{self.stage}.dlq.{self.settings.instance_id}.{os.getpid()}")
        try:
            transact(self.dlq_producer, lambda: runtime.produce(self.dlq_producer, [(self.settings.dlq_topic, record)]),
                     consumer=consumer, offsets=offsets, name=f"{self.stage}.dead_letter")
        except (EventLogError, Fenced) as exc:
            log.warning("dead-lettering aborted; the record will be read again", error=str(exc))
            if isinstance(exc, WriterStuck):
                self.dlq_producer = None  # abandoned: the next dead letter makes a new one
            try:
                consumer.seek(message.topic, message.partition, message.offset)
            except EventLogError:
                pass

    def execute(self, attempt: Attempt, store: ObjectStorage) -> None:
        """Step 5-6: run `work` and commit its outcome; a failure becomes classified events."""
        jobs = self.settings.jobs_topic
        try:
            outgoing = self.work(attempt, store)
        except Yielded as exc:
            outgoing = self.yield_events(attempt, str(exc) or "worker shutting down (SIGTERM)")
        except Fenced:
            log.warning("fenced: a newer attempt owns the job; stopping")
            self.fenced(attempt)
            return
        except TapelineError as exc:
            outgoing = self.failure_events(attempt, exc.error_class, str(exc),
                                           cooldown_s=getattr(exc, "retry_after_s", None),
                                           in_the_way=getattr(exc, "in_the_way", None))
        except Exception as exc:  # an unclassified bug still ends in a recorded, classified failure
            log.exception("attempt failed with an unexpected error")
            outgoing = self.failure_events(attempt, "unknown", f"{type(exc).__name__}: {exc}")
        try:
            attempt.record(outgoing)
        except Fenced:
            log.warning("fenced at completion; nothing committed")
            self.fenced(attempt)
            return
        self.processed += 1
        ended, error_class = outcome.attempt_outcome(outgoing)
        self.health.count_attempt(self.stage, ended, error_class, time.monotonic() - attempt.claimed_at)
        self.health.job_done()
        log.info("attempt finished", outcome=ended, error_class=error_class or None,
                 events=[e.event_type for t, e in outgoing if t == jobs])

    def fenced(self, attempt: Attempt) -> None:
        self.health.count_attempt(self.stage, "fenced", "", time.monotonic() - attempt.claimed_at)
        self.health.mark_fenced(f"fenced: a newer attempt owns job {attempt.identity.job_id}")

    @property
    def lease_s(self) -> float:
        """The lease of this stage's attempts: its declaration's (`domain/pipeline.py`), else the setting."""
        return pipeline.lease(self.stage, self.settings.lease_s)

    def hand_on(self, attempt: Attempt, **fields: Any) -> list[Outgoing]:
        """`stage_outcome.handoff_events` for `attempt`: what follows its success in the job's
        pipeline (skips of optional stages, the next stage queued), to return after its
        `AttemptSucceeded`. `fields`: `inputs`, `renditions`, `audio_playlist_key`, `media_duration_s`."""
        return outcome.handoff_events(self.settings, attempt.identity, attempt.item, **fields)

    def next_attempt_events(self, attempt: Attempt, next_attempt: int) -> list[Outgoing]:
        """`stage_outcome.next_attempt_events` for `attempt`."""
        return outcome.next_attempt_events(self.settings, attempt.identity, attempt.item, next_attempt)

    def yield_events(self, attempt: Attempt, reason: str) -> list[Outgoing]:
        """`stage_outcome.yield_events` for `attempt`: `AttemptYielded` + the next attempt queued at once."""
        return outcome.yield_events(self.settings, attempt.identity, attempt.item, reason)

    def failure_events(self, attempt: Attempt, error_class: str, reason: str,
                       cooldown_s: float | None = None, in_the_way: dict | None = None) -> list[Outgoing]:
        """`stage_outcome.failure_events` for `attempt`: `AttemptFailed` and what the retry decision
        makes of it (`cooldown_s`: a provider's own `Retry-After`, seconds; `in_the_way`: the object an
        `OutputConflict` met)."""
        return outcome.failure_events(self.settings, attempt.identity, attempt.item, attempt.uncounted, error_class,
                                      reason, cooldown_s, in_the_way)

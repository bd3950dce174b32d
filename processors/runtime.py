"""What every processor shares: producing events to the right partition, reconciling against a
caught-up projection, one Kafka transaction (`transact`), dead-letter records. The claim of a work
item is `processors/claim.py`.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import structlog

from tapeline.ports import (Clock, EventLog, EventLogError, JobStore, Offset, ReadError, Reader, Record,
                            TransactionMustAbort, Writer, WriterFenced, WriterStuck)
from domain import events as ev
from domain.codec import default_codec
from tapeline.partitioner import partition_for
from tapeline.crashpoints import crash_point
from domain.errors import Fenced
from tapeline.health import HealthState
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.processors")

Outgoing = tuple[str, ev.Event]
"""(topic, event): one record a decision wants produced."""


class Runtime:
    """What one processor process holds: settings, its event log (`EventLog`: writers, partition
    counts, last stable offsets) and its job store (`JobStore`: the projection's reads), and the
    offsets it wrote. The adapters are handed in (`cli/wiring.py` builds them: `build_processor`
    for the processors, `build_runtime` for tests and benches)."""

    def __init__(self, settings: Settings, role: str, health: HealthState | None = None,
                 stop: threading.Event | None = None, *, events: EventLog, jobs: JobStore) -> None:
        """`stop`: the processor's stop event; a wait for the projection gives up once it is set.
        `close` closes `events` and `jobs` too."""
        self.settings, self.role, self.stop = settings, role, stop
        self.health = health or HealthState(role, settings.instance_id)  # counts events produced
        self.recorded_by = f"{role}@{settings.instance_id}:{os.getpid()}"  # which process, for evidence
        self.codec = default_codec()
        # every read sees the latest projection (autocommit); offsets read as read_committed (the LSO)
        self.jobs: JobStore = jobs
        self.jobs.open()  # a processor that cannot reach PostgreSQL fails here, before it says it is ready
        self.events: EventLog = events
        # Highest offset this process wrote, per (topic, partition). commit_transaction returns before
        # the broker has written the commit markers, so the LSO may not cover our own last write yet:
        # "caught up" must also mean "past everything I wrote".
        self.written: dict[tuple[str, int], int] = {}

    def partitions(self, topic: str) -> int:
        """The number of partitions of `topic` (`EventLog.partition_count`)."""
        return self.events.partition_count(topic)

    def produce(self, producer: Writer, outgoing: Iterable[Outgoing]) -> None:
        """Produce each event keyed by job id to its partition (within the caller's transaction)."""
        for topic, event in outgoing:
            self.health.produced(event.event_type)
            producer.produce(topic, key=event.job_id.encode(), value=self.codec.encode(event.to_record()),
                             partition=partition_for(event.job_id, self.partitions(topic)),
                             on_delivery=self._delivered)

    def produce_to(self, producer: Writer, topic: str, partition: int, event: ev.Event) -> None:
        """Produce one event to an explicit partition (watchdog ticks go to every partition)."""
        self.health.produced(event.event_type)
        producer.produce(topic, key=event.job_id.encode(), value=self.codec.encode(event.to_record()),
                         partition=partition, on_delivery=self._delivered)

    def wait_caught_up(self, partition: int, timeout_s: float, topic: str | None = None) -> None:
        """Wait until the projection has applied `partition` of `topic` (default: the lifecycle log) up
        to its LSO and past this process's own writes there. Raises `ServiceUnavailable` after
        `timeout_s` seconds, or as soon as the processor's stop event is set."""
        topic = topic or self.settings.jobs_topic
        target = max(self.written.get((topic, partition), -1) + 1, self.events.last_stable_offset(topic, partition))
        self.jobs.wait_applied(topic, partition, target, timeout_s, stop=self.stop)

    def _delivered(self, topic: str, partition: int, offset: int) -> None:
        """A record this process wrote was stored at `topic[partition]` `offset`."""
        position = (topic, partition)
        self.written[position] = max(self.written.get(position, -1), offset)

    def job_row(self, job_id: str) -> dict[str, Any] | None:
        """The job's projected row, read only after the projector caught up with the job's partition
        of the lifecycle log (docs/design.md: reconcile against a caught-up view)."""
        jobs = self.settings.jobs_topic
        self.wait_caught_up(partition_for(job_id, self.partitions(jobs)), self.settings.caught_up_timeout_s)
        return self.jobs.one("job_status", {"job_id": job_id})

    def close(self) -> None:
        """Close the event log's and the job store's clients."""
        self.events.close()
        self.jobs.close()


@dataclass(frozen=True)
class AttemptIdentity:
    """Who owns an attempt: fills the envelope of every event the attempt writes, stamped by
    `clock` (the processor's, handed in: never read from the machine here)."""

    job_id: str
    stage: str
    attempt: int
    claim_token: str
    recorded_by: str
    correlation_id: str
    causation_id: str | None
    clock: Clock

    def event(self, cls: type[ev.Event], sequence: int | None = None, **fields: Any) -> ev.Event:
        """An event of this attempt of type `cls`, stamped (time, event id) by `clock`."""
        return cls.new(self.clock.stamp(), job_id=self.job_id, stage=self.stage, attempt=self.attempt, claim_token=self.claim_token,
                       recorded_by=self.recorded_by, correlation_id=self.correlation_id,
                       causation_id=self.causation_id, sequence=sequence, **fields)


def dead_letter_event(processor: str, recorded_by: str, error: Exception, *, topic: str, partition: int,
                      offset: int, key: bytes | None, value: bytes | None,
                      headers: list[tuple[str, bytes | None]] | None, error_class: str = "invalid_input",
                      clock: Clock) -> ev.DeadLetter:
    """A `DeadLetter` carrying a record raw (key, value, headers, source position) and the error. Pure.

    Its job id is the source position `topic/partition/offset` (the record's job is unknown), which
    is also the dead letter's id in the `dead_letters` projection.
    """
    position = f"{topic}/{partition}/{offset}"
    return ev.DeadLetter.new(clock.stamp(), 
        job_id=position, stage=processor, attempt=0, recorded_by=recorded_by, correlation_id=position,
        source_topic=topic, source_partition=partition, source_offset=offset, key=key, value=value,
        headers={str(k): bytes(v or b"") for k, v in (headers or [])},
        error_class=error_class, error=str(error) or type(error).__name__, processor=processor)


def dead_letter_record(message: Record, error: Exception, processor: str, recorded_by: str,
                       error_class: str = "invalid_input", *, clock: Clock) -> ev.DeadLetter:
    """`dead_letter_event` for a consumed record, stamped by `clock`."""
    return dead_letter_event(processor, recorded_by, error, topic=message.topic, partition=message.partition,
                             offset=message.offset, key=message.key, value=message.value,
                             headers=message.headers, error_class=error_class, clock=clock)


COMMIT_RETRY_S = 60.0
"""How long `transact` keeps repeating a commit that failed with a retriable error (librdkafka's
`_TIMED_OUT` while a partition or the transaction coordinator has no leader), seconds. Longer than
a leader election (about 12 s here, `broker.session.timeout.ms` + the election) and than the
processors' default `transaction.timeout.ms` (10 s), after which the coordinator aborts the
transaction itself; shorter than the default lease (120 s), so a writer that cannot commit gives
up, aborts and says so well before its attempt would be judged stalled."""


def transact(producer: Writer, produce: Callable[[], None], *, consumer: Reader | None = None,
             offsets: list[Offset] | None = None, timeout_s: float = 30.0, name: str = "transaction",
             commit_retry_s: float = COMMIT_RETRY_S) -> None:
    """Run one Kafka transaction; it is committed or, when this raises, aborted (or fenced).

    `name` prefixes the crash points `<name>.before_produce`, `.after_produce`, `.after_send_offsets`,
    `.after_commit` (tests only, see `tapeline.crashpoints`).

    Step 1. begin; Step 2. `produce()` the records; Step 3. when `offsets` are given, add them with
    the reader's group metadata (`Writer.send_offsets`); Step 4. commit. How errors are handled
    (docs/design.md "Kafka errors: retried, aborted, fenced"):

    - a retriable commit error is repeated for up to `commit_retry_s` seconds (librdkafka: "the
      application may call commit_transaction() again"), then raised as it is; a commit left
      running inside the client is finished by the writer before its next transaction or abort
      (`tapeline.kafka.KafkaWriter.unfinished`), so its outcome is unknown to the caller;
    - `WriterFenced` (a newer producer with this transactional id, or the producer's fatal error)
      is raised as `Fenced`: the caller must stop and never retry; nothing is aborted (a fenced
      producer can neither commit nor abort);
    - `WriterStuck` (a call that never returned) is raised as it is, nothing aborted: the caller
      abandons the writer and makes a new one;
    - anything else (`TransactionMustAbort`, a non-retriable or exhausted `EventLogError`, an
      exception of `produce()` or a crash point's) aborts the open transaction and is raised as it
      is, so the producer can begin the next transaction. A retriable abort failure is repeated for
      up to `commit_retry_s` seconds; an abort that fails for good is logged; the original error is
      raised.

    Raises:
        Fenced, EventLogError (`TransactionMustAbort`, `WriterStuck` included), or whatever `produce()` raised.
    """
    crash_point(f"{name}.before_produce")
    # Step 1
    try:
        producer.begin_transaction()
    except WriterFenced as exc:  # e.g. the producer's fatal error from an earlier transaction
        raise Fenced(f"producer fenced: {exc}") from exc
    try:
        # Step 2
        produce()
        producer.flush(timeout_s)  # the records reach the broker inside the open transaction
        crash_point(f"{name}.after_produce")
        # Step 3
        if offsets:
            assert consumer is not None
            # At most 10 s (+ the writer's grace before it is called stuck): the group coordinator
            # moves within an election; waiting longer only holds the records behind this one.
            producer.send_offsets(offsets, consumer.group_metadata(), min(timeout_s, 10.0))
            crash_point(f"{name}.after_send_offsets")
        # Step 4
        give_up_at = time.monotonic() + commit_retry_s
        while True:
            try:
                producer.commit_transaction(timeout_s)
                break
            except EventLogError as exc:
                if not exc.retriable or isinstance(exc, (TransactionMustAbort, WriterFenced)) \
                        or time.monotonic() >= give_up_at:
                    raise
                log.warning("transaction commit not confirmed; committing again", transaction=name, error=str(exc),
                            gives_up_in_s=round(give_up_at - time.monotonic(), 1))
    except WriterFenced as exc:
        raise Fenced(f"producer fenced: {exc}") from exc
    except WriterStuck:
        raise  # a call still runs on the writer: neither abort nor anything else; the caller replaces it
    except BaseException as exc:
        _abort(producer, timeout_s, commit_retry_s, name, exc)
        raise
    producer.poll(0)  # serve delivery reports (offsets written) now
    crash_point(f"{name}.after_commit")


def _abort(producer: Writer, timeout_s: float, retry_s: float, name: str, cause: BaseException) -> None:
    """Abort the open transaction after `cause`; a retriable failure of the abort is repeated for up
    to `retry_s` seconds (librdkafka: "the application may call abort_transaction() again"; a
    `begin_transaction` while an abort is unfinished fails with `_CONFLICT`). Other failures are
    logged, not raised: the caller raises `cause`."""
    give_up_at = time.monotonic() + retry_s
    while True:
        try:
            producer.abort_transaction(timeout_s)
            return
        except WriterFenced:
            return  # nothing left to abort: the next call on this producer says it is fenced
        except EventLogError as abort_error:
            if abort_error.retriable and time.monotonic() < give_up_at:
                log.warning("transaction abort not confirmed; aborting again", transaction=name,
                            error=str(abort_error))
                continue
            log.warning("transaction abort failed too", transaction=name, error=str(cause),
                        abort_error=str(abort_error))
            return


def poll_record(consumer: Reader, health=None, timeout_s: float = 0.5) -> Record | None:
    """One record from `consumer`, or None (nothing yet, end of a partition, or a logged error)."""
    message = consumer.poll(timeout_s)
    if message is None or not isinstance(message, Record):
        if isinstance(message, ReadError):
            log.warning("consumer error", error=message.reason)
        return None
    if health is not None:
        health.consumed_record(message)
    return message

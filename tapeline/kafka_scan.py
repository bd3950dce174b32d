"""Reading the committed log in bounded scans: the event-log adapter's read side for everything
that is not a processor's own loop (replay, export, projection lag, region measurement, the
standby's reset, the failover's checks, the region records, the media replicator).

Every scan reads `read_committed` from offsets fixed before it starts: a partition's stop is its
last stable offset (what a `read_committed` client can reach) as of the call, or the first offset
at a broker timestamp (`offsets_for_times`), so records written later are never read and a scan
of a busy log still ends. Client errors leave here as `ServiceUnavailable`. Nothing here produces
to Kafka; with `tapeline/kafka.py` (clients, the processors' reader and writer) and
`tapeline/kafka_topics.py` (the topic contract, admin calls) this is the only code that imports
the Kafka client (an import-linter contract).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Iterator

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, TopicPartition

from tapeline import kafka
from domain.errors import ServiceUnavailable
from tapeline.settings import Settings

Position = tuple[str, int]


def to_millis(moment: datetime) -> int:
    """Milliseconds since the epoch of an aware datetime (Kafka's timestamp unit)."""
    return int(moment.timestamp() * 1000)


@dataclass
class Bounds:
    """Start (first offset to read) and stop (first offset not to read) of each partition."""

    start: dict[Position, int] = field(default_factory=dict)
    stop: dict[Position, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Offsets to read (an upper bound on records: transaction markers take offsets too)."""
        return sum(max(0, self.stop[p] - self.start[p]) for p in self.stop)

    def ranges(self) -> dict[Position, tuple[int, int]]:
        """{position: (start, stop)} of every partition with something to read (what `scan` takes)."""
        return {p: (self.start[p], self.stop[p]) for p in self.stop if self.stop[p] > self.start[p]}


def reader(settings: Settings, purpose: str, queue_kbytes: int = 256 * 1024) -> Consumer:
    """A read_committed consumer that is only ever assigned partitions and never commits.

    `queue_kbytes`: most kilobytes of records librdkafka prefetches ahead of the caller (resident
    memory of the reading process; a reader slower than the broker keeps that queue full).
    """
    return kafka.consumer(settings, f"{settings.app_name}.{purpose}.{uuid.uuid4().hex[:8]}",
                          **{"enable.partition.eof": True,  # a partition with nothing left below its stop ends here
                             "fetch.max.bytes": min(64 * 1024**2, queue_kbytes * 1024),  # bulk reads: few round trips
                             "max.partition.fetch.bytes": min(8 * 1024**2, queue_kbytes * 1024),
                             "queued.max.messages.kbytes": queue_kbytes,
                             # librdkafka postpones a partition's next fetch this long once the queue is
                             # past queued.max.messages.kbytes. Its default, 1000 ms, starved the replay's
                             # workers, whose 8 MB queue fills in one fetch; librdkafka's CONFIGURATION.md
                             # advises lowering it when the queue thresholds are set low. With 10 ms the
                             # parent of a 924k-record replay waited 4.6 s on its workers, not 7.5-9.5 s.
                             "fetch.queue.backoff.ms": 10})


def offset_at(consumer: Consumer, topic: str, partition: int, moment: datetime | None, default: int,
              timeout_s: float = 10.0) -> int:
    """First offset whose broker timestamp is >= `moment` (`default` when there is none or no moment)."""
    if moment is None:
        return default
    found = consumer.offsets_for_times([TopicPartition(topic, partition, to_millis(moment))], timeout=timeout_s)
    offset = found[0].offset
    return default if offset < 0 else offset


def bounds(consumer: Consumer, topics: list[str], *, since: datetime | None = None, until: datetime | None = None,
           start_at: dict[Position, int] | None = None, partitions: dict[str, list[int]] | None = None,
           timeout_s: float = 10.0) -> Bounds:
    """Bounds of every partition of `topics`: from `start_at` (or `since`, or the log start) up to
    `until` (exclusive; a broker timestamp) or else the last stable offset as of this call.
    Raises `ServiceUnavailable` when the broker does not answer an offset lookup within `timeout_s`
    seconds, or a topic is missing."""
    try:
        return _bounds(consumer, topics, since, until, start_at, partitions, timeout_s)
    except KafkaException as exc:
        raise ServiceUnavailable(f"cannot read the offsets of {', '.join(topics)}: {exc}") from exc


def _bounds(consumer: Consumer, topics: list[str], since: datetime | None, until: datetime | None,
            start_at: dict[Position, int] | None, partitions: dict[str, list[int]] | None,
            timeout_s: float) -> Bounds:
    result = Bounds()
    for topic in topics:
        chosen = (partitions or {}).get(topic) or range(kafka.partition_count(consumer, topic, timeout_s=timeout_s))
        for partition in chosen:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout_s, cached=False)
            if start_at and (topic, partition) in start_at:
                start = start_at[(topic, partition)]
            else:
                start = offset_at(consumer, topic, partition, since, high, timeout_s) if since else low
            start = max(low, start)
            stop = min(high, offset_at(consumer, topic, partition, until, high, timeout_s))
            result.start[(topic, partition)] = start
            result.stop[(topic, partition)] = max(start, stop)
    return result


@dataclass
class Slice:
    """One batch: records below their partition's stop, in consumption order, and the positions
    (offset after the last one read) reached at partitions that are now finished."""

    records: list[Message]
    ends: dict[Position, int]


def read(consumer: Consumer, span: Bounds, batch_size: int = 5000, stall_timeout_s: float = 120.0,
         on_progress: Callable[[int], None] | None = None) -> Iterator[Slice]:
    """Yield batches of every committed record within `span`. `on_progress(offsets_done)` after each.

    Raises `ServiceUnavailable` when nothing arrives for `stall_timeout_s` while records remain
    (an open transaction holds the last stable offset, or the broker is gone).
    """
    pending = {p for p in span.stop if span.stop[p] > span.start[p]}
    reached = dict(span.start)
    if not pending:
        return
    consumer.assign([TopicPartition(t, p, span.start[(t, p)]) for t, p in sorted(pending)])
    last_progress = time.monotonic()
    while pending:
        messages = consumer.consume(batch_size, timeout=0.5)
        records, ends = [], {}
        for message in messages:
            position = (message.topic(), message.partition())
            if position not in pending:
                continue
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    if message.offset() < span.stop[position]:
                        # The fetch reached the broker's last stable offset as that fetch saw it,
                        # below the stop fixed earlier: records below the stop are still to come
                        # (a transaction's markers were not yet written when that fetch was served).
                        # Keep reading; ending here lost the tail of a partition (bench/replay.py
                        # "decoded 4,797 records of the 4,801 written").
                        continue
                    ends[position] = span.stop[position]
                    reached[position] = span.stop[position]
                    pending.discard(position)
                    consumer.pause([TopicPartition(*position)])
                    continue
                raise ServiceUnavailable(f"reading {position[0]}[{position[1]}]: {error}")
            if message.offset() >= span.stop[position]:
                ends[position] = span.stop[position]  # everything below the stop was read
                reached[position] = span.stop[position]
                pending.discard(position)
                consumer.pause([TopicPartition(*position)])
                continue
            records.append(message)
            reached[position] = message.offset() + 1
        for position in list(pending):
            if reached[position] >= span.stop[position]:
                ends[position] = span.stop[position]
                pending.discard(position)
                consumer.pause([TopicPartition(*position)])
        if records or ends:
            last_progress = time.monotonic()
            yield Slice(records, ends)
            if on_progress is not None:
                on_progress(sum(reached[p] - span.start[p] for p in span.stop))
        elif time.monotonic() - last_progress > stall_timeout_s:
            raise ServiceUnavailable(f"no records for {stall_timeout_s:.0f} s while {len(pending)} partition(s) "
                                     "still had records below their stop offset (an open transaction?)")


# -- scans with a budget (lag, region measurement, audits) --------------------------------------


def committed_reader(settings: Settings, purpose: str, **overrides: Any) -> Consumer:
    """A read_committed consumer from the one client factory (`kafka.consumer`) that is only ever
    assigned partitions, never joins its group and never commits; a partition reports its end
    (`enable.partition.eof`). `overrides`: more librdkafka settings."""
    return kafka.consumer(settings, f"{settings.app_name}.{purpose}.{uuid.uuid4().hex[:8]}",
                          **{"enable.partition.eof": True, **overrides})


def existing_topics(consumer: Consumer, timeout_s: float = 10.0) -> dict[str, int]:
    """Partition count of every topic the cluster has (topics with a metadata error left out).
    Raises `ServiceUnavailable` when the cluster does not answer within `timeout_s` seconds."""
    try:
        topics = consumer.list_topics(timeout=timeout_s).topics
    except KafkaException as exc:
        raise ServiceUnavailable(f"the cluster did not list its topics: {exc}") from exc
    return {name: len(meta.partitions) for name, meta in topics.items() if meta.error is None}


def partitions(consumer: Consumer, topic: str, timeout_s: float = 10.0) -> int:
    """`kafka.partition_count`, with a cluster that does not answer raised as `ServiceUnavailable`
    too (as is a missing topic)."""
    try:
        return kafka.partition_count(consumer, topic, timeout_s=timeout_s)
    except KafkaException as exc:
        raise ServiceUnavailable(f"no metadata for {topic}: {exc}") from exc


def offsets(consumer: Consumer, topic: str, partition: int, timeout_s: float = 10.0) -> tuple[int, int]:
    """(log start, last stable offset) of one partition, asked of the broker (never cached).
    Raises `ServiceUnavailable` when it does not answer within `timeout_s` seconds."""
    try:
        return consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout_s, cached=False)
    except KafkaException as exc:
        raise ServiceUnavailable(f"no offsets for {topic}[{partition}]: {exc}") from exc


def within_budget(ranges: dict[Position, tuple[int, int]], limit: int) -> set[Position]:
    """The partitions of `ranges` ({position: (start, stop)}) read whole within `limit` offsets in
    all, smallest first (pure)."""
    whole, budget = set(), limit
    for key, (start, stop) in sorted(ranges.items(), key=lambda item: item[1][1] - item[1][0]):
        if stop - start <= budget:
            whole.add(key)
            budget -= stop - start
    return whole


def scan(consumer: Consumer, ranges: dict[Position, tuple[int, int]], take: Callable[[Message], bool],
         timeout_s: float) -> set[Position]:
    """Read each partition of `ranges` ({position: (start, stop)}) from its start: `take(record)` gets
    every committed record below the stop, in offset order per partition, and returns whether to go
    on with that partition. Returns the partitions finished (stop reached, the partition's end
    reported, or `take` said stop) within `timeout_s` seconds; the others were cut short (no error).
    Raises `ServiceUnavailable` on a read error other than a partition's end."""
    todo = {key: span for key, span in ranges.items() if span[1] > span[0]}
    done = set(ranges) - set(todo)
    if not todo:
        return done
    consumer.assign([TopicPartition(topic, partition, start) for (topic, partition), (start, _) in todo.items()])
    open_ = set(todo)
    deadline = time.monotonic() + timeout_s
    try:
        while open_ and time.monotonic() < deadline:
            for message in consumer.consume(1000, timeout=0.2):
                key = (message.topic(), message.partition())
                if key not in open_:
                    continue
                error = message.error()
                if error is not None:
                    if error.code() != KafkaError._PARTITION_EOF:
                        raise ServiceUnavailable(f"reading {key[0]}[{key[1]}]: {error}")
                    open_.discard(key)  # at the last stable offset: nothing more committed
                    continue
                if message.offset() >= todo[key][1]:  # committed after the stop was read: not taken
                    open_.discard(key)
                    continue
                if not take(message) or message.offset() + 1 >= todo[key][1]:
                    open_.discard(key)
                    consumer.pause([TopicPartition(*key)])
    finally:
        consumer.unassign()
    return done | (set(todo) - open_)


def assign_from(consumer: Consumer, positions: dict[Position, int | None]) -> int:
    """Assign every partition of `positions` at its offset (None: the log's start); returns how many
    resume at a recorded offset."""
    consumer.assign([TopicPartition(topic, partition, OFFSET_BEGINNING if offset is None else offset)
                     for (topic, partition), offset in positions.items()])
    return sum(1 for offset in positions.values() if offset is not None)


def broker_millis(message: Message) -> int:
    """A record's broker timestamp, milliseconds since the epoch."""
    return message.timestamp()[1]

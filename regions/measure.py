"""Region B's lag measured: the reads in both regions' Kafka behind `tapeline region status`.

The arithmetic and what each figure means are in `regions/mirror_lag.py` (pure); this module only
reads: A's mirrored partitions `read_committed` from their log start to their last stable offset
(counting records and keeping two timestamps), B's partitions' watermarks.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone

from confluent_kafka import Consumer, KafkaError, TopicPartition

from tapeline import kafka
from regions.mirror_lag import PartitionCount, RegionLag, partition_lag
from tapeline.settings import Settings


def _reader(settings: Settings) -> Consumer:
    """An assign-only read_committed consumer (it never joins its group, never commits)."""
    return kafka.consumer(settings, f"{settings.app_name}.region-lag.{uuid.uuid4().hex[:8]}",
                          **{"enable.partition.eof": True, "max.partition.fetch.bytes": 1024 * 1024})


def measure_region_lag(source: Settings, target: Settings, topics: list[str], *, scan_limit: int = 200_000,
                       timeout_s: float = 30.0, now: datetime | None = None) -> RegionLag:
    """Region B's (`target`) lag behind region A (`source`) on `topics` (both regions use the names).

    Reads at most `scan_limit` offsets of A in all (smallest partitions first) within `timeout_s`
    seconds; a partition not read to its LSO reports `exact` False (`region_lag.partition_lag`).
    B's watermarks are read before A's LSOs, so a record committed and mirrored between the two
    reads can only make B look further behind, never nearer, and never counts as a copy held twice.
    A missing topic in B counts as an empty one.

    Raises confluent_kafka.KafkaException when either cluster does not answer (kafka.ServiceUnavailable
    when a topic is missing in A).
    """
    a, b = _reader(source), _reader(target)
    try:
        partitions = [(topic, partition) for topic in topics for partition in range(kafka.partition_count(a, topic))]
        in_b = _records_in_b(b, partitions, timeout_s)  # B first: see the docstring
        ranges = {(topic, partition): a.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout_s,
                                                              cached=False)
                  for topic, partition in partitions}
        counted = _count_a(a, ranges, in_b, scan_limit, timeout_s)
        counts = []
        for (topic, partition), (low, high) in sorted(ranges.items()):
            committed, newest, mirrored, whole = counted.get((topic, partition), (0, None, None, False))
            counts.append(PartitionCount(topic, partition, committed, high - low, in_b[(topic, partition)],
                                         newest, mirrored, whole))
    finally:
        a.close()
        b.close()
    return RegionLag(now or datetime.now(timezone.utc), [partition_lag(c) for c in counts])


def _records_in_b(b: Consumer, partitions: list[tuple[str, int]], timeout_s: float) -> dict[tuple[str, int], int]:
    """Records in each of B's partitions (end - start); 0 for a topic or partition B does not have."""
    present = {name: len(meta.partitions) for name, meta in b.list_topics(timeout=timeout_s).topics.items()
               if meta.error is None}
    records = {}
    for topic, partition in partitions:
        if partition < present.get(topic, 0):
            low, high = b.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout_s, cached=False)
            records[(topic, partition)] = high - low
        else:
            records[(topic, partition)] = 0
    return records


def _count_a(a: Consumer, ranges: dict[tuple[str, int], tuple[int, int]], in_b: dict, scan_limit: int,
             timeout_s: float) -> dict[tuple[str, int], tuple[int, int | None, int | None, bool]]:
    """Read A's partitions [log start, LSO) read_committed: per partition (committed records, newest
    record's timestamp ms, timestamp ms of the `in_b`-th record (the first record's when B holds
    none), read to the end). Partitions that do not fit in `scan_limit` offsets are not read."""
    result: dict[tuple[str, int], tuple[int, int | None, int | None, bool]] = {}
    budget, todo = scan_limit, {}
    for key, (low, high) in sorted(ranges.items(), key=lambda item: item[1][1] - item[1][0]):
        if high <= low:
            result[key] = (0, None, None, True)
        elif high - low <= budget:
            budget -= high - low
            todo[key] = (low, high)
    if not todo:
        return result
    state = {key: [0, None, None] for key in todo}  # count, newest ms, mirrored ms
    a.assign([TopicPartition(topic, partition, low) for (topic, partition), (low, _) in todo.items()])
    open_ = set(todo)
    deadline = time.monotonic() + timeout_s
    try:
        while open_ and time.monotonic() < deadline:
            for message in a.consume(1000, timeout=0.2):
                key = (message.topic(), message.partition())
                if key not in open_:
                    continue
                if message.error() is not None:
                    if message.error().code() == KafkaError._PARTITION_EOF:  # at the LSO: nothing more committed
                        open_.discard(key)
                    continue
                if message.offset() >= todo[key][1]:  # committed after the LSO was read: not counted
                    open_.discard(key)
                    continue
                entry = state[key]
                entry[0] += 1
                stamp = message.timestamp()[1]
                entry[1] = stamp
                if entry[0] == max(1, in_b[key]):
                    entry[2] = stamp
                if message.offset() + 1 >= todo[key][1]:
                    open_.discard(key)
    finally:
        a.unassign()
    for key, (count, newest, mirrored) in state.items():
        result[key] = (count, newest, mirrored, key not in open_)
    return result

"""Region B's lag measured: the reads in both regions' Kafka behind `tapeline region status`.

The arithmetic and what each figure means are in `regions/mirror_lag.py` (pure); this module only
reads: A's mirrored partitions `read_committed` from their log start to their last stable offset
(counting records and keeping two timestamps), B's partitions' watermarks.
"""

from __future__ import annotations

from typing import Any
from datetime import datetime, timezone

from tapeline import kafka_scan
from regions.mirror_lag import PartitionCount, RegionLag, partition_lag
from tapeline.settings import Settings


def _reader(settings: Settings) -> Any:
    """An assign-only read_committed consumer (it never joins its group, never commits)."""
    return kafka_scan.committed_reader(settings, "region-lag", **{"max.partition.fetch.bytes": 1024 * 1024})


def measure_region_lag(source: Settings, target: Settings, topics: list[str], *, scan_limit: int = 200_000,
                       timeout_s: float = 30.0, now: datetime | None = None) -> RegionLag:
    """Region B's (`target`) lag behind region A (`source`) on `topics` (both regions use the names).

    Reads at most `scan_limit` offsets of A in all (smallest partitions first) within `timeout_s`
    seconds; a partition not read to its LSO reports `exact` False (`region_lag.partition_lag`).
    B's watermarks are read before A's LSOs, so a record committed and mirrored between the two
    reads can only make B look further behind, never nearer, and never counts as a copy held twice.
    A missing topic in B counts as an empty one.

    Raises `ServiceUnavailable` when either cluster does not answer or a topic is missing in A.
    """
    a, b = _reader(source), _reader(target)
    try:
        partitions = [(topic, partition) for topic in topics for partition in range(kafka_scan.partitions(a, topic))]
        in_b = _records_in_b(b, partitions, timeout_s)  # B first: see the docstring
        ranges = {(topic, partition): kafka_scan.offsets(a, topic, partition, timeout_s) for topic, partition in partitions}
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


def _records_in_b(b: Any, partitions: list[tuple[str, int]], timeout_s: float) -> dict[tuple[str, int], int]:
    """Records in each of B's partitions (end - start); 0 for a topic or partition B does not have."""
    present = kafka_scan.existing_topics(b, timeout_s)
    records = {}
    for topic, partition in partitions:
        if partition < present.get(topic, 0):
            low, high = kafka_scan.offsets(b, topic, partition, timeout_s)
            records[(topic, partition)] = high - low
        else:
            records[(topic, partition)] = 0
    return records


def _count_a(a: Any, ranges: dict[tuple[str, int], tuple[int, int]], in_b: dict, scan_limit: int,
             timeout_s: float) -> dict[tuple[str, int], tuple[int, int | None, int | None, bool]]:
    """Read A's partitions [log start, LSO) read_committed: per partition (committed records, newest
    record's timestamp ms, timestamp ms of the `in_b`-th record (the first record's when B holds
    none), read to the end). Partitions that do not fit in `scan_limit` offsets are not read."""
    result: dict[tuple[str, int], tuple[int, int | None, int | None, bool]] = {}
    todo = {key: span for key, span in ranges.items() if span[1] > span[0]}
    result.update({key: (0, None, None, True) for key in set(ranges) - set(todo)})
    todo = {key: todo[key] for key in kafka_scan.within_budget(todo, scan_limit)}
    if not todo:
        return result
    state = {key: [0, None, None] for key in todo}  # count, newest ms, mirrored ms

    def take(message: Any) -> bool:
        entry = state[(message.topic(), message.partition())]
        entry[0] += 1
        entry[1] = stamp = kafka_scan.broker_millis(message)
        if entry[0] == max(1, in_b[(message.topic(), message.partition())]):
            entry[2] = stamp
        return True

    finished = kafka_scan.scan(a, todo, take, timeout_s)
    for key, (count, newest, mirrored) in state.items():
        result[key] = (count, newest, mirrored, key in finished)
    return result

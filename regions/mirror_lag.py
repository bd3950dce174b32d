"""How far region B's copy of the log is behind region A: the arithmetic, pure (docs/regions.md "Lag").

Counting, not offsets. A partition's offsets in A and in B cannot be subtracted: in A every
transaction ends with a marker that takes an offset, and an aborted transaction's records take
offsets too, but the mirror reads `read_committed` and writes neither into B. After one committed
one-record transaction A's partition ends at offset 2 (record, marker) and B's at 1, with nothing
missing. So, per partition:

- `committed_a`: records a `read_committed` reader gets from A's log start up to its last stable
  offset (LSO): markers, aborted records and records of open transactions are not counted;
- `records_b`: records in B's partition (end offset - start offset: the mirror writes no
  transactions into B, so B's offsets are contiguous);
- `events_behind` = max(0, committed_a - records_b): committed events in A not yet in B;
  `surplus_in_b` = max(0, records_b - committed_a): copies written twice (the mirror delivers at
  least once: a restarted task re-sends what it had not recorded as sent; the projections drop the
  duplicates by their dedup keys);
- `seconds_behind`: on A's clock, the newest committed record in A's timestamp minus the timestamp
  (in A) of the newest record B holds, the `records_b`-th committed record of A; when B holds none
  of the partition, minus A's first record's. B's own timestamps are not compared with A's: B's
  LogAppendTime topics stamp a copy when it arrives, not when it was written.

The count is exact while neither side has deleted records by retention (the jobs, uploads and
dead-letter topics keep everything; a work topic's 7 days may make it approximate later). A
partition too long to count within the measurement's budget reports `exact` False and the offset
difference from A's log start as an upper bound of the events behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

@dataclass(frozen=True)
class PartitionCount:
    """What was read of one mirrored partition in both regions.

    `committed_a`: committed records in A (log start to LSO); `span_a`: A's LSO minus its log start
    (offsets, markers and aborted records included); `records_b`: records in B; `newest_a_ms`: A's
    timestamp of its newest committed record (ms since the epoch, None when it has none);
    `mirrored_a_ms`: A's timestamp of the newest record B holds (of A's `records_b`-th committed
    record; A's first record's when B holds none; None when unknown); `counted`: A was read to its
    LSO within the budget (False: `committed_a` is incomplete and not used).
    """

    topic: str
    partition: int
    committed_a: int
    span_a: int
    records_b: int
    newest_a_ms: int | None
    mirrored_a_ms: int | None
    counted: bool = True


@dataclass(frozen=True)
class PartitionLag:
    """Region B's lag on one partition (module docstring)."""

    topic: str
    partition: int
    events_behind: int
    surplus_in_b: int
    seconds_behind: float | None  # None: not counted, unknown
    exact: bool


def partition_lag(count: PartitionCount) -> PartitionLag:
    """The lag of one partition from what was read of it (module docstring). Pure."""
    if not count.counted:
        return PartitionLag(count.topic, count.partition, max(0, count.span_a - count.records_b), 0, None, False)
    behind = max(0, count.committed_a - count.records_b)
    seconds = 0.0
    if behind and count.newest_a_ms is not None and count.mirrored_a_ms is not None:
        seconds = max(0.0, (count.newest_a_ms - count.mirrored_a_ms) / 1000.0)
    return PartitionLag(count.topic, count.partition, behind, max(0, count.records_b - count.committed_a),
                        seconds, True)


@dataclass(frozen=True)
class RegionLag:
    """Every mirrored partition's lag at `measured_at`, with the totals `region status` prints."""

    measured_at: datetime
    partitions: list[PartitionLag] = field(default_factory=list)

    @property
    def events_behind(self) -> int:
        """Committed events in A not yet in B, summed over partitions."""
        return sum(p.events_behind for p in self.partitions)

    @property
    def surplus_in_b(self) -> int:
        return sum(p.surplus_in_b for p in self.partitions)

    @property
    def seconds_behind(self) -> float | None:
        """The largest partition's `seconds_behind`; None when a partition behind could not be counted."""
        if any(p.seconds_behind is None and p.events_behind for p in self.partitions):
            return None
        return max((p.seconds_behind or 0.0 for p in self.partitions), default=0.0)

    @property
    def exact(self) -> bool:
        return all(p.exact for p in self.partitions)

    def by_topic(self) -> dict[str, dict[str, Any]]:
        """Per topic: `events_behind`, `surplus_in_b`, `seconds_behind` (max; None if unknown), `exact`."""
        topics: dict[str, list[PartitionLag]] = {}
        for p in self.partitions:
            topics.setdefault(p.topic, []).append(p)
        return {topic: RegionLag(self.measured_at, parts).as_totals() for topic, parts in sorted(topics.items())}

    def as_totals(self) -> dict[str, Any]:
        seconds = self.seconds_behind
        return {"events_behind": self.events_behind, "surplus_in_b": self.surplus_in_b,
                "seconds_behind": None if seconds is None else round(seconds, 3), "exact": self.exact}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (`tapeline region status --json`): totals and each topic's (the media objects are
        measured apart: `regions/object_audit.py`)."""
        return {**self.as_totals(), "measured_at": self.measured_at.isoformat(), "topics": self.by_topic()}

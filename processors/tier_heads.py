"""The I/O side of priority tiers (the rule is `domain/policy/tiers.py`): how a worker sees what waits (`HeadBuffer`): one consumer subscribed to every tier's
topic. Each record it polls is kept as the *head* of its partition and that partition is paused
(librdkafka drops what it prefetched there and, on resume, fetches again from the position after
the head). After the first record arrives the worker keeps polling until every assigned partition
has either a head or reported its end (`enable.partition.eof`), or nothing arrived for
`tier_gather_s`, so the heads of every tier that has work are in hand; then it chooses. Heads that were not chosen are never committed: a claim leaves the group (worker.py step 5)
and everything not claimed is read again from the committed offsets; a skipped head is committed
past and its partition resumed. Counting lag from watermarks does not work here: every work item is
its own transaction, so a commit marker follows it and `high watermark - position` is never 0.
"""

from __future__ import annotations

import time

import structlog

from domain.policy.tiers import tier_of
from tapeline.ports import EventLogError, Partition, PartitionEnd, Reader, Record


log = structlog.get_logger("tapeline.tiers")


class HeadBuffer:
    """The head work item of each assigned work-topic partition, each such partition paused.

    Not thread-safe: used by the worker's loop thread, including its rebalance callbacks (which run
    inside `poll`).
    """

    def __init__(self, consumer: Reader, gather_s: float) -> None:
        self.consumer, self.gather_s = consumer, gather_s
        self.heads: dict[Partition, Record] = {}
        self.paused: set[Partition] = set()  # heads, and taken heads not yet released
        self.at_end: set[Partition] = set()  # partitions that reported their end and have no head

    def _resume(self, keys) -> None:
        """Resume partitions this buffer paused. librdkafka keeps a partition's pause across
        unassign and a later assign (checked), so every paused partition is resumed before it
        leaves us; otherwise it would never be fetched again after a rejoin."""
        keys = [k for k in keys if k in self.paused]
        if not keys:
            return
        self.paused.difference_update(keys)
        try:
            self.consumer.resume(keys)
        except EventLogError as exc:
            log.info("could not resume work partitions", error=str(exc))

    def forget(self, partitions: list[Partition]) -> None:
        """Rebalance callback (revoked or lost partitions): drop their heads and resume them, their
        new owner reads from the committed offset."""
        keys = list(partitions)
        for key in keys:
            self.heads.pop(key, None)
            self.at_end.discard(key)
        self._resume(keys)

    def clear(self) -> None:
        """Before leaving the group: no head stays ours; every paused partition is resumed."""
        self.heads.clear()
        self.at_end.clear()
        self._resume(list(self.paused))

    def offer(self, message: Record | PartitionEnd) -> None:
        """A polled record (`add`), or a partition-end event (the partition has nothing waiting)."""
        if isinstance(message, Record):
            self.add(message)
        elif isinstance(message, PartitionEnd):
            key = (message.topic, message.partition)
            if key not in self.heads:
                self.at_end.add(key)

    def add(self, message: Record) -> None:
        """Keep `message` as its partition's head and pause the partition. A second record of a
        partition that already has a head (librdkafka delivered it before the pause took effect) is
        not kept: the partition is rewound to it, so it is read again after the head is done."""
        key = (message.topic, message.partition)
        self.at_end.discard(key)
        try:
            if key in self.heads:
                self.consumer.seek(message.topic, message.partition, message.offset)
            else:
                self.heads[key] = message
            self.consumer.pause([key])
            self.paused.add(key)
        except EventLogError as exc:  # revoked meanwhile: not ours
            log.info("could not pause a work partition; it is no longer ours", error=str(exc))
            self.heads.pop(key, None)

    def gather(self, poll) -> None:
        """Poll (`poll(timeout_s) -> Record | PartitionEnd | None`) and `offer`
        what arrives, until every assigned partition has a head or reported its end, or nothing
        arrived for `gather_s` seconds."""
        deadline = time.monotonic() + self.gather_s
        while time.monotonic() < deadline:
            try:
                assigned = set(self.consumer.assignment())
            except EventLogError:
                assigned = set()
            if assigned and assigned <= set(self.heads) | self.at_end:
                return
            message = poll(max(0.0, deadline - time.monotonic()))
            if message is not None:
                self.offer(message)
                deadline = time.monotonic() + self.gather_s

    def waiting(self) -> set[str]:
        """Tiers with at least one head."""
        return {tier_of(topic) for topic, _ in self.heads}

    def take(self, tier: str) -> Record:
        """Remove and return the oldest head (broker timestamp) of `tier`; its partition stays
        paused until `release`."""
        key = min((k for k in self.heads if tier_of(k[0]) == tier), key=lambda k: self.heads[k].timestamp_ms)
        return self.heads.pop(key)

    def release(self, message: Record) -> None:
        """`message` (taken) was not claimed and is done with (committed past, or rewound by the
        claim): resume its partition so its next record is fetched."""
        self.at_end.discard((message.topic, message.partition))
        self._resume([(message.topic, message.partition)])

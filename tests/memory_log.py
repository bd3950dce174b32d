"""An in-memory `EventLog` (tapeline/ports.py) for unit tests, with its `Writer`, `Reader` and
`AssignedReader`: the same answers as the Kafka adapter (`tapeline/kafka.py` `KafkaEventLog`) for the
same calls, checked by the contract suite `tests/contracts/test_event_log.py`, which runs against both.

What it models, as Kafka does it:

- topics with a fixed number of partitions, made by the test (`create_topic`);
- offsets as Kafka gives them: a transaction's records take offsets when produced, and its commit or
  abort writes one control marker per partition it wrote to, which takes an offset too (so after one
  committed transaction of 3 records a partition's last stable offset is 4);
- read_committed readers: a record is readable once its transaction committed; aborted records and
  markers are skipped; nothing at or after the first offset of an open transaction is readable
  (`last_stable_offset`);
- transactional writers fenced by their id: a second `transactional_producer` with the same id
  aborts the first one's open transaction and fences it (its later calls raise `WriterFenced`);
  `send_offsets` commits a group's offsets with the transaction;
- one consumer group member per group (`subscribe` assigns every partition of the topics, and
  `on_assign` runs inside the next `poll`); a group starts at its committed offsets, else at the
  earliest record;
- partition ends (`PartitionEnd`) for an assigned reader, and for a group reader opened with
  `enable.partition.eof`: reported once each time the reader reaches the last stable offset.

What it does not model: rebalances between several members, retention, timeouts (`poll` never
waits: it answers at once), the client's own quirks (librdkafka's unfinished commit resumed by
`KafkaWriter.begin_transaction`, the stuck `send_offsets` of `WriterStuck`). Those are tested on
the adapter itself.

Error injection is explicit: `fail_next(call, *errors, landed=False)` on the log, a writer or a
reader makes its next calls of that method name raise `errors`, in order. An injected error means
the call did nothing (with `landed=True` it took effect and its answer was lost: a commit that
committed and raised). An injected `WriterFenced` (or `WriterBroken`) leaves the writer dead as the
client's fatal state does: every later call raises it again. An injected `TransactionMustAbort`
leaves the open transaction abortable only: every call but `abort_transaction` raises it until the
abort. The log, every writer and every reader keep the names of the calls made on them in `calls`,
and each call with its arguments in `called`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from domain.errors import ServiceUnavailable
from tapeline.ports import (EventLogError, Offset, Partition, PartitionEnd, ReadError, Record, TransactionMustAbort,
                            WriterFenced)
from tests.fakelog import FakeMessage

COMMIT, ABORT = "commit", "abort"


@dataclass
class _Transaction:
    """One transaction of a writer: `first` offset it took in each partition, the group offsets it
    carries (`send_offsets`), and its end (None: open; COMMIT or ABORT)."""

    transactional_id: str
    first: dict[Partition, int] = field(default_factory=dict)
    offsets: dict[str, dict[Partition, int]] = field(default_factory=dict)
    ended: str | None = None


@dataclass(frozen=True)
class _Entry:
    """One offset of a partition: a record of `transaction`, or its control marker (`record` None)."""

    record: Record | None
    transaction: _Transaction


@dataclass(frozen=True)
class GroupMetadata:
    """What `MemoryReader.group_metadata` returns and `MemoryWriter.send_offsets` needs: the group's id."""

    group_id: str


class _Faults:
    """`fail_next` and the `calls` record shared by the log, its writers and its readers."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        """The name of every call made, in order (those that raised too)."""
        self.called: list[tuple[Any, ...]] = []
        """(name, *arguments) of every call made, in order."""
        self._faults: dict[str, list[tuple[Exception, bool]]] = {}

    def fail_next(self, call: str, *errors: Exception, landed: bool = False) -> None:
        """Make the next `len(errors)` calls of method `call` raise `errors`, in order. With `landed`
        each call takes effect first, then raises (its answer was lost)."""
        if not callable(getattr(self, call, None)):
            raise AttributeError(f"{type(self).__name__} has no method {call!r} to fail")
        self._faults.setdefault(call, []).extend((error, landed) for error in errors)

    def _fault(self, call: str, *arguments: Any) -> tuple[Exception | None, bool]:
        """Record the call; (the injected error for it or None, whether it lands first)."""
        self.calls.append(call)
        self.called.append((call, *arguments))
        queued = self._faults.get(call)
        return queued.pop(0) if queued else (None, False)


class InMemoryEventLog(_Faults):
    """The `EventLog` port in memory. `topics`: {name: partitions} made now (more with
    `create_topic`); `clock_ms`: the broker's clock, milliseconds since the epoch (LogAppendTime of
    every record; default the machine's clock). Not thread-safe."""

    def __init__(self, topics: dict[str, int] | None = None, *, cluster: str = "memory-cluster",
                 clock_ms: Callable[[], int] | None = None) -> None:
        super().__init__()
        self.cluster = cluster
        self.clock_ms = clock_ms or (lambda: int(time.time() * 1000))
        self.partitions: dict[Partition, list[_Entry]] = {}
        self.counts: dict[str, int] = {}
        self.group_offsets: dict[str, dict[Partition, int]] = {}
        """{group: {(topic, partition): next offset}}: what each group committed."""
        self.members: dict[str, "MemoryReader"] = {}
        self.writers: dict[str, "MemoryWriter"] = {}
        """The current (unfenced) writer of each transactional id."""
        for name, count in (topics or {}).items():
            self.create_topic(name, count)

    # -- for tests ---------------------------------------------------------------------------------

    def create_topic(self, name: str, partitions: int) -> None:
        """Make topic `name` with `partitions` partitions. Raises `ValueError` when it exists."""
        if name in self.counts:
            raise ValueError(f"topic {name} exists")
        self.counts[name] = partitions
        for partition in range(partitions):
            self.partitions[(name, partition)] = []

    def records(self, topic: str, partition: int | None = None) -> list[Record]:
        """The records a read_committed reader of `topic` (one partition, or all in partition order)
        can read now."""
        chosen = [partition] if partition is not None else range(self.counts[topic])
        found = []
        for number in chosen:
            end = self._lso(topic, number)
            found += [entry.record for entry in self._log(topic, number)[:end]
                      if entry.record is not None and entry.transaction.ended == COMMIT]
        return found

    # -- internals ---------------------------------------------------------------------------------

    def _log(self, topic: str, partition: int) -> list[_Entry]:
        try:
            return self.partitions[(topic, partition)]
        except KeyError:
            raise EventLogError(f"Broker: Unknown topic or partition ({topic}[{partition}])") from None

    def _readable(self, topic: str, partition: int, position: int) -> tuple[Record | None, int]:
        """(the next committed record at or after `position`, the position after it), or (None, the
        position where reading stopped: the last stable offset)."""
        entries, end = self._log(topic, partition), self._lso(topic, partition)
        while position < end:
            entry = entries[position]
            position += 1
            if entry.record is not None and entry.transaction.ended == COMMIT:
                return entry.record, position
        return None, position

    def _end(self, transaction: _Transaction, how: str) -> None:
        """End `transaction` (COMMIT or ABORT): a marker in each partition it wrote to; a commit
        commits its group offsets."""
        transaction.ended = how
        for position in transaction.first:
            self.partitions[position].append(_Entry(None, transaction))
        if how == COMMIT:
            for group, offsets in transaction.offsets.items():
                self.group_offsets.setdefault(group, {}).update(offsets)

    # -- the port ----------------------------------------------------------------------------------

    def transactional_producer(self, transactional_id: str) -> "MemoryWriter":
        """A writer for `transactional_id`; an older one with that id is fenced and its open
        transaction aborted."""
        error, _ = self._fault("transactional_producer", transactional_id)
        if error is not None:
            raise error
        older = self.writers.get(transactional_id)
        if older is not None and older.transaction is not None:
            self._end(older.transaction, ABORT)
            older.transaction = None
        self.writers[transactional_id] = writer = MemoryWriter(self, transactional_id)
        return writer

    def consumer(self, group_id: str, **overrides: Any) -> "MemoryReader":
        """A reader in group `group_id` (`overrides["enable.partition.eof"]`: report partition ends)."""
        error, _ = self._fault("consumer", group_id)
        if error is not None:
            raise error
        return MemoryReader(self, group_id, overrides)

    def partition_count(self, topic: str) -> int:
        """Raises `ServiceUnavailable` for a topic not made (the adapter says so after 10 s)."""
        error, _ = self._fault("partition_count", topic)
        if error is not None:
            raise error
        if topic not in self.counts:
            raise ServiceUnavailable(f"topic {topic} does not exist (run `tapeline stack up`)")
        return self.counts[topic]

    def last_stable_offset(self, topic: str, partition: int) -> int:
        """The first offset of the oldest open transaction in `topic[partition]`, else its end."""
        error, _ = self._fault("last_stable_offset", topic, partition)
        if error is not None:
            raise error
        return self._lso(topic, partition)

    def _lso(self, topic: str, partition: int) -> int:
        entries = self._log(topic, partition)
        for offset, entry in enumerate(entries):
            if entry.transaction.ended is None:
                return offset
        return len(entries)

    def assigned_reader(self, group_id: str, **overrides: Any) -> "MemoryAssignedReader":
        error, _ = self._fault("assigned_reader", group_id)
        if error is not None:
            raise error
        return MemoryAssignedReader(self, group_id, {"enable.partition.eof": True, **overrides})

    def cluster_id(self) -> str:
        error, _ = self._fault("cluster_id")
        if error is not None:
            raise error
        return self.cluster

    def close(self) -> None:
        self._fault("close")


class MemoryWriter(_Faults):
    """The `Writer` port of `InMemoryEventLog`: a transactional writer of `transactional_id`."""

    def __init__(self, log: InMemoryEventLog, transactional_id: str) -> None:
        super().__init__()
        self.log, self.transactional_id = log, transactional_id
        self.transaction: _Transaction | None = None
        self.dead: WriterFenced | None = None
        self.must_abort: TransactionMustAbort | None = None
        self.deliveries: list[tuple[Callable[[str, int, int], None], str, int, int]] = []

    def _enter(self, call: str, *arguments: Any, aborting: bool = False) -> tuple[Exception | None, bool]:
        """Record `call` and raise what stops it before it runs: the writer's death (a fence, an
        injected fatal error), an injected error that does not land, an abortable transaction."""
        error, landed = self._fault(call, *arguments)
        if self.dead is None and self.log.writers.get(self.transactional_id) is not self:
            self.dead = WriterFenced("Broker: Producer attempted an operation with an old epoch: this instance "
                                     "has been fenced by a newer instance")
        if self.dead is not None:
            raise self.dead
        if error is not None and not landed:
            self._remember(error)
            raise error
        if self.must_abort is not None and not aborting:
            raise self.must_abort
        return error, landed

    def _landed(self, error: Exception | None) -> None:
        """Raise the injected error of a call that took effect (`landed`), remembered as `_remember` says."""
        if error is not None:
            self._remember(error)
            raise error

    def _remember(self, error: Exception) -> None:
        """A fatal error kills the writer; an abortable one leaves its open transaction abort-only."""
        if isinstance(error, WriterFenced):
            self.dead = error
        elif isinstance(error, TransactionMustAbort) and self.transaction is not None:
            self.must_abort = error

    def _open(self, call: str) -> _Transaction:
        if self.transaction is None:
            raise EventLogError(f"{call}: Operation not valid in state Ready")
        return self.transaction

    def _deliver(self) -> None:
        due, self.deliveries = self.deliveries, []
        for callback, topic, partition, offset in due:
            callback(topic, partition, offset)

    def begin_transaction(self) -> None:
        error, _ = self._enter("begin_transaction")
        if self.transaction is not None:
            raise EventLogError("Operation not valid in state InTransaction")
        self.transaction = _Transaction(self.transactional_id)
        self._landed(error)

    def produce(self, topic: str, key: bytes, value: bytes, partition: int,
                on_delivery: Callable[[str, int, int], None] | None = None) -> None:
        """Append the record to `topic[partition]` in the open transaction (unreadable until commit);
        `on_delivery` runs in the next `flush`, `poll` or commit. Raises `EventLogError` outside a
        transaction or for a partition that does not exist."""
        error, _ = self._enter("produce", topic, key, value, partition)
        transaction = self._open("produce")
        entries = self.log._log(topic, partition)
        offset = len(entries)
        headers = None
        entries.append(_Entry(Record(topic, partition, offset, key, value, headers, self.log.clock_ms()), transaction))
        transaction.first.setdefault((topic, partition), offset)
        if on_delivery is not None:
            self.deliveries.append((on_delivery, topic, partition, offset))
        self._landed(error)

    def flush(self, timeout_s: float) -> int:
        error, _ = self._enter("flush", timeout_s)
        self._deliver()
        self._landed(error)
        return 0

    def send_offsets(self, offsets: list[Offset], group_metadata: Any, timeout_s: float) -> None:
        """Add `offsets` of the group of `group_metadata` (a `GroupMetadata`) to the open transaction."""
        error, _ = self._enter("send_offsets", offsets, group_metadata, timeout_s)
        transaction = self._open("send_offsets")
        if not isinstance(group_metadata, GroupMetadata):
            raise EventLogError(f"send_offsets: {group_metadata!r} is no group metadata of this log")
        group = transaction.offsets.setdefault(group_metadata.group_id, {})
        group.update({(o.topic, o.partition): o.offset for o in map(lambda o: Offset(*o), offsets)})
        self._landed(error)

    def commit_transaction(self, timeout_s: float) -> None:
        error, _ = self._enter("commit_transaction", timeout_s)
        transaction = self._open("commit_transaction")
        self._deliver()
        self.log._end(transaction, COMMIT)
        self.transaction = None
        self._landed(error)

    def abort_transaction(self, timeout_s: float) -> None:
        error, _ = self._enter("abort_transaction", timeout_s, aborting=True)
        transaction = self._open("abort_transaction")
        self.deliveries = []
        self.log._end(transaction, ABORT)
        self.transaction, self.must_abort = None, None
        self._landed(error)

    def poll(self, timeout_s: float) -> None:
        error, _ = self._enter("poll", timeout_s, aborting=True)
        self._deliver()
        self._landed(error)


class _Reading(_Faults):
    """Positions and partition ends over `InMemoryEventLog`, shared by both readers."""

    def __init__(self, log: InMemoryEventLog, group_id: str, overrides: dict[str, Any]) -> None:
        super().__init__()
        self.log, self.group_id, self.overrides = log, group_id, overrides
        self.positions: dict[Partition, int] = {}
        self.paused: set[Partition] = set()
        self.ends_told: dict[Partition, int] = {}
        self.closed = False

    def _check(self, call: str, *arguments: Any) -> None:
        """Raise the fault injected for `call`, or the client's error once closed."""
        error, _ = self._fault(call, *arguments)
        if self.closed:
            raise RuntimeError("Consumer closed")
        if error is not None:
            raise error

    def _eof(self) -> bool:
        return str(self.overrides.get("enable.partition.eof", False)).lower() in ("true", "1")

    def _next(self) -> tuple[Partition, Record] | PartitionEnd | None:
        """The next record of the assigned, unpaused partitions (in partition order), or the first
        partition end not yet told, or None."""
        for key in sorted(self.positions):
            if key in self.paused:
                continue
            record, after = self.log._readable(*key, self.positions[key])
            self.positions[key] = after
            if record is not None:
                return key, record
            if self._eof() and self.ends_told.get(key) != after:
                self.ends_told[key] = after
                return PartitionEnd(key[0], key[1], after)
        return None


class MemoryReader(_Reading):
    """The `Reader` port of `InMemoryEventLog`: the only member of group `group_id`."""

    def __init__(self, log: InMemoryEventLog, group_id: str, overrides: dict[str, Any]) -> None:
        super().__init__(log, group_id, overrides)
        self.callbacks: dict[str, Callable[[list[Partition]], None] | None] = {}
        self.topics: list[str] = []
        self.rebalance: str | None = None
        """"assign" or "revoke": what the next `poll` does first."""

    def subscribe(self, topics: list[str], on_assign=None, on_revoke=None, on_lost=None) -> None:
        """Join the group on `topics` (the partitions come in the next `poll`). Raises
        `NotImplementedError` when the group has another live member (the fake has one)."""
        self._check("subscribe", topics)
        member = self.log.members.get(self.group_id)
        if member is not None and member is not self and not member.closed:
            raise NotImplementedError(f"group {self.group_id} has a member already: the in-memory log models one "
                                      "member per group")
        self.log.members[self.group_id] = self
        self.topics = list(topics)
        self.callbacks = {"on_assign": on_assign, "on_revoke": on_revoke, "on_lost": on_lost}
        self.rebalance = "assign"

    def unsubscribe(self) -> None:
        """Leave the group: the next `poll` revokes the partitions (`on_revoke`)."""
        self._check("unsubscribe")
        self.rebalance = "revoke"

    def _leave(self) -> None:
        revoked = sorted(self.positions)
        self.positions, self.paused, self.ends_told = {}, set(), {}
        if self.log.members.get(self.group_id) is self:
            del self.log.members[self.group_id]
        if revoked and self.callbacks.get("on_revoke"):
            self.callbacks["on_revoke"](revoked)

    def poll(self, timeout_s: float) -> Record | PartitionEnd | ReadError | None:
        """A rebalance due first (its callback runs here), then the next record or partition end;
        None at once when there is nothing."""
        self._check("poll", timeout_s)
        if self.rebalance == "revoke":
            self.rebalance = None
            self._leave()
        elif self.rebalance == "assign":
            self.rebalance = None
            assigned = [(topic, p) for topic in self.topics for p in range(self.log.counts.get(topic, 0))]
            committed = self.log.group_offsets.get(self.group_id, {})
            self.positions = {key: committed.get(key, 0) for key in assigned}
            if self.callbacks.get("on_assign"):
                self.callbacks["on_assign"](assigned)
        found = self._next()
        return found[1] if isinstance(found, tuple) else found

    def seek(self, topic: str, partition: int, offset: int) -> None:
        """Raises `EventLogError` for a partition not assigned."""
        self._check("seek", topic, partition, offset)
        if (topic, partition) not in self.positions:
            raise EventLogError(f"Failed to seek to offset {offset}: Local: Erroneous state")
        self.positions[(topic, partition)] = offset
        self.ends_told.pop((topic, partition), None)

    def pause(self, partitions: list[Partition]) -> None:
        self._check("pause", partitions)
        self.paused |= set(partitions) & set(self.positions)  # an unassigned one: no error, nothing kept

    def resume(self, partitions: list[Partition]) -> None:
        self._check("resume", partitions)
        self.paused -= set(partitions)

    def assignment(self) -> list[Partition]:
        self._check("assignment")
        return sorted(self.positions)

    def commit(self, offsets: list[Offset]) -> None:
        self._check("commit", offsets)
        self.log.group_offsets.setdefault(self.group_id, {}).update(
            {(o.topic, o.partition): o.offset for o in map(lambda o: Offset(*o), offsets)})

    def group_metadata(self) -> GroupMetadata:
        self._check("group_metadata")
        return GroupMetadata(self.group_id)

    def close(self) -> None:
        """Leave the group (`on_revoke` runs now) and refuse every later call."""
        if not self.closed:
            self._fault("close")
            self._leave()
            self.closed = True


class MemoryAssignedReader(_Reading):
    """The `AssignedReader` port of `InMemoryEventLog`: records come out as `tests.fakelog.FakeMessage`
    (a `LogRecord`, as the client's `Message` is), partition ends as `PartitionEnd`."""

    def assign(self, positions: list[tuple[str, int, int | None]]) -> None:
        self._check("assign", positions)
        for topic, partition, _ in positions:
            self.log._log(topic, partition)
        self.positions = {(topic, partition): offset or 0 for topic, partition, offset in positions}
        self.paused, self.ends_told = set(), {}

    def _item(self) -> FakeMessage | PartitionEnd | None:
        found = self._next()
        if not isinstance(found, tuple):
            return found
        _, record = found
        return FakeMessage(record.topic, record.partition, record.offset, record.timestamp_ms, record.value,
                           record.key, record.headers)

    def poll(self, timeout_s: float) -> FakeMessage | PartitionEnd | ReadError | None:
        self._check("poll", timeout_s)
        return self._item()

    def consume(self, max_records: int, timeout_s: float) -> list[FakeMessage | PartitionEnd | ReadError]:
        self._check("consume", max_records, timeout_s)
        taken = []
        while len(taken) < max_records:
            item = self._item()
            if item is None:
                break
            taken.append(item)
        return taken

    def records_behind(self) -> int:
        """Each assigned partition's end (markers and unreadable records count) minus the position."""
        self._check("records_behind")
        return sum(max(0, len(self.log._log(*key)) - position) for key, position in self.positions.items())

    def close(self) -> None:
        if not self.closed:
            self._fault("close")
            self.closed = True

"""The `EventLog` port's contract (tapeline/ports.py), with its `Writer`, `Reader` and
`AssignedReader`, run against the in-memory fake (`tests/memory_log.py`, what unit tests use) and the
real Kafka adapter (`tapeline/kafka.py` `KafkaEventLog` on the shared broker, topics of each test's
own, deleted afterwards; consumer groups under an app name of this module's own, deleted at its
end): both give the same answers to the same calls, so a unit test on the fake tells the truth
about Kafka. The fake answers at once; Kafka is polled for up to `Side.patience_s`."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest
from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME

from tapeline.kafka import KafkaEventLog, admin_client
from tapeline.kafka_topics import delete_app_groups, delete_named_topics
from tapeline.ports import (AssignedReader, EventLog, EventLogError, Offset, PartitionEnd, Reader, Record,
                            TransactionMustAbort, Writer, WriterFenced)
from tapeline.settings import Settings
from tests.memory_log import InMemoryEventLog


@dataclass
class Side:
    """One implementation under the contract: its `log`, how to make a topic, and how long to wait
    for an answer that comes asynchronously (0 for the fake: it answers at once)."""

    log: EventLog
    make: Callable[[str, int], None]
    patience_s: float
    prefix: str
    made: list[str] = field(default_factory=list)

    def topic(self, partitions: int = 1) -> str:
        """A new topic of `partitions` partitions, its name unique to this test."""
        name = f"{self.prefix}.{uuid.uuid4().hex[:8]}"
        self.make(name, partitions)
        self.made.append(name)
        return name

    def group(self) -> str:
        return f"{self.prefix}.group-{uuid.uuid4().hex[:8]}"

    def writer(self) -> Writer:
        return self.log.transactional_producer(f"{self.prefix}.writer-{uuid.uuid4().hex[:8]}")

    def items(self, reader: Reader | AssignedReader, count: int) -> list[Any]:
        """Polled items (records and partition ends) until `count` arrived or `patience_s` passed."""
        found: list[Any] = []
        deadline = time.monotonic() + self.patience_s
        while len(found) < count:
            item = reader.poll(0.2 if self.patience_s else 0)
            if item is not None:
                found.append(item)
            elif time.monotonic() > deadline:
                break
        return found

    def records(self, reader: Reader, count: int) -> list[Record]:
        """`count` records from a group reader (fails the test when fewer arrive)."""
        found = [item for item in self.items(reader, count) if isinstance(item, Record)]
        assert len(found) == count, f"{len(found)} of {count} records arrived"
        return found

    def quiet(self, reader: Reader) -> list[Any]:
        """What a reader returns while nothing should arrive (Kafka: for 1.5 s)."""
        found, deadline = [], time.monotonic() + min(self.patience_s, 1.5)
        while True:
            item = reader.poll(0.2 if self.patience_s else 0)
            if item is not None:
                found.append(item)
            if time.monotonic() > deadline:
                return found

    def lso(self, topic: str, partition: int, expected: int) -> int:
        """The last stable offset once it is `expected` (Kafka writes the commit markers after the
        commit returns), or the last one seen after `patience_s`."""
        deadline = time.monotonic() + self.patience_s
        while True:
            found = self.log.last_stable_offset(topic, partition)
            if found == expected or time.monotonic() > deadline:
                return found
            time.sleep(0.05)


@pytest.fixture(scope="module")
def kafka_settings(base_settings: Settings) -> Iterator[Settings]:
    """This module's own app name (the consumer groups it makes), deleted at its end."""
    settings = base_settings.model_copy(update={"app_name": f"tapeline-contract-{uuid.uuid4().hex[:8]}"})
    yield settings
    delete_app_groups(settings)


def make_kafka_topic(settings: Settings) -> Callable[[str, int], None]:
    """A topic maker on the shared broker: LogAppendTime as the projections' topics, and waits for a
    leader of every partition."""
    from confluent_kafka.admin import NewTopic

    admin = admin_client(settings)

    def make(name: str, partitions: int) -> None:
        topic = NewTopic(name, num_partitions=partitions, replication_factor=settings.replication_factor,
                         config={"message.timestamp.type": "LogAppendTime"})
        admin.create_topics([topic], operation_timeout=30)[name].result(timeout=35)
        deadline = time.monotonic() + 30
        while True:
            found = admin.list_topics(name, timeout=10).topics.get(name)
            if found is not None and found.error is None and len(found.partitions) == partitions and \
                    all(p.leader >= 0 for p in found.partitions.values()):
                return
            assert time.monotonic() < deadline, f"topic {name} has no leaders after 30 s"
            time.sleep(0.1)

    return make


@pytest.fixture(params=["memory", "kafka"])
def side(request) -> Iterator[Side]:
    if request.param == "memory":
        log = InMemoryEventLog()
        yield Side(log, log.create_topic, 0.0, "memory")
        return
    settings: Settings = request.getfixturevalue("kafka_settings")
    prefix = f"{settings.app_name}.{uuid.uuid4().hex[:6]}"
    made = Side(KafkaEventLog(settings, f"{prefix}.lso"), make_kafka_topic(settings), 20.0, prefix)
    try:
        yield made
    finally:
        made.log.close()
        delete_named_topics(settings, made.made)


def commit(writer: Writer, topic: str, values: list[bytes], partition: int = 0) -> None:
    writer.begin_transaction()
    for value in values:
        writer.produce(topic, b"k", value, partition)
    writer.flush(10)
    writer.commit_transaction(10)


def test_both_implement_the_port(side: Side):
    topic = side.topic(2)
    assert isinstance(side.log, EventLog)
    assert isinstance(side.writer(), Writer)
    reader, assigned = side.log.consumer(side.group()), side.log.assigned_reader(side.group())
    try:
        assert isinstance(reader, Reader) and isinstance(assigned, AssignedReader)
    finally:
        reader.close()
        assigned.close()
    assert side.log.partition_count(topic) == 2
    assert isinstance(side.log.cluster_id(), str) and side.log.cluster_id()


def test_committed_records_are_read_and_aborted_ones_never_and_offsets_count_the_markers(side: Side):
    topic, writer = side.topic(), side.writer()
    assert side.log.last_stable_offset(topic, 0) == 0
    delivered: list[tuple[str, int, int]] = []
    writer.begin_transaction()
    for value in (b"a", b"b"):
        writer.produce(topic, b"key", value, 0, on_delivery=lambda *where: delivered.append(where))
    assert writer.flush(10) == 0
    assert delivered == [(topic, 0, 0), (topic, 0, 1)]
    assert side.log.last_stable_offset(topic, 0) == 0  # an open transaction holds the LSO at its first record
    writer.commit_transaction(10)
    assert side.lso(topic, 0, 3) == 3  # two records and the commit marker

    writer.begin_transaction()
    writer.produce(topic, b"key", b"c", 0)
    writer.flush(10)
    writer.abort_transaction(10)
    assert side.lso(topic, 0, 5) == 5  # the aborted record and its marker take offsets too

    writer.begin_transaction()
    writer.produce(topic, b"key", b"d", 0)
    writer.flush(10)
    assert side.log.last_stable_offset(topic, 0) == 5
    writer.commit_transaction(10)
    assert side.lso(topic, 0, 7) == 7

    reader = side.log.consumer(side.group())
    try:
        reader.subscribe([topic])
        read = side.records(reader, 3)
        assert [(r.offset, r.key, r.value) for r in read] == [(0, b"key", b"a"), (1, b"key", b"b"), (5, b"key", b"d")]
        assert all(r.topic == topic and r.partition == 0 and r.timestamp_ms > 0 for r in read)
        assert read[1].next_offset() == Offset(topic, 0, 2)
        assert side.quiet(reader) == []
    finally:
        reader.close()


def test_a_transaction_begun_twice_is_refused_without_a_fence(side: Side):
    topic, writer = side.topic(), side.writer()
    writer.begin_transaction()
    with pytest.raises(EventLogError) as raised:
        writer.begin_transaction()
    assert not isinstance(raised.value, (WriterFenced, TransactionMustAbort))
    writer.produce(topic, b"k", b"still usable", 0)
    writer.commit_transaction(10)
    assert side.lso(topic, 0, 2) == 2


def test_offsets_sent_with_a_committed_transaction_are_where_the_group_resumes(side: Side):
    topic, group = side.topic(2), side.group()
    writer = side.writer()
    commit(writer, topic, [b"p0-0", b"p0-1", b"p0-2"], partition=0)
    commit(writer, topic, [b"p1-0", b"p1-1"], partition=1)
    assigned: list = []
    reader = side.log.consumer(group)
    try:
        reader.subscribe([topic], on_assign=assigned.extend)
        read = side.records(reader, 5)
        assert sorted(assigned) == [(topic, 0), (topic, 1)]
        assert sorted(reader.assignment()) == [(topic, 0), (topic, 1)]
        assert sorted((r.partition, r.offset) for r in read) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
        out = side.topic()
        for offsets, end in (([Offset(topic, 0, 3), Offset(topic, 1, 2)], writer.abort_transaction),
                             ([Offset(topic, 0, 2), Offset(topic, 1, 1)], writer.commit_transaction)):
            writer.begin_transaction()
            writer.produce(out, b"k", b"handled", 0)
            writer.flush(10)
            writer.send_offsets(offsets, reader.group_metadata(), 10)
            end(10)
    finally:
        reader.close()
    again = side.log.consumer(group)
    try:
        again.subscribe([topic])
        resumed = side.records(again, 2)  # the committed offsets, not the aborted ones
        assert sorted((r.partition, r.offset, r.value) for r in resumed) == [(0, 2, b"p0-2"), (1, 1, b"p1-1")]
        again.commit([Offset(topic, 0, 3), Offset(topic, 1, 2)])
    finally:
        again.close()
    third = side.log.consumer(group)
    try:
        third.subscribe([topic])
        assert [item for item in side.quiet(third) if isinstance(item, Record)] == []  # all committed
    finally:
        third.close()


def test_a_newer_writer_with_the_same_id_fences_the_older_and_aborts_its_open_transaction(side: Side):
    topic = side.topic()
    transactional_id = f"{side.prefix}.fenced-{uuid.uuid4().hex[:8]}"
    older = side.log.transactional_producer(transactional_id)
    older.begin_transaction()
    older.produce(topic, b"k", b"from the older", 0)
    older.flush(10)
    newer = side.log.transactional_producer(transactional_id)
    with pytest.raises(WriterFenced):
        older.commit_transaction(10)
    with pytest.raises(WriterFenced):  # fenced for good
        older.begin_transaction()
        older.produce(topic, b"k", b"again", 0)
        older.flush(10)
        older.commit_transaction(10)
    commit(newer, topic, [b"from the newer"])
    assert side.lso(topic, 0, 4) == 4  # older's record and the abort marker, newer's record and its marker
    reader = side.log.consumer(side.group())
    try:
        reader.subscribe([topic])
        assert [(r.offset, r.value) for r in side.records(reader, 1)] == [(2, b"from the newer")]
        assert side.quiet(reader) == []
    finally:
        reader.close()


def test_seek_pause_and_resume(side: Side):
    topic = side.topic()
    commit(side.writer(), topic, [b"0", b"1", b"2"])
    reader = side.log.consumer(side.group())
    try:
        reader.subscribe([topic])
        assert [r.offset for r in side.records(reader, 3)] == [0, 1, 2]
        reader.seek(topic, 0, 1)
        assert [r.offset for r in side.records(reader, 2)] == [1, 2]
        reader.seek(topic, 0, 0)
        reader.pause([(topic, 0)])
        assert side.quiet(reader) == []
        reader.resume([(topic, 0)])
        assert [r.value for r in side.records(reader, 3)] == [b"0", b"1", b"2"]
    finally:
        reader.close()


def test_an_assigned_reader_reports_each_partition_end_once_it_reaches_it(side: Side):
    topic, writer = side.topic(2), side.writer()
    commit(writer, topic, [b"a", b"b"])
    reader = side.log.assigned_reader(side.group())
    try:
        reader.assign([(topic, 0, None), (topic, 1, None)])
        items = side.items(reader, 4)
        records = [item for item in items if not isinstance(item, PartitionEnd)]
        assert [(m.topic(), m.partition(), m.offset(), m.key(), m.value()) for m in records] == \
            [(topic, 0, 0, b"k", b"a"), (topic, 0, 1, b"k", b"b")]
        assert all(m.timestamp()[0] == TIMESTAMP_LOG_APPEND_TIME and m.timestamp()[1] > 0 and m.headers() is None
                   for m in records)  # the broker's clock, as on the projections' topics
        assert {item for item in items if isinstance(item, PartitionEnd)} == \
            {PartitionEnd(topic, 0, 3), PartitionEnd(topic, 1, 0)}  # past the commit marker
        commit(writer, topic, [b"c"], partition=1)
        record, end = side.items(reader, 2)
        assert (record.partition(), record.offset(), record.value()) == (1, 0, b"c")
        assert end == PartitionEnd(topic, 1, 2)  # told again once it reaches the new end
        reader.assign([(topic, 0, 1)])
        later: list = []
        deadline = time.monotonic() + side.patience_s
        while len(later) < 2:
            later += reader.consume(2 - len(later), 0.5 if side.patience_s else 0)
            if time.monotonic() > deadline:
                break
        assert [(m.offset(), m.value()) for m in later[:1]] == [(1, b"b")] and later[1:] == [PartitionEnd(topic, 0, 3)]
    finally:
        reader.close()


def test_calls_outside_a_transaction_and_a_seek_outside_the_assignment_are_refused(side: Side):
    topic, writer = side.topic(), side.writer()
    for call in (lambda: writer.produce(topic, b"k", b"v", 0), lambda: writer.commit_transaction(10),
                 lambda: writer.abort_transaction(10)):
        with pytest.raises(EventLogError) as raised:
            call()
        assert not isinstance(raised.value, (WriterFenced, TransactionMustAbort))
    commit(writer, topic, [b"the writer still works"])
    reader = side.log.consumer(side.group())
    try:
        reader.subscribe([topic])
        assert len(side.records(reader, 1)) == 1
        with pytest.raises(EventLogError):
            reader.seek(topic, 7, 0)  # no such partition assigned
        reader.pause([(topic, 7)])  # pausing or resuming one is no error
        reader.resume([(topic, 7)])
    finally:
        reader.close()

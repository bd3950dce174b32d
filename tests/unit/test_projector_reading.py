"""The projector's reading over the `AssignedReader` port, with the in-memory log's reader
(`tests/memory_log.py`): a batch waits only for its first item, and the fold takes records from any
reader (`tests/fakelog.py` here)."""

from __future__ import annotations

from projections.batch import BatchResult
from projections.fold import decode_batch, fold_batch
from projections.projector import next_batch
from tapeline import ports
from tests.fakelog import FakeLog
from tests.memory_log import InMemoryEventLog
from tests.unit.test_fold import accepted


def test_a_batch_waits_for_its_first_item_only_then_takes_what_has_arrived():
    log = InMemoryEventLog({"jobs": 1})
    writer = log.transactional_producer("tapeline.test")
    writer.begin_transaction()
    writer.produce("jobs", b"job", b"one", 0)
    writer.commit_transaction(10)
    reader = log.assigned_reader("tapeline.projector")
    assert isinstance(reader, ports.AssignedReader)
    reader.assign([("jobs", 0, None)])
    batch = next_batch(reader, 1000, wait_s=0.25)
    assert [(m.offset(), m.value()) for m in batch[:1]] == [(0, b"one")]
    assert batch[1:] == [ports.PartitionEnd("jobs", 0, 2)]  # past the commit marker
    assert reader.called[1:] == [("poll", 0.25), ("consume", 999, 0)]
    assert next_batch(reader, 1000) == [] and reader.called[-1] == ("poll", 0.5)  # nothing: no consume
    reader.assign([("jobs", 0, 0)])
    assert [m.value() for m in next_batch(reader, 1)] == [b"one"] and reader.calls[-1] == "poll"


def test_a_partition_end_stores_its_position_and_a_record_the_one_after_it():
    log = FakeLog()
    log.append(0.0, accepted())
    result = BatchResult(records=1)
    decoded = decode_batch(log.messages, result, {(log.topic, 1): 5, (log.topic, 2): 0})
    folded = fold_batch(decoded, {}, set(), result, clock_topic=log.topic)
    assert result.positions == {(log.topic, 0): 1, (log.topic, 1): 5}  # an empty partition gets no row
    assert result.applied == 1 and folded.changed == {accepted().job_id}
    assert folded.clock == {0: ports.broker_time(log.messages[0])}

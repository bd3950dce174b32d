"""The projector's reading over the `AssignedReader` port, with an in-memory reader: a batch waits
only for its first item, and the fold takes records from any reader (`tests/fakelog.py` here)."""

from __future__ import annotations

from projections.batch import BatchResult
from projections.fold import decode_batch, fold_batch
from projections.projector import next_batch
from tapeline import ports
from tests.fakelog import FakeLog
from tests.unit.test_fold import accepted


class ListReader:
    """An `AssignedReader` over a list of items; records what it was asked."""

    def __init__(self, items: list) -> None:
        self.items, self.calls = list(items), []

    def assign(self, positions):
        self.calls.append(("assign", positions))

    def poll(self, timeout_s):
        self.calls.append(("poll", timeout_s))
        return self.items.pop(0) if self.items else None

    def consume(self, max_records, timeout_s):
        self.calls.append(("consume", max_records, timeout_s))
        taken, self.items = self.items[:max_records], self.items[max_records:]
        return taken

    def records_behind(self):
        return len(self.items)

    def close(self):
        pass


def test_a_batch_waits_for_its_first_item_only_then_takes_what_has_arrived():
    assert isinstance(ListReader([]), ports.AssignedReader)
    log = FakeLog()
    log.append(0.0, accepted())
    end = ports.PartitionEnd(log.topic, log.partition, 1)
    reader = ListReader(log.messages + [end])
    assert next_batch(reader, 1000, wait_s=0.25) == [log.messages[0], end]
    assert reader.calls == [("poll", 0.25), ("consume", 999, 0)]
    assert next_batch(reader, 1000) == [] and reader.calls[-1] == ("poll", 0.5)  # nothing: no consume
    reader = ListReader(log.messages)
    assert next_batch(reader, 1) == log.messages and [c[0] for c in reader.calls] == ["poll"]


def test_a_partition_end_stores_its_position_and_a_record_the_one_after_it():
    log = FakeLog()
    log.append(0.0, accepted())
    result = BatchResult(records=1)
    decoded = decode_batch(log.messages, result, {(log.topic, 1): 5, (log.topic, 2): 0})
    folded = fold_batch(decoded, {}, set(), result, clock_topic=log.topic)
    assert result.positions == {(log.topic, 0): 1, (log.topic, 1): 5}  # an empty partition gets no row
    assert result.applied == 1 and folded.changed == {accepted().job_id}
    assert folded.clock == {0: ports.broker_time(log.messages[0])}

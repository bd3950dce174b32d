"""Priority tiers (issue 9, item 3): the pure choice with aging, and the head buffer over a fake consumer."""

from __future__ import annotations

import pytest

from domain.policy.tiers import after_claim, choose_tier, tier_of
from processors.tier_heads import HeadBuffer
from tapeline.ports import PartitionEnd, Record

ALL = {"archive", "standard", "index"}


def simulate(waiting_per_claim, limit: int) -> list[str]:
    """The tiers a worker claims from, one claim per entry of `waiting_per_claim`."""
    passed: dict[str, int] = {}
    claims = []
    for waiting in waiting_per_claim:
        tier = choose_tier(waiting, passed, limit)
        claims.append(tier)
        passed = after_claim(waiting, passed, tier)
    return claims


def test_the_highest_tier_with_work_goes_first():
    assert choose_tier({"index", "standard"}, {}, 4) == "standard"
    assert choose_tier({"index", "archive", "standard"}, {}, 4) == "archive"
    assert choose_tier({"index"}, {}, 4) == "index"
    assert choose_tier(set(), {}, 4) is None


def test_a_tier_passed_over_limit_times_goes_first_and_ties_go_to_the_higher_tier():
    assert choose_tier({"archive", "index"}, {"index": 4}, 4) == "index"
    assert choose_tier({"archive", "index"}, {"index": 3}, 4) == "archive"
    assert choose_tier(ALL, {"standard": 4, "index": 4}, 4) == "standard"
    assert choose_tier(ALL, {"standard": 4, "index": 5}, 4) == "index"


def test_counts_grow_only_while_a_tier_waits_and_restart_when_it_is_claimed():
    assert after_claim({"archive", "index"}, {"index": 2, "standard": 3}, "archive") == \
        {"archive": 0, "standard": 0, "index": 3}
    assert after_claim({"archive", "index"}, {"index": 4}, "index") == {"archive": 1, "standard": 0, "index": 0}


def test_under_a_flood_of_every_tier_the_lowest_still_gets_one_claim_in_limit_plus_two():
    claims = simulate([ALL] * 24, limit=4)
    assert claims[:6] == ["archive", "archive", "archive", "archive", "standard", "index"]
    index_at = [n for n, t in enumerate(claims) if t == "index"]
    assert max(b - a for a, b in zip([-1] + index_at, index_at)) == 6  # limit + len(TIERS) - 1
    assert claims.count("archive") > claims.count("standard") >= claims.count("index") >= 24 // 6


def test_archive_and_index_only_index_gets_every_fifth_claim():
    claims = simulate([{"archive", "index"}] * 10, limit=4)
    assert claims == ["archive"] * 4 + ["index"] + ["archive"] * 4 + ["index"]


def test_a_tier_that_stops_waiting_loses_its_age():
    waiting = [{"archive", "index"}] * 3 + [{"archive"}] + [{"archive", "index"}] * 4
    assert simulate(waiting, limit=4) == ["archive"] * 8  # index was passed 3 times, then had nothing waiting


def test_tier_of_a_work_topic():
    assert tier_of("t1234.work.transcode.archive") == "archive"


def FakeMessage(topic: str, partition: int, offset: int, timestamp_ms: int) -> Record:
    """A work record as the `Reader` port returns it."""
    return Record(topic=topic, partition=partition, offset=offset, key=None, value=None, headers=None,
                  timestamp_ms=timestamp_ms)


def FakeEnd(topic: str, partition: int, offset: int = 0, *_ignored) -> PartitionEnd:
    """A partition-end event (`enable.partition.eof`)."""
    return PartitionEnd(topic, partition, offset)


class FakeConsumer:
    """What HeadBuffer calls on a `Reader` (tapeline/ports.py), recorded."""

    def __init__(self, assigned):
        self.assigned = list(assigned)
        self.paused, self.calls = set(), []

    def assignment(self):
        return self.assigned

    def pause(self, partitions):
        self.paused |= set(partitions)

    def resume(self, partitions):
        self.paused -= set(partitions)

    def seek(self, topic, partition, offset):
        self.calls.append(("seek", topic, partition, offset))


def test_head_buffer_keeps_one_head_per_partition_and_resumes_everything_it_paused():
    a, i = "p.work.transcode.archive", "p.work.transcode.index"
    consumer = FakeConsumer([(a, 0), (i, 0), (i, 1)])
    buffer = HeadBuffer(consumer, gather_s=0.5)
    arrivals = [FakeMessage(i, 0, 10, 100), FakeMessage(i, 0, 12, 101), FakeMessage(a, 0, 4, 300),
                FakeMessage(i, 1, 7, 50)]
    buffer.gather(lambda timeout_s: arrivals.pop(0) if arrivals else None)
    assert arrivals == []  # stopped once every assigned partition had a head
    assert consumer.calls == [("seek", i, 0, 12)]  # a second record of a headed partition is rewound
    assert consumer.paused == {(a, 0), (i, 0), (i, 1)} and buffer.waiting() == {"archive", "index"}
    taken = buffer.take("index")
    assert (taken.partition, taken.offset) == (1, 7)  # the oldest head of the tier
    buffer.release(taken)
    assert consumer.paused == {(a, 0), (i, 0)}
    buffer.forget([(i, 0)])
    assert consumer.paused == {(a, 0)} and buffer.waiting() == {"archive"}
    buffer.take("archive")
    buffer.clear()  # before leaving the group: a pause would outlive the assignment
    assert consumer.paused == set() and buffer.heads == {}


def test_head_buffer_gather_ends_once_every_partition_has_a_head_or_reported_its_end():
    a, i, s = "p.work.transcode.archive", "p.work.transcode.index", "p.work.transcode.standard"
    consumer = FakeConsumer([(a, 0), (i, 0), (s, 0)])
    buffer = HeadBuffer(consumer, gather_s=30.0)  # a quiet window this long would fail the test by time
    arrivals = [FakeMessage(i, 0, 3, 1), FakeEnd(s, 0, 0, 0), FakeEnd(a, 0, 0, 0), FakeMessage(a, 0, 9, 2)]
    buffer.gather(lambda timeout_s: arrivals.pop(0) if arrivals else None)
    assert len(arrivals) == 1 and buffer.waiting() == {"index"} and buffer.at_end == {(s, 0), (a, 0)}
    buffer.offer(arrivals.pop())  # new work on a partition that had ended: a head again
    assert buffer.waiting() == {"index", "archive"} and buffer.at_end == {(s, 0)}
    taken = buffer.take("archive")
    buffer.release(taken)
    assert (a, 0) not in buffer.at_end and (a, 0) not in consumer.paused


def test_head_buffer_gather_ends_after_quiet_time():
    consumer = FakeConsumer([("p.work.transcode.index", 0), ("p.work.transcode.archive", 0)])
    buffer = HeadBuffer(consumer, gather_s=0.05)
    buffer.gather(lambda timeout_s: None)
    assert buffer.heads == {}


@pytest.mark.parametrize("limit", [1, 2, 4, 8])
def test_no_waiting_tier_is_passed_over_more_than_limit_plus_two_claims(limit):
    claims = simulate([ALL] * 60, limit=limit)
    for tier in ALL:
        at = [n for n, t in enumerate(claims) if t == tier]
        assert at and max(b - a for a, b in zip([-1] + at, at + [60])) <= limit + 2

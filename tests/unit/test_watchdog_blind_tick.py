"""The watchdog's tick when the log refuses a call (issue 24: a broker killed under the pipeline made
`get_watermark_offsets` fail with _DESTROY_BROKER and the watchdog exited; the supervisor restarted it).
Now the tick is blind (it judges nothing) and the watchdog goes on; a fenced writer still stops it."""

from __future__ import annotations

import pytest

from domain.errors import Fenced, ServiceUnavailable
from processors.watchdog import Watchdog
from tapeline.clock import system_clock
from tapeline.health import HealthState
from tapeline.ports import EventLogError, TransactionMustAbort, WriterBroken, WriterFenced
from tapeline.settings import Settings
from tests.memory_jobs import InMemoryJobStore
from tests.memory_log import InMemoryEventLog, MemoryWriter


TOPIC = Settings().jobs_topic


def writer(fail: Exception | None = None) -> MemoryWriter:
    """A writer of an in-memory lifecycle log of 2 partitions whose next commit raises `fail`."""
    made = InMemoryEventLog({TOPIC: 2}).transactional_producer("tapeline.watchdog")
    if fail is not None:
        made.fail_next("commit_transaction", fail)
    return made


def ticks_written(made: MemoryWriter) -> int:
    return len(made.log.records(TOPIC))


class Runtime:
    """What `Watchdog.tick` asks of `processors.runtime.Runtime`, with the log refusing `wait_caught_up`."""

    recorded_by = "watchdog@test"

    def __init__(self, caught_up_error: Exception | None = None) -> None:
        self.caught_up_error, self.produced = caught_up_error, 0
        self.jobs = None  # never reached: a blind tick reads no projection

    def partitions(self, topic: str) -> int:
        return 2

    def produce_to(self, producer, topic: str, partition: int, event) -> None:
        self.produced += 1
        producer.produce(topic, event.job_id.encode(), event.event_id.encode(), partition)

    def wait_caught_up(self, partition: int, timeout_s: float) -> None:
        if self.caught_up_error is not None:
            raise self.caught_up_error


def watchdog() -> Watchdog:
    return Watchdog(Settings(), leader=None, jobs=None, events=None, storage=None, clock=system_clock,
                    health=HealthState("watchdog", "test"))


def blind_ticks(dog: Watchdog) -> float:
    return dog.health.watchdog_ticks.labels(result="blind")._value.get()


@pytest.mark.parametrize("caught_up_error, commit_error", [
    (EventLogError("Failed to get watermark offsets: Local: Broker handle destroyed"), None),
    (None, TransactionMustAbort("the coordinator moved")),
    (None, EventLogError("Local: Timed out")),
])
def test_a_log_that_refuses_a_call_makes_the_tick_blind_not_the_watchdog_exit(caught_up_error, commit_error):
    dog, runtime, made = watchdog(), Runtime(caught_up_error), writer(commit_error)
    assert dog.tick(runtime, made) is None
    assert blind_ticks(dog) == 1 and runtime.produced == 2
    assert ticks_written(made) == (2 if commit_error is None else 0)
    if isinstance(commit_error, TransactionMustAbort):
        assert made.calls.count("abort_transaction") == 1 and made.transaction is None  # the next tick begins afresh


def test_a_fenced_tick_is_blind_and_the_writer_is_replaced_only_by_the_leader():
    """A fence of the ticks' writer while this watchdog holds the leader lock is the coordinator's
    epoch bump after it aborted a tick that outlived the transaction timeout (no other watchdog
    ticks without the lock): blind, and replaced once the leader's session still answers."""
    dog = watchdog()
    assert dog.tick(Runtime(), writer(WriterFenced("This instance has been fenced by a newer instance"))) is None
    assert dog.writer_broken

    dog.leader = InMemoryJobStore()
    dog.leader.lose_session()  # the leader's session is gone, and its lock with it
    with pytest.raises(ServiceUnavailable):
        dog.new_writer(object(), "tapeline.watchdog")


def test_another_error_of_the_tick_is_not_taken_for_a_fence():
    made = writer()
    made.fail_next("begin_transaction", Fenced("attempt 1 no longer owns job j"))  # the projection's word, not the writer's
    with pytest.raises(Fenced):
        watchdog().tick(Runtime(), made)


def test_a_writer_the_client_declared_unusable_makes_the_tick_blind_and_is_replaced():
    """INVALID_TXN_STATE after a record timed out in an election is the client's fatal error, not a
    newer watchdog's fence: the tick is blind, the refusal is remembered as an outage, and `run`
    replaces the writer (before, the watchdog exited and its restart forgot the outage)."""
    dog = watchdog()
    assert dog.tick(Runtime(), writer(WriterBroken("Failed to end transaction: INVALID_TXN_STATE"))) is None
    assert dog.writer_broken and dog.refused_since is not None and blind_ticks(dog) == 1


def projection(newest) -> InMemoryJobStore:
    """The projection after the log came back: empty views and a log clock."""
    return InMemoryJobStore({"log_clock_newest": {"now": newest}, "log_clock_oldest": {"now": newest},
                             **{name: [] for name in ("stalled_attempts", "handoffs_due", "expected_work_unreported",
                                                      "due_retries")}})


def test_refused_ticks_are_remembered_as_a_log_outage_once_a_tick_lands(monkeypatch):
    """Issue 24 (two brokers down for longer than the lease): the stretch the log refused the ticks
    becomes a `LogOutage` in log time, which `run_once` uses to excuse leases that ended in it."""
    from datetime import datetime, timedelta, timezone

    import processors.watchdog as watchdog_module

    monkeypatch.setattr(watchdog_module, "deadlines_in_s", lambda db, settings: [])
    dog = Watchdog(Settings(cleanup_orphans=False), leader=None, jobs=None, events=None, storage=None,
                   clock=system_clock, health=HealthState("watchdog", "test"))
    assert dog.tick(Runtime(), writer(EventLogError("Broker: Not enough in-sync replicas"))) is None
    assert dog.refused_since is not None and dog.outage is None
    dog.refused_since -= 40.0  # as if the refusals began 40 s ago
    dog.next_cleanup_at = float("inf")  # no bucket here
    back = Runtime()
    newest = datetime(2026, 12, 5, 5, 48, 13, tzinfo=timezone.utc)
    back.jobs = projection(newest)
    landed = writer()
    assert dog.tick(back, landed) is not None
    assert ticks_written(landed) == 2
    assert dog.refused_since is None
    assert dog.outage.ended_at == newest
    assert timedelta(seconds=40) <= dog.outage.ended_at - dog.outage.began_at < timedelta(seconds=45)

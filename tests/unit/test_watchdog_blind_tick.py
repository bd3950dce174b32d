"""The watchdog's tick when the log refuses a call (issue 24: a broker killed under the pipeline made
`get_watermark_offsets` fail with _DESTROY_BROKER and the watchdog exited; the supervisor restarted it).
Now the tick is blind (it judges nothing) and the watchdog goes on; a fenced writer still stops it."""

from __future__ import annotations

import pytest

from domain.errors import Fenced
from processors.watchdog import Watchdog
from tapeline.clock import system_clock
from tapeline.health import HealthState
from tapeline.ports import EventLogError, TransactionMustAbort, WriterFenced
from tapeline.settings import Settings


class Writer:
    """A transactional writer whose commit raises `fail` (None: commits)."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail, self.aborted, self.committed = fail, 0, 0

    def begin_transaction(self) -> None: ...

    def flush(self, timeout_s: float) -> int:
        return 0

    def commit_transaction(self, timeout_s: float) -> None:
        if self.fail is not None:
            raise self.fail
        self.committed += 1

    def abort_transaction(self, timeout_s: float) -> None:
        self.aborted += 1

    def poll(self, timeout_s: float) -> None: ...


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

    def wait_caught_up(self, partition: int, timeout_s: float) -> None:
        if self.caught_up_error is not None:
            raise self.caught_up_error


def watchdog() -> Watchdog:
    return Watchdog(Settings(), leader=None, jobs=None, events=None, storage=None, clock=system_clock,
                    health=HealthState("watchdog", "test"))


def blind_ticks(dog: Watchdog) -> float:
    return dog.health.watchdog_ticks.labels(result="blind")._value.get()


@pytest.mark.parametrize("runtime, writer", [
    (Runtime(EventLogError("Failed to get watermark offsets: Local: Broker handle destroyed")), Writer()),
    (Runtime(), Writer(TransactionMustAbort("the coordinator moved"))),
    (Runtime(), Writer(EventLogError("Local: Timed out"))),
])
def test_a_log_that_refuses_a_call_makes_the_tick_blind_not_the_watchdog_exit(runtime, writer):
    dog = watchdog()
    assert dog.tick(runtime, writer) is None
    assert blind_ticks(dog) == 1 and runtime.produced == 2
    if isinstance(writer.fail, TransactionMustAbort):
        assert writer.aborted == 1  # the next tick begins a fresh transaction


def test_a_fenced_watchdog_still_stops():
    with pytest.raises(Fenced):
        watchdog().tick(Runtime(), Writer(WriterFenced("a newer watchdog took over")))

"""A heartbeat the log refuses (issue 24: a broker killed under a running pipeline; the keep-alive
thread stopped at its first failed heartbeat, so no heartbeat landed for the rest of the lease and a
healthy attempt was declared `lease_expired`). Now a refused heartbeat is counted, logged and tried
again at the next call; a fenced writer still stops the attempt."""

from __future__ import annotations

import pytest

from domain.errors import Fenced
from processors.attempt import Attempt
from processors.runtime import AttemptIdentity
from tapeline.clock import system_clock
from tapeline.health import HealthState
from tapeline.ports import EventLogError, WriterFenced
from tapeline.settings import Settings


class Writer:
    """A transactional writer whose next commits raise the errors in `fails`, in order, then commit."""

    def __init__(self, *fails: Exception) -> None:
        self.fails, self.committed, self.aborted = list(fails), 0, 0

    def begin_transaction(self) -> None: ...

    def flush(self, timeout_s: float) -> int:
        return 0

    def commit_transaction(self, timeout_s: float) -> None:
        if self.fails:
            raise self.fails.pop(0)
        self.committed += 1

    def abort_transaction(self, timeout_s: float) -> None:
        self.aborted += 1

    def poll(self, timeout_s: float) -> None: ...


class Jobs:
    def __init__(self, owner: str = "tok") -> None:
        self.owner = owner

    def one(self, name: str, params: dict) -> dict:
        return {"state": "running", "stage": "transcode", "attempt": 1, "claim_token": self.owner}


class Runtime:
    settings = Settings(lease_s=30.0, heartbeat_interval_s=1.0)
    health = HealthState("transcode", "test")

    def __init__(self, jobs: Jobs | None = None) -> None:
        self.jobs = jobs or Jobs()

    def produce(self, producer, outgoing) -> None: ...

    def partitions(self, topic: str) -> int:
        return 4

    def wait_caught_up(self, partition: int, timeout_s: float) -> None: ...


def attempt(writer: Writer, jobs: Jobs | None = None) -> Attempt:
    identity = AttemptIdentity(job_id="job", stage="transcode", attempt=1, claim_token="tok", recorded_by="w@h",
                               correlation_id="up", causation_id=None, clock=system_clock)
    made = Attempt(Runtime(jobs), identity, writer, item=None)
    made.last_heartbeat -= 10  # a heartbeat is due
    return made


def beat(made: Attempt) -> None:
    made.heartbeat(frames_done=1, out_time_s=0.1, speed=1.0, frames_total=None)


def test_a_refused_heartbeat_is_tried_again_at_the_next_call():
    writer = Writer(EventLogError("Local: Timed out", retriable=False))
    made = attempt(writer)
    beat(made)  # refused: no exception, nothing committed
    assert (made.heartbeat_failures, writer.committed) == (1, 0)
    beat(made)  # still due (the refused one did not count): written now
    assert (made.heartbeat_failures, writer.committed) == (1, 1)
    beat(made)  # not due again yet
    assert writer.committed == 1


def test_a_fenced_writer_still_stops_the_attempt_when_a_newer_attempt_owns_the_job():
    with pytest.raises(Fenced):
        beat(attempt(Writer(WriterFenced("a newer attempt took over")), Jobs(owner="newer")))

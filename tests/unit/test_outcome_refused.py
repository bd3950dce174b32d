"""An attempt's outcome the log refuses (issue 24: a broker killed while an attempt finishes). The
worker used to let the error end its process, so a finished attempt was lost and run again after its
lease. Now `Attempt.record` tries again, reconciling first: an outcome whose commit answer was
lost but which landed is not written twice; a newer owner stops it."""

from __future__ import annotations

import pytest

from domain import events as ev
from domain.errors import Fenced, ServiceUnavailable
from processors.attempt import Attempt
from processors.runtime import AttemptIdentity
from tapeline.clock import system_clock
from tapeline.health import HealthState
from tapeline.ports import EventLogError, WriterBroken, WriterFenced
from tapeline.settings import Settings


class Writer:
    """Commits fail with the errors in `fails`, in order; `landed` of them still committed (a lost answer)."""

    def __init__(self, *fails: Exception, landed: int = 0) -> None:
        self.fails, self.landed, self.committed = list(fails), landed, []
        self.pending: list = []

    def begin_transaction(self) -> None:
        self.pending = []

    def produce(self, topic, key, value, partition, on_delivery=None) -> None:
        self.pending.append(value)

    def flush(self, timeout_s: float) -> int:
        return 0

    def commit_transaction(self, timeout_s: float) -> None:
        if self.fails:
            error = self.fails.pop(0)
            if self.landed:
                self.landed -= 1
                self.committed.append(self.pending)
            raise error
        self.committed.append(self.pending)

    def abort_transaction(self, timeout_s: float) -> None: ...

    def poll(self, timeout_s: float) -> None: ...


class Jobs:
    def __init__(self, writer: Writer, owner: str = "tok", answers: list[bool] | None = None) -> None:
        self.writer, self.owner = writer, owner
        self.unanswered = list(answers or [])  # True: the projection cannot answer this time

    def one(self, name: str, params: dict) -> dict:
        if name == "event_recorded":
            return {"recorded": bool(self.writer.committed)}
        return {"state": "running", "stage": "transcode", "attempt": 1, "claim_token": self.owner}


class Runtime:
    settings = Settings(lease_s=30.0, heartbeat_interval_s=1.0)
    health = HealthState("transcode", "test")

    def __init__(self, jobs: Jobs) -> None:
        self.jobs = jobs
        self.events = Events()

    def partitions(self, topic: str) -> int:
        return 3

    def wait_caught_up(self, partition: int, timeout_s: float) -> None:
        if self.jobs.unanswered and self.jobs.unanswered.pop(0):
            raise ServiceUnavailable("projection behind")

    def produce(self, producer, outgoing) -> None:
        for topic, event in outgoing:
            producer.produce(topic, b"k", event.event_id, 0)


class Events:
    """`EventLog.transactional_producer`: a fresh, healthy writer (the renewed attempt writer)."""

    def __init__(self) -> None:
        self.made: list[tuple[str, Writer]] = []

    def transactional_producer(self, transactional_id: str) -> Writer:
        self.made.append((transactional_id, Writer()))
        return self.made[-1][1]


def outcome(writer: Writer, jobs: Jobs | None = None, **kwargs) -> tuple[Attempt, list]:
    identity = AttemptIdentity(job_id="job", stage="transcode", attempt=1, claim_token="tok", recorded_by="w@h",
                               correlation_id="up", causation_id=None, clock=system_clock)
    made = Attempt(Runtime(jobs or Jobs(writer)), identity, writer, item=None)
    event = identity.event(ev.Heartbeat, sequence=1, frames_done=1, frames_total=None, out_time_s=0.1, speed=None)
    return made, [("jobs", event)]


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch):
    monkeypatch.setattr("processors.attempt.time.sleep", lambda s: None)


def test_a_refused_outcome_is_written_once_the_log_answers():
    writer = Writer(EventLogError("Local: Timed out", retriable=False), EventLogError("Broker: Not enough replicas"))
    made, events = outcome(writer)
    made.record(events)
    assert len(writer.committed) == 1


def test_an_outcome_that_landed_although_its_commit_failed_is_not_written_again():
    writer = Writer(EventLogError("Local: Timed out", retriable=False), landed=1)
    jobs = Jobs(writer, answers=[True, True])  # the projection cannot tell twice, then it can
    made, events = outcome(writer, jobs)
    made.record(events)
    assert len(writer.committed) == 1


def test_a_newer_owner_stops_the_retries():
    writer = Writer(EventLogError("Local: Timed out", retriable=False))
    made, events = outcome(writer, Jobs(writer, owner="someone-else"))
    with pytest.raises(Fenced):
        made.record(events)
    assert writer.committed == []


def test_it_gives_up_after_its_bound():
    writer = Writer(*[EventLogError("Local: Timed out", retriable=False)] * 5)
    made, events = outcome(writer)
    with pytest.raises(EventLogError):
        made.record(events, retry_for_s=0.0)
    assert writer.committed == []


class Broken(Writer):
    """librdkafka's fatal state after a failed abort: every transaction fails at `begin`."""

    def begin_transaction(self) -> None:
        raise WriterBroken("Failed to end transaction: Broker: Producer attempted a transactional operation in an "
                           "invalid state")


def test_a_writer_the_client_declared_unusable_is_replaced_while_the_attempt_owns_the_job():
    made, events = outcome(Broken())
    made.record(events)
    (transactional_id, renewed), = made.runtime.events.made
    assert transactional_id == "tapeline.transcode.job" and made.producer is renewed
    assert len(renewed.committed) == 1


def test_an_unusable_writer_is_not_replaced_when_another_attempt_owns_the_job():
    writer = Broken()
    made, events = outcome(writer, Jobs(writer, owner="someone-else"))
    with pytest.raises(Fenced):
        made.record(events)
    assert made.runtime.events.made == []


class TimedOutByTheCoordinator(Writer):
    """What a transaction that outlived `transaction.timeout.ms` in a broker outage leaves: the
    coordinator aborted it and bumped the producer epoch, which librdkafka reports as a fence."""

    def begin_transaction(self) -> None:
        raise WriterFenced("Failed to end transaction: Local: This instance has been fenced by a newer instance")


def test_a_fence_that_is_no_newer_owner_replaces_the_writer_while_the_attempt_owns_the_job():
    made, events = outcome(TimedOutByTheCoordinator())
    made.record(events)
    (_, renewed), = made.runtime.events.made
    assert made.producer is renewed and len(renewed.committed) == 1


def test_a_fence_by_a_newer_owner_stops_the_attempt():
    writer = TimedOutByTheCoordinator()
    made, events = outcome(writer, Jobs(writer, owner="someone-else"))
    with pytest.raises(Fenced):
        made.record(events)
    assert made.runtime.events.made == []

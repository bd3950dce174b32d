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
from tests.memory_jobs import InMemoryJobStore
from tests.memory_log import InMemoryEventLog, MemoryWriter


SETTINGS = Settings(lease_s=30.0, heartbeat_interval_s=1.0)
WRITER_ID = "tapeline.transcode.job"  # the attempt's transactional id


def recorded(log: InMemoryEventLog):
    """The projection's `event_recorded`: whether the event is readable in the lifecycle log."""
    return lambda params: {"recorded": any(r.value == params["event_id"].encode()
                                           for r in log.records(SETTINGS.jobs_topic))}


class Runtime:
    settings = SETTINGS
    health = HealthState("transcode", "test")

    def __init__(self, owner: str, unanswered: list[bool]) -> None:
        self.events = InMemoryEventLog({SETTINGS.jobs_topic: 3})
        self.jobs = InMemoryJobStore({"event_recorded": recorded(self.events), "job_status": {
            "state": "running", "stage": "transcode", "attempt": 1, "claim_token": owner}})
        self.unanswered = list(unanswered)  # True: the projection cannot answer this time

    def partitions(self, topic: str) -> int:
        return self.events.partition_count(topic)

    def wait_caught_up(self, partition: int, timeout_s: float) -> None:
        if self.unanswered and self.unanswered.pop(0):
            raise ServiceUnavailable("projection behind")

    def produce(self, producer, outgoing) -> None:
        for topic, event in outgoing:
            producer.produce(topic, b"k", event.event_id.encode(), 0)


def outcome(owner: str = "tok", unanswered: list[bool] | None = None) -> tuple[Attempt, list, MemoryWriter]:
    """An attempt of job `job` (owned by `owner` in the projection), the outcome it records, its writer."""
    runtime = Runtime(owner, unanswered or [])
    writer = runtime.events.transactional_producer(WRITER_ID)
    identity = AttemptIdentity(job_id="job", stage="transcode", attempt=1, claim_token="tok", recorded_by="w@h",
                               correlation_id="up", causation_id=None, clock=system_clock)
    made = Attempt(runtime, identity, writer, item=None)
    event = identity.event(ev.Heartbeat, sequence=1, frames_done=1, frames_total=None, out_time_s=0.1, speed=None)
    return made, [(SETTINGS.jobs_topic, event)], writer


def written(made: Attempt) -> list[bytes]:
    """The values readable in the lifecycle log."""
    return [r.value for r in made.runtime.events.records(SETTINGS.jobs_topic)]


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch):
    monkeypatch.setattr("processors.attempt.time.sleep", lambda s: None)


def test_a_refused_outcome_is_written_once_the_log_answers():
    made, events, writer = outcome()
    writer.fail_next("commit_transaction", EventLogError("Local: Timed out", retriable=False),
                     EventLogError("Broker: Not enough replicas"))
    made.record(events)
    assert written(made) == [events[0][1].event_id.encode()]


def test_an_outcome_that_landed_although_its_commit_failed_is_not_written_again():
    made, events, writer = outcome(unanswered=[True, True])  # the projection cannot tell twice, then it can
    writer.fail_next("commit_transaction", EventLogError("Local: Timed out", retriable=False), landed=True)
    made.record(events)
    assert written(made) == [events[0][1].event_id.encode()]
    assert writer.calls.count("commit_transaction") == 1


def test_a_newer_owner_stops_the_retries():
    made, events, writer = outcome(owner="someone-else")
    writer.fail_next("commit_transaction", EventLogError("Local: Timed out", retriable=False))
    with pytest.raises(Fenced):
        made.record(events)
    assert written(made) == []


def test_it_gives_up_after_its_bound():
    made, events, writer = outcome()
    writer.fail_next("commit_transaction", *[EventLogError("Local: Timed out", retriable=False)] * 5)
    with pytest.raises(EventLogError):
        made.record(events, retry_for_s=0.0)
    assert written(made) == []


BROKEN = WriterBroken("Failed to end transaction: Broker: Producer attempted a transactional operation in an "
                      "invalid state")
"""librdkafka's fatal state after a failed abort: every transaction fails at `begin`."""
TIMED_OUT_BY_THE_COORDINATOR = WriterFenced("Failed to end transaction: Local: This instance has been fenced by a "
                                            "newer instance")
"""What a transaction that outlived `transaction.timeout.ms` in a broker outage leaves: the
coordinator aborted it and bumped the producer epoch, which librdkafka reports as a fence."""


@pytest.mark.parametrize("fatal", [BROKEN, TIMED_OUT_BY_THE_COORDINATOR])
def test_a_writer_declared_unusable_or_fenced_by_no_newer_owner_is_replaced_while_the_attempt_owns_the_job(fatal):
    made, events, writer = outcome()
    writer.fail_next("begin_transaction", fatal)
    made.record(events)
    renewed = made.runtime.events.writers[WRITER_ID]
    assert renewed is not writer and made.producer is renewed
    assert written(made) == [events[0][1].event_id.encode()]


@pytest.mark.parametrize("fatal", [BROKEN, TIMED_OUT_BY_THE_COORDINATOR])
def test_an_unusable_or_fenced_writer_is_not_replaced_when_another_attempt_owns_the_job(fatal):
    made, events, writer = outcome(owner="someone-else")
    writer.fail_next("begin_transaction", fatal)
    with pytest.raises(Fenced):
        made.record(events)
    assert made.producer is writer and made.runtime.events.calls.count("transactional_producer") == 1
    assert written(made) == []

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
from tapeline.ports import EventLogError
from tapeline.settings import Settings
from tests.memory_jobs import InMemoryJobStore
from tests.memory_log import InMemoryEventLog, MemoryWriter


SETTINGS = Settings(lease_s=30.0, heartbeat_interval_s=1.0)
WRITER_ID = "tapeline.transcode.job"


def jobs(owner: str = "tok") -> InMemoryJobStore:
    """The projection: the job runs attempt 1 of transcode, claimed by `owner`."""
    return InMemoryJobStore({"job_status": {"state": "running", "stage": "transcode", "attempt": 1,
                                            "claim_token": owner}})


class Runtime:
    settings = SETTINGS
    health = HealthState("transcode", "test")

    def __init__(self, log: InMemoryEventLog, jobs: InMemoryJobStore) -> None:
        self.events, self.jobs = log, jobs

    def produce(self, producer, outgoing) -> None:
        for topic, event in outgoing:
            producer.produce(topic, event.job_id.encode(), event.event_id.encode(), 0)

    def partitions(self, topic: str) -> int:
        return self.events.partition_count(topic)

    def wait_caught_up(self, partition: int, timeout_s: float) -> None: ...


def attempt(owner: str = "tok") -> tuple[Attempt, MemoryWriter]:
    log = InMemoryEventLog({SETTINGS.jobs_topic: 4})
    writer = log.transactional_producer(WRITER_ID)
    identity = AttemptIdentity(job_id="job", stage="transcode", attempt=1, claim_token="tok", recorded_by="w@h",
                               correlation_id="up", causation_id=None, clock=system_clock)
    made = Attempt(Runtime(log, jobs(owner)), identity, writer, item=None)
    made.last_heartbeat -= 10  # a heartbeat is due
    return made, writer


def written(made: Attempt) -> int:
    """Heartbeats a reader of the lifecycle log can read."""
    return len(made.runtime.events.records(SETTINGS.jobs_topic))


def beat(made: Attempt) -> None:
    made.heartbeat(frames_done=1, out_time_s=0.1, speed=1.0, frames_total=None)


def test_a_refused_heartbeat_is_tried_again_at_the_next_call():
    made, writer = attempt()
    writer.fail_next("commit_transaction", EventLogError("Local: Timed out", retriable=False))
    beat(made)  # refused: no exception, nothing committed
    assert (made.heartbeat_failures, written(made)) == (1, 0)
    beat(made)  # still due (the refused one did not count): written now
    assert (made.heartbeat_failures, written(made)) == (1, 1)
    beat(made)  # not due again yet
    assert written(made) == 1


def test_a_fenced_writer_still_stops_the_attempt_when_a_newer_attempt_owns_the_job():
    made, _ = attempt(owner="newer")
    made.runtime.events.transactional_producer(WRITER_ID)  # the newer attempt's writer fences this one
    with pytest.raises(Fenced):
        beat(made)
    assert written(made) == 0

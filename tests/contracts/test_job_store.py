"""The `JobStore` port's contract (tapeline/ports.py), its generic part, run against the in-memory
fake (`tests/memory_jobs.py`, what unit tests use) and the PostgreSQL adapter (`tapeline/postgres.py`
`PostgresJobStore` on a fresh database of this module's own): unknown operations, empty answers,
transactions, `wait_applied` and a lost session give the same answers to the same calls.

The fake runs no SQL: here it answers `projector_next_offset` from the `upsert_offset` calls it
kept (never backwards, as the statement is), which is all the operations these checks use; the
real store's database starts empty, so `job_status` has no rows on either side."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Callable, Iterator

import pytest

from domain.errors import ConfigurationError, ServiceUnavailable
from tapeline.ports import JobStore
from tapeline.postgres import PostgresJobStore
from tapeline.settings import Settings
from tests.conftest import own_database
from tests.memory_jobs import InMemoryJobStore
from tests.integration.helpers import terminate_session


@pytest.fixture(scope="module")
def database(base_settings: Settings) -> Iterator[Settings]:
    """`base_settings` on a fresh, migrated database of this module's own (dropped afterwards)."""
    with own_database(base_settings, f"contract_{uuid.uuid4().hex[:8]}") as url:
        yield base_settings.model_copy(update={"database_url": url})


def offsets_kept(store: InMemoryJobStore, params: dict[str, Any]) -> dict[str, int] | None:
    """The fake's `projector_next_offset`: the highest `upsert_offset` kept for that position."""
    key = (params["projection"], params["topic"], params["partition"])
    found = [p["next_offset"] for name, p in store.calls
             if name == "upsert_offset" and (p["projection"], p["topic"], p["partition"]) == key]
    return {"next_offset": max(found)} if found else None


@pytest.fixture(params=["memory", "postgres"])
def store(request) -> Iterator[tuple[JobStore, Callable[[], None]]]:
    """(the store, how to lose its session under it)."""
    if request.param == "memory":
        fake = InMemoryJobStore({"job_status": [], "projector_next_offset": lambda p: offsets_kept(fake, p)})
        yield fake, fake.lose_session
        return
    settings: Settings = request.getfixturevalue("database")
    real = PostgresJobStore(settings)
    try:
        yield real, lambda: terminate_session(real, settings)
    finally:
        real.close()


def position(jobs: JobStore, topic: str, projection: str = "contract") -> int | None:
    row = jobs.one("projector_next_offset", {"projection": projection, "topic": topic, "partition": 0})
    return None if row is None else row["next_offset"]


def advance(jobs: JobStore, topic: str, next_offset: int, projection: str = "contract") -> None:
    jobs.run("upsert_offset", {"projection": projection, "topic": topic, "partition": 0, "next_offset": next_offset})


def test_both_implement_the_port(store):
    jobs, _ = store
    assert isinstance(jobs, JobStore)
    jobs.open()


def test_an_operation_that_is_not_in_the_sql_files_is_a_configuration_error(store):
    jobs, _ = store
    for call in (jobs.all, jobs.one, jobs.run):
        with pytest.raises(ConfigurationError, match=r"^no query named 'no_such_operation' in sql/\*\.sql$"):
            call("no_such_operation", {})
    assert jobs.one("job_status", {"job_id": "after"}) is None  # the store goes on


def test_no_rows_is_none_for_one_and_empty_for_all(store):
    jobs, _ = store
    assert jobs.one("job_status", {"job_id": "no-such-job"}) is None
    assert jobs.all("job_status", {"job_id": "no-such-job"}) == []


def test_a_transaction_commits_at_its_end_and_rolls_back_when_it_raises(store):
    jobs, _ = store
    topic = f"contract.{uuid.uuid4().hex[:8]}"
    assert position(jobs, topic) is None
    advance(jobs, topic, 3)  # outside a transaction: at once
    assert position(jobs, topic) == 3
    with jobs.transaction():
        advance(jobs, topic, 5)
    assert position(jobs, topic) == 5
    with pytest.raises(RuntimeError, match="boom"):
        with jobs.transaction():
            advance(jobs, topic, 9)
            raise RuntimeError("boom")
    assert position(jobs, topic) == 5
    advance(jobs, topic, 4)  # never backwards
    assert position(jobs, topic) == 5


def test_wait_applied_returns_once_applied_and_gives_up_after_its_timeout_or_at_a_stop(store):
    jobs, _ = store
    topic = f"contract.{uuid.uuid4().hex[:8]}"
    jobs.wait_applied(topic, 0, 0, 0.1)  # nothing to wait for
    started = time.monotonic()
    with pytest.raises(ServiceUnavailable, match=rf"projector is behind on {topic}\[0\]: at 0, log at 2"):
        jobs.wait_applied(topic, 0, 2, 0.3)
    assert 0.3 <= time.monotonic() - started < 3.0
    stop = threading.Event()
    stop.set()
    started = time.monotonic()
    with pytest.raises(ServiceUnavailable, match="stopping while the projector is behind"):
        jobs.wait_applied(topic, 0, 2, 30.0, stop=stop)
    assert time.monotonic() - started < 1.0
    advance(jobs, topic, 2, projection="main")  # the projection the store waits for
    jobs.wait_applied(topic, 0, 2, 1.0)


def test_a_lost_session_is_unavailable_once_then_a_new_one_answers(store):
    jobs, lose = store
    assert jobs.one("job_status", {"job_id": "before"}) is None
    lose()
    with pytest.raises(ServiceUnavailable, match="PostgreSQL session lost during job_status"):
        jobs.one("job_status", {"job_id": "lost"})
    assert jobs.one("job_status", {"job_id": "after"}) is None
    lose()
    with pytest.raises(ServiceUnavailable, match="PostgreSQL session lost during a transaction"):
        with jobs.transaction():
            jobs.one("job_status", {"job_id": "lost"})
    assert jobs.all("job_status", {"job_id": "after"}) == []


def test_a_closed_store_opens_a_new_session_on_its_next_call(store):
    jobs, _ = store
    jobs.close()
    assert jobs.one("job_status", {"job_id": "reopened"}) is None
    jobs.close()
    jobs.close()  # closing twice is no error

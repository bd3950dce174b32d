"""The in-memory fakes' own rules, which the contract suites (tests/contracts) cannot check against
the real adapters: error injection on the event log (`fail_next`) and the job store's answers table."""

from __future__ import annotations

import pytest

from domain.errors import ConfigurationError, ServiceUnavailable
from tapeline.ports import EventLogError, LockTimeout, TransactionMustAbort, WriterBroken, WriterFenced
from tests.memory_jobs import InMemoryJobStore, Unanswered
from tests.memory_log import InMemoryEventLog


def test_an_injected_error_raises_once_and_the_call_does_nothing():
    log = InMemoryEventLog({"t": 1})
    writer = log.transactional_producer("w")
    writer.fail_next("commit_transaction", EventLogError("Local: Timed out", retriable=True))
    writer.begin_transaction()
    writer.produce("t", b"k", b"v", 0)
    with pytest.raises(EventLogError, match="Timed out"):
        writer.commit_transaction(1)
    assert log.records("t") == [] and log.last_stable_offset("t", 0) == 0  # still open
    writer.commit_transaction(1)
    assert [r.value for r in log.records("t")] == [b"v"]
    assert writer.calls.count("commit_transaction") == 2


def test_a_landed_error_takes_effect_then_raises():
    log = InMemoryEventLog({"t": 1})
    writer = log.transactional_producer("w")
    writer.fail_next("commit_transaction", EventLogError("Local: Timed out"), landed=True)
    writer.begin_transaction()
    writer.produce("t", b"k", b"v", 0)
    with pytest.raises(EventLogError):
        writer.commit_transaction(1)
    assert [r.value for r in log.records("t")] == [b"v"] and writer.transaction is None


@pytest.mark.parametrize("fatal", [WriterFenced("fenced"), WriterBroken("INVALID_TXN_STATE")])
def test_an_injected_fatal_error_stays(fatal):
    writer = InMemoryEventLog({"t": 1}).transactional_producer("w")
    writer.fail_next("begin_transaction", fatal)
    for _ in range(2):
        with pytest.raises(type(fatal)):
            writer.begin_transaction()
    with pytest.raises(type(fatal)):
        writer.abort_transaction(1)


def test_an_abortable_transaction_only_aborts():
    log = InMemoryEventLog({"t": 1})
    writer = log.transactional_producer("w")
    writer.begin_transaction()
    writer.fail_next("flush", TransactionMustAbort("the coordinator moved"))
    writer.produce("t", b"k", b"lost", 0)
    for call in (lambda: writer.flush(1), lambda: writer.produce("t", b"k", b"v", 0), lambda: writer.commit_transaction(1)):
        with pytest.raises(TransactionMustAbort):
            call()
    writer.abort_transaction(1)
    writer.begin_transaction()
    writer.produce("t", b"k", b"kept", 0)
    writer.commit_transaction(1)
    assert [r.value for r in log.records("t")] == [b"kept"]


def test_failing_a_method_that_does_not_exist_is_refused():
    with pytest.raises(AttributeError):
        InMemoryEventLog().transactional_producer("w").fail_next("comit_transaction", EventLogError("typo"))


def test_the_log_itself_can_refuse_a_call():
    log = InMemoryEventLog({"t": 2})
    log.fail_next("last_stable_offset", EventLogError("Failed to get watermark offsets"))
    with pytest.raises(EventLogError):
        log.last_stable_offset("t", 0)
    assert log.last_stable_offset("t", 0) == 0
    with pytest.raises(ServiceUnavailable):
        log.partition_count("missing")


def test_a_group_has_one_member_in_the_fake():
    log = InMemoryEventLog({"t": 1})
    first = log.consumer("g")
    first.subscribe(["t"])
    with pytest.raises(NotImplementedError):
        log.consumer("g").subscribe(["t"])
    first.close()
    log.consumer("g").subscribe(["t"])  # the first left the group


def test_job_store_answers_rows_one_row_none_or_a_callable():
    store = InMemoryJobStore({"job_status": {"job_id": "a"}, "recent_jobs": [{"job_id": "a"}, {"job_id": "b"}],
                              "job_timeline": None, "projector_next_offset": lambda params: {"next_offset": 3}})
    assert store.one("job_status", {"job_id": "a"}) == {"job_id": "a"}
    assert [r["job_id"] for r in store.all("recent_jobs", {"limit": 2})] == ["a", "b"]
    assert store.one("job_timeline", {"job_id": "a"}) is None and store.all("job_timeline") == []
    store.wait_applied("t", 0, 3, 0.1)
    with pytest.raises(ServiceUnavailable, match="at 3, log at 4"):
        store.wait_applied("t", 0, 4, 0.1)
    assert store.names() == ["job_status", "recent_jobs", "job_timeline", "job_timeline"]  # waits are not calls


def test_job_store_refuses_what_a_test_forgot_or_misnamed():
    with pytest.raises(ConfigurationError):
        InMemoryJobStore({"no_such_query": []})
    store = InMemoryJobStore({"job_status": lambda params: (_ for _ in ()).throw(LockTimeout("job_status: lock"))})
    with pytest.raises(Unanswered, match="recent_jobs"):
        store.all("recent_jobs", {"limit": 1})
    with pytest.raises(LockTimeout):
        store.one("job_status", {"job_id": "a"})
    store.run("session_alive")  # a statement needs no answer
    assert store.names() == ["session_alive"]


def test_a_landed_fatal_error_commits_and_then_the_writer_is_dead():
    log = InMemoryEventLog({"t": 1})
    writer = log.transactional_producer("w")
    writer.fail_next("commit_transaction", WriterFenced("fenced after the commit"), landed=True)
    writer.begin_transaction()
    writer.produce("t", b"k", b"v", 0)
    with pytest.raises(WriterFenced):
        writer.commit_transaction(1)
    assert [r.value for r in log.records("t")] == [b"v"]
    with pytest.raises(WriterFenced):
        writer.begin_transaction()

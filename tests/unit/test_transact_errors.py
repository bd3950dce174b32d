"""`processors.runtime.transact` under the errors a broker outage causes (issue 24 item 2).

The writer here (the in-memory log's, tests/memory_log.py) keeps librdkafka's rule that matters:
`begin_transaction` while a transaction is open fails ("Operation not valid in state
InTransaction"). Before, a flush, offsets or commit error that was neither fenced nor abortable left
the transaction open, so every later transaction of that producer failed at `begin`: a heartbeat
thread that "tries again at the next call" never wrote again and its attempt was judged stalled; the
watchdog's long-lived producer would tick blind for good. A retriable commit error was also repeated
without end and without a word.
"""

from __future__ import annotations

import pytest

from domain.errors import Fenced
from processors.runtime import transact
from tapeline.ports import EventLogError, Offset, TransactionMustAbort, WriterFenced, WriterStuck
from tests.memory_log import InMemoryEventLog, MemoryWriter

TOPIC = "t"


def writer() -> MemoryWriter:
    """A writer of the in-memory log (tests/memory_log.py), which keeps librdkafka's rule that matters:
    `begin_transaction` while a transaction is open is refused."""
    return InMemoryEventLog({TOPIC: 1}).transactional_producer("tapeline.test")


def committed(writer: MemoryWriter) -> int:
    """How many transactions committed (each `run` produces one record)."""
    return len(writer.log.records(TOPIC))


def aborts(writer: MemoryWriter) -> int:
    return writer.calls.count("abort_transaction")


def run(writer: MemoryWriter, offsets: list[Offset] | None = None, **kwargs) -> None:
    group = writer.log.consumer("tapeline.test-group") if offsets else None
    transact(writer, lambda: writer.produce(TOPIC, b"k", b"v", 0), consumer=group, offsets=offsets, **kwargs)


@pytest.mark.parametrize("call", ["flush", "send_offsets", "commit_transaction"])
def test_an_error_that_is_not_retried_aborts_so_the_next_transaction_can_begin(call):
    made = writer()
    made.fail_next(call, EventLogError("Local: Timed out", retriable=False))
    with pytest.raises(EventLogError, match="Timed out"):
        run(made, offsets=[Offset(TOPIC, 0, 1)])
    assert (made.transaction, aborts(made), committed(made)) == (None, 1, 0)
    run(made, offsets=[Offset(TOPIC, 0, 1)])  # begins and commits: the producer is usable
    assert committed(made) == 1


def test_an_abortable_error_aborts_and_is_raised():
    made = writer()
    made.fail_next("commit_transaction", TransactionMustAbort("Transactional operation failed", retriable=True))
    with pytest.raises(TransactionMustAbort):
        run(made)
    assert (made.calls.count("commit_transaction"), aborts(made), made.transaction) == (1, 1, None)
    assert committed(made) == 0


def test_a_retriable_commit_error_is_committed_again():
    made = writer()
    made.fail_next("commit_transaction", *[EventLogError("Local: Timed out", retriable=True)] * 3)
    run(made)
    assert (made.calls.count("commit_transaction"), committed(made), aborts(made)) == (4, 1, 0)


def test_a_commit_that_stays_unconfirmed_gives_up_after_its_bound_and_aborts():
    made = writer()
    made.fail_next("commit_transaction", *[EventLogError("Local: Timed out", retriable=True)] * 1000)
    with pytest.raises(EventLogError, match="Timed out"):
        run(made, commit_retry_s=0.0)
    assert (made.calls.count("commit_transaction"), committed(made), aborts(made), made.transaction) == (1, 0, 1, None)


def test_a_fenced_writer_is_not_aborted_and_says_fenced():
    made = writer()
    made.fail_next("commit_transaction", WriterFenced("Producer fenced by newer instance"))
    with pytest.raises(Fenced):
        run(made)
    assert aborts(made) == 0


def test_a_failing_abort_is_logged_and_the_original_error_raised():
    made = writer()
    made.fail_next("flush", EventLogError("Broker: Not enough in-sync replicas", retriable=False))
    made.fail_next("abort_transaction", EventLogError("Local: Timed out", retriable=False))
    with pytest.raises(EventLogError, match="in-sync replicas"):
        run(made)
    assert aborts(made) == 1  # not retriable: not repeated


def test_an_error_raised_while_producing_aborts():
    made = writer()
    with pytest.raises(ValueError):
        transact(made, lambda: (_ for _ in ()).throw(ValueError("cannot encode")))
    assert (aborts(made), made.transaction) == (1, None)


def test_a_stuck_writer_is_neither_aborted_nor_used_again_by_transact():
    made = writer()
    made.fail_next("send_offsets", WriterStuck("send_offsets_to_transaction did not return"))
    with pytest.raises(WriterStuck):
        run(made, offsets=[Offset(TOPIC, 0, 1)])
    assert aborts(made) == 0 and made.calls[-1] == "send_offsets"


def test_send_offsets_that_never_returns_is_cut_off(monkeypatch):
    """librdkafka 2.16 can wait for ever in `send_offsets_to_transaction` when the group coordinator
    died (issues #5456, #5511); `KafkaWriter.send_offsets` gives up after the timeout plus a grace."""
    import threading

    from tapeline import kafka

    release = threading.Event()

    class Hangs:
        def send_offsets_to_transaction(self, offsets, group_metadata, timeout):
            release.wait(30)

    monkeypatch.setattr(kafka, "SEND_OFFSETS_GRACE_S", 0.2)
    try:
        with pytest.raises(WriterStuck):
            kafka.KafkaWriter(Hangs()).send_offsets([("t", 0, 1)], object(), 0.1)
    finally:
        release.set()


def test_send_offsets_errors_still_arrive_as_the_ports_errors():
    from confluent_kafka import KafkaError, KafkaException

    from tapeline import kafka

    class Refuses:
        def send_offsets_to_transaction(self, offsets, group_metadata, timeout):
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Local: Timed out", retriable=True))

    with pytest.raises(EventLogError) as raised:
        kafka.KafkaWriter(Refuses()).send_offsets([("t", 0, 1)], object(), 0.1)
    assert raised.value.retriable


def test_a_writer_fenced_at_begin_says_fenced():
    """A producer left in librdkafka's fatal state fails at `begin_transaction`: that is `Fenced`,
    never an `EventLogError` a caller would try again."""
    made = writer()
    made.fail_next("begin_transaction", WriterFenced("Failed to end transaction: Broker: Producer attempted a "
                                                     "transactional operation in an invalid state"))
    with pytest.raises(Fenced):
        run(made)
    assert aborts(made) == 0
    with pytest.raises(Fenced):  # the client's fatal state stays
        run(made)


def test_an_abort_that_is_not_confirmed_is_repeated_so_the_next_begin_works():
    """A retriable abort failure left librdkafka's abort running: the next `begin_transaction` failed
    with `_CONFLICT` ("Conflicting abort_transaction API call is already in progress")."""
    made = writer()
    made.fail_next("flush", EventLogError("Broker: Not enough in-sync replicas", retriable=False))
    made.fail_next("abort_transaction", *[EventLogError("Local: Timed out", retriable=True)] * 2)
    with pytest.raises(EventLogError, match="in-sync replicas"):
        run(made)
    assert (aborts(made), made.transaction) == (3, None)
    run(made)
    assert committed(made) == 1

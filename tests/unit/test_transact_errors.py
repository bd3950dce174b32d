"""`processors.runtime.transact` under the errors a broker outage causes (issue 24 item 2).

The writer here keeps librdkafka's rule that matters: `begin_transaction` while a transaction is
open fails ("Operation not valid in state InTransaction"). Before, a flush, offsets or commit error
that was neither fenced nor abortable left the transaction open, so every later transaction of that
producer failed at `begin`: a heartbeat thread that "tries again at the next call" never wrote
again and its attempt was judged stalled; the watchdog's long-lived producer would tick blind for
good. A retriable commit error was also repeated without end and without a word.
"""

from __future__ import annotations

import pytest

from domain.errors import Fenced
from processors.runtime import transact
from tapeline.ports import EventLogError, TransactionMustAbort, WriterFenced, WriterStuck


class Writer:
    """A transactional writer: `fail[call]` lists errors its next calls of that name raise, in order."""

    def __init__(self, **fail: list[Exception]) -> None:
        self.fail = fail
        self.open = False
        self.committed = self.aborted = self.commit_calls = 0

    def _maybe_fail(self, call: str) -> None:
        if self.fail.get(call):
            raise self.fail[call].pop(0)

    def begin_transaction(self) -> None:
        if self.open:
            raise EventLogError("Operation not valid in state InTransaction")
        self.open = True

    def produce(self, *args, **kwargs) -> None: ...

    def flush(self, timeout_s: float) -> int:
        self._maybe_fail("flush")
        return 0

    def send_offsets(self, offsets, group_metadata, timeout_s: float) -> None:
        self._maybe_fail("send_offsets")

    def commit_transaction(self, timeout_s: float) -> None:
        self.commit_calls += 1
        self._maybe_fail("commit")
        self.open = False
        self.committed += 1

    def abort_transaction(self, timeout_s: float) -> None:
        self._maybe_fail("abort")
        self.open = False
        self.aborted += 1

    def poll(self, timeout_s: float) -> None: ...


class Group:
    def group_metadata(self) -> object:
        return object()


def run(writer: Writer, **kwargs) -> None:
    transact(writer, lambda: None, **kwargs)


@pytest.mark.parametrize("call", ["flush", "send_offsets", "commit"])
def test_an_error_that_is_not_retried_aborts_so_the_next_transaction_can_begin(call):
    writer = Writer(**{call: [EventLogError("Local: Timed out", retriable=False)]})
    with pytest.raises(EventLogError, match="Timed out"):
        run(writer, consumer=Group(), offsets=[("t", 0, 1)])
    assert (writer.open, writer.aborted) == (False, 1)
    run(writer, consumer=Group(), offsets=[("t", 0, 1)])  # begins and commits: the producer is usable
    assert writer.committed == 1


def test_an_abortable_error_aborts_and_is_raised():
    writer = Writer(commit=[TransactionMustAbort("Transactional operation failed", retriable=True)])
    with pytest.raises(TransactionMustAbort):
        run(writer)
    assert (writer.commit_calls, writer.aborted, writer.open) == (1, 1, False)


def test_a_retriable_commit_error_is_committed_again():
    writer = Writer(commit=[EventLogError("Local: Timed out", retriable=True)] * 3)
    run(writer)
    assert (writer.commit_calls, writer.committed, writer.aborted) == (4, 1, 0)


def test_a_commit_that_stays_unconfirmed_gives_up_after_its_bound_and_aborts():
    writer = Writer(commit=[EventLogError("Local: Timed out", retriable=True)] * 1000)
    with pytest.raises(EventLogError, match="Timed out"):
        run(writer, commit_retry_s=0.0)
    assert (writer.commit_calls, writer.committed, writer.aborted, writer.open) == (1, 0, 1, False)


def test_a_fenced_writer_is_not_aborted_and_says_fenced():
    writer = Writer(commit=[WriterFenced("Producer fenced by newer instance")])
    with pytest.raises(Fenced):
        run(writer)
    assert writer.aborted == 0


def test_a_failing_abort_is_logged_and_the_original_error_raised():
    writer = Writer(flush=[EventLogError("Broker: Not enough in-sync replicas", retriable=False)],
                    abort=[EventLogError("Local: Timed out", retriable=True)])
    with pytest.raises(EventLogError, match="in-sync replicas"):
        run(writer)


def test_an_error_raised_while_producing_aborts():
    writer = Writer()
    with pytest.raises(ValueError):
        transact(writer, lambda: (_ for _ in ()).throw(ValueError("cannot encode")))
    assert (writer.aborted, writer.open) == (1, False)


def test_a_stuck_writer_is_neither_aborted_nor_used_again_by_transact():
    writer = Writer(send_offsets=[WriterStuck("send_offsets_to_transaction did not return")])
    with pytest.raises(WriterStuck):
        run(writer, consumer=Group(), offsets=[("t", 0, 1)])
    assert writer.aborted == 0


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
    class Dead(Writer):
        def begin_transaction(self) -> None:
            raise WriterFenced("Failed to end transaction: Broker: Producer attempted a transactional operation "
                               "in an invalid state")

    writer = Dead()
    with pytest.raises(Fenced):
        run(writer)
    assert writer.aborted == 0


def test_an_abort_that_is_not_confirmed_is_repeated_so_the_next_begin_works():
    """A retriable abort failure left librdkafka's abort running: the next `begin_transaction` failed
    with `_CONFLICT` ("Conflicting abort_transaction API call is already in progress")."""
    writer = Writer(flush=[EventLogError("Broker: Not enough in-sync replicas", retriable=False)],
                    abort=[EventLogError("Local: Timed out", retriable=True)] * 2)
    with pytest.raises(EventLogError, match="in-sync replicas"):
        run(writer)
    assert (writer.aborted, writer.open) == (1, False)
    run(writer)
    assert writer.committed == 1

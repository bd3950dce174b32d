"""Each adapter has the methods of its port (`tapeline/ports.py`), and building one opens nothing.

`runtime_checkable` checks the method names; the typed assignments make a type checker check the
signatures too. No client is opened: the adapters connect on first use.
"""

from __future__ import annotations

from processors.media import FfmpegTool
from tapeline import ports
from tapeline.clock import SystemClock, system_clock
from tapeline.kafka import KafkaEventLog
from tapeline.objectstore import ObjectStore
from tapeline.postgres import PostgresJobStore
from tapeline.settings import Settings


def test_each_adapter_satisfies_its_port():
    settings = Settings()
    events: ports.EventLog = KafkaEventLog(settings, "test.lso")
    jobs: ports.JobStore = PostgresJobStore(settings)
    storage: ports.ObjectStorage = ObjectStore(settings)
    clock: ports.Clock = SystemClock()
    media: ports.MediaTool = FfmpegTool()
    assert isinstance(events, ports.EventLog)
    assert isinstance(jobs, ports.JobStore)
    assert isinstance(storage, ports.ObjectStorage)
    assert isinstance(clock, ports.Clock) and isinstance(system_clock, ports.Clock)
    assert isinstance(media, ports.MediaTool)
    assert all(callable(getattr(media, name)) for name in ("inspect_source", "keyframe_before", "run_ffmpeg",
                                                            "verify_outputs"))
    events.close()  # nothing was opened: nothing to close, and no error
    jobs.close()


def test_a_port_is_not_satisfied_by_just_anything():
    assert not isinstance(object(), ports.EventLog)
    assert not isinstance(SystemClock(), ports.JobStore)
    assert not isinstance(PostgresJobStore(Settings()), ports.ObjectStorage)
    assert not isinstance(ObjectStore(Settings()), ports.MediaTool)


def test_the_clock_import_paths_still_work():
    from tapeline.clock import system_clock as from_clock

    assert ports.system_clock is from_clock and ports.Clock is __import__("tapeline.clock").clock.Clock


def test_build_processor_hands_each_role_its_adapters_through_the_ports():
    from tapeline.health import HealthState
    from cli.wiring import build_processor

    settings = Settings()
    for role in ("watchdog", "intake", "transcode", "publish"):
        health = HealthState(role, "test")
        processor = build_processor(role, settings, health)  # builds adapters only: nothing connects
        assert processor.health is health
        assert isinstance(processor.events, ports.EventLog) and isinstance(processor.jobs, ports.JobStore)
        assert isinstance(processor.store, ports.ObjectStorage) and isinstance(processor.clock, ports.Clock)
        if role in ("intake", "transcode"):
            assert isinstance(processor.media, ports.MediaTool)
    assert isinstance(build_processor("watchdog", settings, HealthState("watchdog", "test")).leader, ports.JobStore)


def test_the_projectors_reader_satisfies_its_port_and_speaks_its_terms():
    from confluent_kafka import Consumer, KafkaError, Message

    from tapeline.kafka import KafkaAssignedReader

    settings = Settings()
    events = KafkaEventLog(settings, "test.lso")
    assert callable(events.assigned_reader) and callable(events.cluster_id)
    # never assigned: building the client connects nothing
    reader = KafkaAssignedReader(Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": "test.ports"}))
    assert isinstance(reader, ports.AssignedReader) and not isinstance(object(), ports.AssignedReader)
    record = Message(topic="t", partition=2, offset=6, value=b"v", timestamp=(2, 4_102_444_800_123))
    end = Message(topic="t", partition=2, offset=7, error=KafkaError(KafkaError._PARTITION_EOF))
    broken = Message(topic="t", partition=2, error=KafkaError(KafkaError._TRANSPORT, "broker down"))
    assert reader._item(record) is record  # a record is not copied: it is read through `LogRecord`'s methods
    assert reader._item(end) == ports.PartitionEnd("t", 2, 7)
    error = reader._item(broken)
    assert isinstance(error, ports.ReadError) and "broker down" in error.reason and not error.fatal
    assert str(ports.broker_time(record)) == "2100-01-01 00:00:00.123000+00:00"
    reader.close()


def test_the_event_log_reader_and_writer_satisfy_their_ports():
    from confluent_kafka import Consumer, Producer

    from tapeline.kafka import KafkaReader, KafkaWriter

    settings = Settings()
    # never subscribed nor initialised: building the clients connects nothing
    reader = KafkaReader(Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": "test.ports"}))
    writer = KafkaWriter(Producer({"bootstrap.servers": settings.kafka_bootstrap}))
    assert isinstance(reader, ports.Reader) and isinstance(writer, ports.Writer)
    assert not isinstance(writer, ports.Reader)
    reader.close()


def test_client_errors_become_the_ports_errors_fenced_before_must_abort():
    from confluent_kafka import KafkaError, KafkaException

    from tapeline.kafka import log_error

    fenced = log_error(KafkaException(KafkaError(KafkaError._FENCED, "fenced", txn_requires_abort=True)))
    fatal = log_error(KafkaException(KafkaError(KafkaError._FATAL, "Local: Fatal error")))  # fatal() False
    abort = log_error(KafkaException(KafkaError(KafkaError._STATE, "abort it", txn_requires_abort=True)))
    retry = log_error(KafkaException(KafkaError(KafkaError._TIMED_OUT, "again", retriable=True)))
    other = log_error(KafkaException(KafkaError(KafkaError._STATE, "no")))
    assert isinstance(fenced, ports.WriterFenced) and isinstance(fatal, ports.WriterFenced)
    assert type(abort) is ports.TransactionMustAbort and not abort.retriable
    assert type(retry) is ports.EventLogError and retry.retriable and "again" in str(retry)
    assert type(other) is ports.EventLogError and not other.retriable
    assert not isinstance(other, __import__("domain.errors").errors.TapelineError)  # never a job's error class


def test_a_record_knows_its_broker_time_to_the_millisecond_and_the_position_past_it():
    from datetime import datetime, timezone

    record = ports.Record(topic="t", partition=3, offset=41, key=None, value=b"", headers=None,
                          timestamp_ms=4_102_444_800_123)  # 2100-01-01T00:00:00.123Z
    assert record.broker_time == datetime(2100, 1, 1, 0, 0, 0, 123000, tzinfo=timezone.utc)
    assert record.next_offset() == ports.Offset("t", 3, 42)
    assert record.where == {"topic": "t", "partition": 3, "offset": 41}

"""Intake: `UploadCompleted` -> `JobAccepted` + `StageQueued` + a transcode work item, or `JobRejected`.

The pure core is `decide`; `IntakeProcessor` is the loop: poll -> reconcile -> probe -> one
transaction with the events and the upload's offset. Duplicates of an upload collapse onto one job
because the job id is `uuid5(upload_id)` and a job that already exists in the (caught-up)
projection gets no second decision.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any

import structlog
from confluent_kafka import Message, TopicPartition

from processors import media
from processors.runtime import Outgoing, Runtime, poll_record, transact
from schemas import models as ev
from tapeline import kafka
from tapeline.errors import DecodeError, InvalidInput, MediaError, SchemaError, StorageError
from tapeline.health import HealthState
from tapeline.objectstore import ObjectStore, sha256_file
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.intake")


def decide(existing: dict[str, Any] | None, upload: ev.UploadCompleted, probe: ev.SourceMedia | MediaError,
           settings: Settings, recorded_by: str) -> list[Outgoing]:
    """The intake decision for one upload. Pure.

    - the job already exists (a duplicate upload event): nothing;
    - the probe failed: `JobRejected` with the error's class and message;
    - otherwise `JobAccepted` (with the probe and the planned ladder), `StageQueued(transcode)` and
      the transcode `WorkItem` for attempt 1 on the upload's priority tier.
    """
    if existing is not None:
        return []
    common = dict(job_id=upload.job_id, recorded_by=recorded_by, correlation_id=upload.upload_id,
                  causation_id=upload.event_id)
    jobs = settings.jobs_topic
    if isinstance(probe, MediaError):
        return [(jobs, ev.JobRejected.new(stage="intake", attempt=0, upload_id=upload.upload_id,
                                          error_class=probe.error_class, reason=str(probe), **common))]
    ladder = media.plan_ladder(probe, settings.ladder)
    work_topic = settings.work_topic("transcode", upload.priority)
    return [
        (jobs, ev.JobAccepted.new(stage="intake", attempt=0, upload_id=upload.upload_id, source_key=upload.object_key,
                                  source_sha256=upload.sha256, source_size_bytes=upload.size_bytes,
                                  priority=upload.priority, profile=upload.profile, media=probe, ladder=ladder,
                                  **common)),
        (jobs, ev.StageQueued.new(stage="transcode", attempt=1, tier=upload.priority, work_topic=work_topic, **common)),
        (work_topic, ev.WorkItem.new(stage="transcode", attempt=1, tier=upload.priority, source_key=upload.object_key,
                                     inputs=[], renditions=ladder, media_duration_s=probe.duration_s, **common)),
    ]


def inspect_upload(store: ObjectStore, upload: ev.UploadCompleted, settings: Settings) -> ev.SourceMedia | MediaError:
    """Download and probe the source; every problem with the input comes back as a `MediaError`.

    Raises `StorageError` only for transient storage failures (the record is retried).
    """
    if upload.priority not in ("archive", "standard", "index"):
        return InvalidInput(f"unknown priority tier {upload.priority!r}")
    if upload.size_bytes <= 0:
        return InvalidInput("the upload is empty (0 bytes)")
    if upload.size_bytes > settings.max_upload_bytes:
        from tapeline.errors import LimitsExceeded
        return LimitsExceeded(f"upload is {upload.size_bytes} bytes; the limit is {settings.max_upload_bytes}")
    with tempfile.TemporaryDirectory(prefix="tapeline-intake-") as tmp:
        path = Path(tmp) / "source"
        try:
            store.download(upload.object_key, path)
        except StorageError as exc:
            if "404" in str(exc) or "Not Found" in str(exc) or "NoSuchKey" in str(exc):
                return InvalidInput(f"source object {upload.object_key} does not exist")
            raise
        if path.stat().st_size != upload.size_bytes or sha256_file(path) != upload.sha256:
            return InvalidInput("stored source does not match the declared size and sha256 (truncated upload?)")
        try:
            return media.probe_source(path)
        except MediaError as exc:
            return exc


class IntakeProcessor:
    """The intake loop (consumer group `<app>.intake`, transactional id `<app>.intake.<instance>`)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.processed = 0
        self.health = HealthState("intake", settings.instance_id)  # `tapeline run` replaces it with the served one

    def run(self, stop: threading.Event) -> None:
        settings = self.settings
        runtime = Runtime(settings, "intake", health=self.health)
        store = ObjectStore(settings)
        consumer = kafka.consumer(settings, f"{settings.app_name}.intake")
        producer = kafka.transactional_producer(settings, f"{settings.app_name}.intake.{settings.instance_id}")
        consumer.subscribe([settings.uploads_topic])
        self.health.mark_ready()
        try:
            while not stop.is_set():
                message = poll_record(consumer, self.health)
                if message is None:
                    continue
                outgoing = self.handle(runtime, store, message)
                offsets = [TopicPartition(message.topic(), message.partition(), message.offset() + 1)]
                try:
                    transact(producer, lambda: runtime.produce(producer, outgoing), consumer=consumer, offsets=offsets,
                             name="intake")
                except Exception:
                    # Aborted: read the record again from the last committed position.
                    consumer.seek(TopicPartition(message.topic(), message.partition(), message.offset()))
                    raise
                self.processed += 1
                self.health.job_done()
        finally:
            consumer.close()
            runtime.close()

    def handle(self, runtime: Runtime, store: ObjectStore, message: Message) -> list[Outgoing]:
        """Decide on one uploads record. An undecodable record goes to the dead-letter topic, raw."""
        where = dict(topic=message.topic(), partition=message.partition(), offset=message.offset())
        try:
            event = ev.Event.from_record(runtime.codec.decode(message.value(), **where))
            if not isinstance(event, ev.UploadCompleted):
                raise SchemaError(f"{event.event_type} on the uploads topic")
            if event.job_id != ev.job_id_for(event.upload_id):
                raise SchemaError("job_id is not uuid5(upload_id)")
        except (DecodeError, SchemaError) as exc:
            log.warning("undecodable upload record sent to the dead-letter topic", error=str(exc), **where)
            position = f"{message.topic()}/{message.partition()}/{message.offset()}"
            return [(self.settings.dlq_topic, ev.DeadLetter.new(
                job_id=position, stage="intake", attempt=0, recorded_by=runtime.recorded_by, correlation_id=position,
                source_topic=message.topic(), source_partition=message.partition(), source_offset=message.offset(),
                key=message.key(), value=message.value(),
                headers={k: (v or b"") for k, v in (message.headers() or [])},
                error_class="invalid_input", error=str(exc), processor="intake"))]
        existing = runtime.job_row(event.job_id)
        if existing is not None:
            log.info("duplicate upload: the job already exists", job_id=event.job_id, upload_id=event.upload_id)
            return []
        probe = inspect_upload(store, event, self.settings)
        outgoing = decide(None, event, probe, self.settings, runtime.recorded_by)
        log.info("intake decided", job_id=event.job_id, events=[e.event_type for _, e in outgoing])
        return outgoing

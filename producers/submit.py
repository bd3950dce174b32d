"""`tapeline submit`: stream a file to object storage and publish `UploadCompleted`.

The source goes to `uploads/{upload_id}/{filename}` (multipart above the chunk size, sha256 computed
while streaming); the event goes to `<prefix>.uploads` keyed by `upload_id` through an idempotent
producer. The job id is known before intake runs: `uuid5(namespace, upload_id)`.
"""

from __future__ import annotations

import mimetypes
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from domain import events as ev
from domain.codec import default_codec
from tapeline import kafka
from domain.errors import ServiceUnavailable, SubmitError
from tapeline.objectstore import ObjectStore, normalised_content_type
from domain.policy.tiers import TIERS
from tapeline.settings import Settings
from tapeline.clock import system_clock


@dataclass(frozen=True)
class Submission:
    upload_id: str
    job_id: str
    object_key: str
    size_bytes: int
    sha256: str
    event: ev.UploadCompleted


def check_file(path: Path) -> int:
    """Size in bytes of a submittable file. Raises `SubmitError` with a clear message otherwise."""
    if not path.exists():
        raise SubmitError(f"{path}: no such file")
    if path.is_dir():
        raise SubmitError(f"{path}: is a directory; submit a video file")
    if not path.is_file():
        raise SubmitError(f"{path}: not a regular file")
    size = path.stat().st_size
    if size == 0:
        raise SubmitError(f"{path}: the file is empty (0 bytes)")
    return size


def upload(settings: Settings, path: Path, priority: str = "standard", submitter: str = "cli",
           on_bytes: Callable[[int], None] | None = None, upload_id: str | None = None,
           profile: str = "default") -> Submission:
    """Store `path`, read it back (size and sha256 must match what was sent) and build its
    `UploadCompleted` (not yet published). Raises `SubmitError` (a stored object that differs is
    deleted) or `StorageError`."""
    if priority not in TIERS:
        raise SubmitError(f"unknown priority {priority!r}; choose one of {', '.join(TIERS)}")
    check_file(path)
    upload_id = upload_id or str(uuid.uuid4())
    key = f"uploads/{upload_id}/{path.name}"
    content_type = normalised_content_type(mimetypes.guess_type(path.name)[0])
    store = ObjectStore(settings)
    with open(path, "rb") as fh:
        sha, size = store.upload_stream(fh, key, content_type, on_bytes=on_bytes)
    mismatch = store.stored_mismatch(key, size, sha)  # what the event declares is what was stored
    if mismatch is not None:
        store.delete(key)
        raise SubmitError(f"{path}: object storage did not keep the upload as sent ({mismatch}); nothing was "
                          f"published")
    event = upload_completed(settings, upload_id, key, size, sha, path.name, priority, submitter,
                             recorded_by=f"submit@{settings.instance_id}", profile=profile)
    return Submission(upload_id, event.job_id, key, size, sha, event)


def upload_completed(settings: Settings, upload_id: str, key: str, size: int, sha: str, filename: str,
                     priority: str, submitter: str, recorded_by: str, profile: str = "default") -> ev.UploadCompleted:
    """The `UploadCompleted` of a stored source (job id `uuid5(namespace, upload_id)`). Pure."""
    return ev.UploadCompleted.new(system_clock.stamp(), job_id=ev.job_id_for(upload_id), stage="intake", attempt=0, recorded_by=recorded_by,
                                  correlation_id=upload_id, upload_id=upload_id, bucket=settings.s3_bucket,
                                  object_key=key, size_bytes=size, sha256=sha, filename=filename,
                                  priority=priority, profile=profile, submitter=submitter)


def publish(settings: Settings, event: ev.UploadCompleted, copies: int = 1, timeout_s: float = 30.0) -> None:
    """Publish `event` to the uploads topic (`copies` > 1 only in tests of duplicate delivery).

    Raises `KafkaAccessRefused` when Kafka refuses this client (a certificate, password or ACL: which
    one is in the message), `ServiceUnavailable` when Kafka does not acknowledge within `timeout_s` seconds.
    """
    producer = kafka.idempotent_producer(settings)
    errors: list = []
    value = default_codec().encode(event.to_record())
    try:
        partitions = kafka.partition_count(producer, settings.uploads_topic)
    except Exception as exc:  # the client's error, or a refusal its error callback raised
        refusal = kafka.refusal_of(settings, exc, producer)
        if refusal is not None:
            raise refusal from exc
        raise
    for _ in range(copies):
        producer.produce(settings.uploads_topic, key=event.upload_id.encode(), value=value,
                         partition=kafka.partition_for(event.upload_id, partitions),
                         on_delivery=lambda err, msg: errors.append(err) if err else None)
    unsent = producer.flush(timeout_s)
    for error in errors:
        refusal = kafka.access_refusal(error)
        if refusal is not None:
            raise refusal
    if unsent > 0 or errors:
        raise ServiceUnavailable(f"Kafka at {settings.kafka_bootstrap} did not acknowledge the upload: "
                                 f"{[str(e) for e in errors] or 'timeout'}")

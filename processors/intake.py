"""Intake: `UploadCompleted` -> `JobAccepted` + `StageQueued` + a transcode work item, or `JobRejected`.

The pure core is `domain/policy/intake_decision.py` (`decide`, `preflight`); `IntakeProcessor` is the
loop: poll -> reconcile -> probe -> one transaction with the events and the upload's offset.
Duplicates of an upload collapse onto one job because the job id is `uuid5(upload_id)` and a job
that already exists in the (caught-up) projection gets no second decision.
"""

from __future__ import annotations

import os
import tempfile
import threading
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import structlog

from processors import media, reuse
from tapeline.rows import tier_backlogs
from processors.runtime import Outgoing, Runtime, dead_letter_event, dead_letter_record, poll_record, transact
from domain import events as ev
from domain.codec import Codec
from tapeline import logs
from domain.errors import (DecodeError, InvalidInput, MediaError, QuotaExceeded, SchemaError,
                             ObjectMissing, TapelineError)
from tapeline.health import HealthState
from tapeline.objects import sha256_file
from domain.policy import intake_decision as policy
from domain.policy.intake_decision import preflight
from tapeline.settings import Settings
from tapeline.ports import Clock, EventLog, EventLogError, JobStore, MediaTool, ObjectStorage, Record, WriterStuck

log = structlog.get_logger("tapeline.intake")
RECORD_BACKOFF_CAP_S = 30.0
"""Longest wait between two tries of one failing uploads record, seconds."""


def record_backoff(failures: int, settings: Settings) -> float | None:
    """After `failures` failed tries of one uploads record: the seconds to wait before trying it
    again, or None when it has had its `intake_record_max_tries` and goes to the dead-letter topic.
    Pure. The waits are `intake_record_backoff_s` x 2^(failures-1), at most `RECORD_BACKOFF_CAP_S`.

    The head-of-line bound: a record holds up the records behind it on its partition for at most
    `record_hold_bound_s(settings)` seconds of waiting plus the time of its `intake_record_max_tries`
    tries (each try is bounded by the S3 calls' timeouts, `s3_max_attempts` x (connect + read
    timeout) per call on a silent endpoint, the download of at most `max_upload_bytes`, and
    `probe_timeout_s`). Defaults: 4 tries, 2 + 4 + 8 = 14 s of waiting. Every error counts, the
    transient ones too (an S3 or PostgreSQL outage longer than that dead-letters the uploads it
    meets, and `tapeline dlq replay` sends them through again: docs/threat-model.md, issue 20),
    except the event log's own refusals, which are no try (`IntakeProcessor.run`)."""
    if failures >= settings.intake_record_max_tries:
        return None
    return min(RECORD_BACKOFF_CAP_S, settings.intake_record_backoff_s * 2.0 ** (failures - 1))


def record_hold_bound_s(settings: Settings) -> float:
    """Seconds of waiting between the tries of one failing uploads record before it is
    dead-lettered: the sum of `record_backoff` over its tries. Pure."""
    return sum(record_backoff(n, settings) or 0.0 for n in range(1, settings.intake_record_max_tries))


def decide(existing: dict[str, Any] | None, upload: ev.UploadCompleted, probe: ev.SourceMedia | TapelineError,
           settings: Settings, recorded_by: str, profile: reuse.OutputProfile | None = None,
           reusable: reuse.Reusable | None = None, *, clock: Clock) -> list[Outgoing]:
    """The intake decision for one upload: `domain/policy/intake_decision.py` `decide` (the rules are its
    docstring's) with `clock`'s stamps, and with `profile` None the full profile
    (`reuse.full_profile` of `media.plan_ladder`)."""
    if profile is None and existing is None and not isinstance(probe, TapelineError):
        profile = reuse.full_profile(upload.profile, media.plan_ladder(probe, settings.ladder), settings)
    return policy.decide(existing, upload, probe, profile, reusable, settings, recorded_by, clock.stamp)


def choose_profile(runtime: Runtime, store: ObjectStorage, upload: ev.UploadCompleted, probe: ev.SourceMedia,
                   settings: Settings) -> tuple[reuse.OutputProfile, reuse.Reusable | None]:
    """The job's output profile (degraded while its tier's backlog, read from the projection, is above
    the threshold) and a reusable result, if any: the full profile's result first (full quality at
    no cost), then the degraded one's. Raises `StorageError` when S3 cannot answer a HEAD."""
    full = media.plan_ladder(probe, settings.ladder)
    backlog = None
    if settings.degrade_backlog_threshold is not None and upload.priority in settings.degrade_tiers:
        backlog = tier_backlogs(runtime.jobs.all("tier_backlog", {"window_s": 300.0}), 300.0)[upload.priority].backlog
    profile = reuse.plan_profile(upload.profile, upload.priority, full, backlog, settings)
    if not settings.reuse_results:
        return profile, None
    best = reuse.full_profile(upload.profile, full, settings)
    candidates = [best] + ([profile] if profile.fingerprint != best.fingerprint else [])
    found = reuse.find_reusable(runtime.jobs, store, upload.sha256, [c.fingerprint for c in candidates])
    if found is None:
        return profile, None
    return next(c for c in candidates if c.fingerprint == found.fingerprint), found


def inspect_upload(store: ObjectStorage, upload: ev.UploadCompleted, settings: Settings,
                   tool: MediaTool) -> ev.SourceMedia | MediaError:
    """Check, download and probe (with `tool`) the source; every problem with the input comes back as a `MediaError`.

    In order: `preflight` on the event; the stored object must exist and match the declared size
    and sha256 (else `InvalidInput`: a truncated or replaced upload); the probe refuses playlists,
    containers off the allow-list, sources without video and sources cut short of their index
    (`MediaTool.inspect_source`); then the pre-flight limits on picture size, duration and bitrate
    (`media.check_limits`). Raises `StorageError` only for transient storage failures (the record
    is retried).
    """
    problem = preflight(upload, settings)
    if problem is not None:
        return problem
    with tempfile.TemporaryDirectory(prefix="tapeline-intake-") as tmp:
        path = Path(tmp) / "source"
        stored = store.head(upload.object_key)  # a short object is refused before its download
        if stored is None:
            return InvalidInput(f"source object {upload.object_key} does not exist")
        if stored[0] != upload.size_bytes:
            return InvalidInput(f"truncated upload: the stored source is {stored[0]} bytes, the upload declared "
                                f"{upload.size_bytes}")
        try:
            store.download(upload.object_key, path)
        except ObjectMissing:
            return InvalidInput(f"source object {upload.object_key} does not exist")
        size = path.stat().st_size
        if size != upload.size_bytes:
            return InvalidInput(f"truncated upload: the stored source is {size} bytes, the upload declared "
                                f"{upload.size_bytes}")
        if sha256_file(path) != upload.sha256:
            return InvalidInput("the stored source does not match the declared sha256 (corrupted or replaced upload)")
        try:
            probe = tool.inspect_source(path, timeout_s=settings.probe_timeout_s)
            media.check_limits(probe.media, settings, size_bytes=size)
        except MediaError as exc:
            return exc
        return probe.media


def parse_upload(codec: Codec, value: bytes | None, **where: Any) -> ev.UploadCompleted:
    """Decode one uploads-topic record value into its `UploadCompleted`. Pure.

    Raises `DecodeError` (not one of our records) or `SchemaError` (a valid record of another type,
    a malformed event, or a job id that is not `uuid5(upload_id)`); `where` is topic, partition,
    offset for the error message.
    """
    event = ev.Event.from_record(codec.decode(value, **where))
    if not isinstance(event, ev.UploadCompleted):
        raise SchemaError(f"{event.event_type} on the uploads topic")
    if event.job_id != ev.job_id_for(event.upload_id):
        raise SchemaError("job_id is not uuid5(upload_id)")
    return event


def dead_letter(settings: Settings, recorded_by: str, error: TapelineError, *, topic: str, partition: int,
                offset: int, key: bytes | None, value: bytes | None,
                headers: list[tuple[str, bytes | None]] | None, clock: Clock) -> Outgoing:
    """The dead-letter record of an uploads record that cannot be decoded: raw key, value and
    headers, where it was and why, stamped by `clock`. Pure."""
    return (settings.dlq_topic, dead_letter_event("intake", recorded_by, error, topic=topic, partition=partition,
                                                  offset=offset, key=key, value=value, headers=headers, clock=clock))


def triage(codec: Codec, settings: Settings, recorded_by: str, *, topic: str, partition: int, offset: int,
           key: bytes | None, value: bytes | None,
           headers: list[tuple[str, bytes | None]] | None, clock: Clock) -> ev.UploadCompleted | Outgoing:
    """An uploads record as the upload it carries, or as its dead-letter record (stamped by `clock`). Pure; never raises
    for any bytes (the property tests in tests/unit/test_fuzz.py hold it to that)."""
    try:
        return parse_upload(codec, value, topic=topic, partition=partition, offset=offset)
    except (DecodeError, SchemaError) as exc:
        return dead_letter(settings, recorded_by, exc, topic=topic, partition=partition, offset=offset, key=key,
                           value=value, headers=headers, clock=clock)


def quota_check(db: JobStore, upload: ev.UploadCompleted, now: datetime, settings: Settings) -> QuotaExceeded | None:
    """`QuotaExceeded` when the upload's submitter already has `submitter_daily_quota` jobs accepted
    (not rejected) from uploads in the 24 hours before `now` (the upload's broker time, so a replay
    decides the same), else None. No quota set: None."""
    quota = settings.submitter_daily_quota
    if quota is None:
        return None
    used = db.one("submitter_jobs_between", {"submitter": upload.submitter, "since": now - timedelta(days=1),
                                             "until": now})["jobs"]
    if used < quota:
        return None
    return QuotaExceeded(f"submitter {upload.submitter!r} reached its quota of {quota} jobs per 24 h "
                         f"({used} accepted since {now - timedelta(days=1):%Y-%m-%d %H:%M:%S} UTC)")


class IntakeProcessor:
    """The intake loop (consumer group `<app>.intake`, transactional id `<app>.intake.<instance>`)."""

    def __init__(self, settings: Settings, *, events: EventLog, jobs: JobStore, storage: ObjectStorage,
                 media: MediaTool, clock: Clock, health: HealthState | None = None) -> None:
        """The adapters (`cli/wiring.py` `build_processor`): `events`, the uploads and lifecycle
        logs; `jobs`, the projection it reconciles against; `storage`, where sources are; `media`, the
        probe; `clock`, what its events are stamped with. `run` closes `events` and `jobs` when it ends."""
        self.settings = settings
        self.events, self.jobs, self.store, self.media, self.clock = events, jobs, storage, media, clock
        self.processed = 0
        self.health = health or HealthState("intake", settings.instance_id)  # `tapeline run` serves it

    def run(self, stop: threading.Event) -> None:
        settings = self.settings
        runtime = Runtime(settings, "intake", health=self.health, stop=stop, events=self.events, jobs=self.jobs)
        store = self.store
        consumer = self.events.consumer(f"{settings.app_name}.intake")
        # The pid keeps two intake processes on one host from fencing each other; consume-produce
        # transactions are fenced by the consumer group's generation (KIP-447), not by a stable id.
        transactional_id = f"{settings.app_name}.intake.{settings.instance_id}.{os.getpid()}"
        producer = self.events.transactional_producer(transactional_id)
        consumer.subscribe([settings.uploads_topic])
        self.health.mark_ready()
        failures: dict[tuple[str, int, int], int] = {}
        try:
            while not stop.is_set():
                message = poll_record(consumer, self.health)
                if message is None:
                    continue
                with logs.scope(**message.where):  # every line about this record says which
                    position = (message.topic, message.partition, message.offset)
                    try:
                        outgoing = self.handle(runtime, store, message)
                    except EventLogError as exc:
                        # The log itself refused (a partition without a leader during an election):
                        # not this record's fault, and not a try of it (a dead letter needs the log
                        # too). Read it again once the log answers.
                        log.warning("the log refused while deciding; reading the record again", error=str(exc))
                        self.reread(consumer, position)
                        stop.wait(1.0)
                        continue
                    except Exception as exc:  # transient infrastructure, or a bug on this one record
                        failures[position] = failures.get(position, 0) + 1
                        outgoing = self.after_failure(runtime, message, exc, failures[position], stop)
                        if outgoing is None:
                            consumer.seek(*position)  # read it again
                            continue
                    failures.pop(position, None)
                    offsets = [message.next_offset()]
                    try:
                        transact(producer, lambda: runtime.produce(producer, outgoing), consumer=consumer,
                                 offsets=offsets, name="intake")
                    except WriterStuck as exc:
                        # A new writer with the same id fences the stuck one and aborts what it left open.
                        log.error("intake writer stuck; replacing it and reading the record again",
                                  error=str(exc), **message.where)
                        self.reread(consumer, position)
                        producer = self.events.transactional_producer(transactional_id)
                        continue
                    except EventLogError as exc:
                        # Aborted (a leader or the coordinator moving, the group rebalancing): read
                        # the record again from its position; the decision is made again against the
                        # caught-up projection, so an unknown commit outcome decides nothing twice.
                        log.warning("intake transaction aborted; reading the record again", error=str(exc), **message.where)
                        self.reread(consumer, position)
                        stop.wait(1.0)
                        continue
                    except Exception:
                        self.reread(consumer, position)
                        raise
                    self.processed += 1
                    self.health.job_done()
        finally:
            consumer.close()
            runtime.close()

    @staticmethod
    def reread(consumer, position: tuple[str, int, int]) -> None:
        """Seek back to `position` so the record is read again; a partition revoked meanwhile is
        simply not ours any more (its next owner reads from the committed offset)."""
        try:
            consumer.seek(*position)
        except EventLogError as exc:
            log.info("record not re-read here: its partition moved", error=str(exc))

    def after_failure(self, runtime: Runtime, message: Record, error: Exception, failures: int,
                      stop: threading.Event) -> list[Outgoing] | None:
        """What to do after handling a record raised (a transient storage, broker or projection
        failure, or a bug on this one record): None to read it again after `record_backoff`, or,
        after `intake_record_max_tries` failed tries, its dead-letter record with the error's class
        and message, so one record never stops the intake or holds up its partition past the bound
        `record_backoff` states (docs/design.md principle 6)."""
        where = message.where
        delay = record_backoff(failures, self.settings)
        reason = f"{type(error).__name__}: {error}"
        if delay is None:
            error_class = error.error_class if isinstance(error, TapelineError) else "unknown"
            log.error("upload record failed on every try; sent to the dead-letter topic", error=reason,
                      error_class=error_class, failures=failures, **where)
            return [(self.settings.dlq_topic, dead_letter_record(
                message, RuntimeError(f"intake gave up after {failures} tries: {reason}"), "intake",
                runtime.recorded_by, error_class=error_class, clock=self.clock))]
        log.warning("upload record failed; reading it again", error=reason, failures=failures, retry_in_s=delay,
                    **where)
        stop.wait(delay)
        return None

    def handle(self, runtime: Runtime, store: ObjectStorage, message: Record) -> list[Outgoing]:
        """Decide on one uploads record. An undecodable record goes to the dead-letter topic, raw."""
        where = message.where
        triaged = triage(runtime.codec, self.settings, runtime.recorded_by, key=message.key, value=message.value,
                         headers=message.headers, clock=self.clock, **where)
        if not isinstance(triaged, ev.UploadCompleted):
            log.warning("undecodable upload record sent to the dead-letter topic", error=triaged[1].error, **where)
            return [triaged]
        event = triaged
        logs.bind(job_id=event.job_id, stage="intake", upload_id=event.upload_id)
        existing = runtime.job_row(event.job_id)
        if existing is not None:
            log.info("duplicate upload: the job already exists", job_id=event.job_id, upload_id=event.upload_id)
            return []
        probe = quota_check(runtime.jobs, event, message.broker_time, self.settings) or \
            inspect_upload(store, event, self.settings, self.media)
        profile, reusable = (None, None) if isinstance(probe, TapelineError) else \
            choose_profile(runtime, store, event, probe, self.settings)
        outgoing = decide(None, event, probe, self.settings, runtime.recorded_by, profile, reusable, clock=self.clock)
        log.info("intake decided", job_id=event.job_id, events=[e.event_type for _, e in outgoing],
                 degraded=bool(profile and profile.degraded),
                 reused_from=reusable.origin_job_id if reusable else None)
        return outgoing

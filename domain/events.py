"""Pydantic models of every event, mirroring `avro/*.avsc` field for field.

`tests/unit/test_schemas.py` checks that each model's fields equal its schema's, so the two cannot
drift. Build events with `EventClass.new(stamp, job_id=..., stage=..., attempt=..., ...)`: the caller's clock
gives `event_id` and `occurred_at` (`Stamp`), and `new` adds the deterministic `dedup_key`.
"""

from __future__ import annotations

import types
import typing
import uuid
from datetime import datetime
from typing import Any, ClassVar, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from domain.errors import SchemaError

TAPELINE_NAMESPACE = uuid.UUID("6f1c7a52-2f4e-5a8e-9d1b-7c3e0b5a4d21")
"""Namespace of `job_id = uuid5(TAPELINE_NAMESPACE, upload_id)`. Never change it: job ids depend on it."""


def job_id_for(upload_id: str) -> str:
    """The job id of an upload: `uuid5(TAPELINE_NAMESPACE, upload_id)`, so duplicates collapse."""
    return str(uuid.uuid5(TAPELINE_NAMESPACE, upload_id))


def dedup_key(job_id: str, stage: str, attempt: int, event_type: str, sequence: int | str | None = None) -> str:
    """The dedup key of an event: `{job_id}:{stage}:{attempt}:{event_type}` plus `:{sequence}`
    for events that repeat within an attempt (heartbeats, checkpoints, ticks)."""
    key = f"{job_id}:{stage}:{attempt}:{event_type}"
    return key if sequence is None else f"{key}:{sequence}"


class Stamp(NamedTuple):
    """When an event was written and its id: `occurred_at` (the writer's clock, UTC, microseconds;
    evidence only, leases use broker time) and a fresh `event_id`. The caller's clock makes it
    (`tapeline/clock.py`); the domain never reads a clock or draws an id itself."""

    occurred_at: datetime
    event_id: str


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class OutputFile(_Frozen):
    """One object an attempt wrote: key, hex sha256, size in bytes, content type."""

    key: str
    sha256: str
    size_bytes: int
    content_type: str


class Rendition(_Frozen):
    """One ladder rung: name (e.g. `720p`), even width and height in pixels, video bitrate in kbit/s."""

    name: str
    width: int
    height: int
    video_bitrate_kbps: int
    playlist_key: str | None = None
    url: str | None = None


class SourceMedia(_Frozen):
    """What ffprobe promised about a source: container, duration (s), sizes (px), rotation (deg)."""

    format_name: str
    duration_s: float
    width: int
    height: int
    display_width: int
    display_height: int
    rotation: int
    fps: float
    frames: int | None = None
    video_codec: str
    audio_codec: str | None = None
    bit_rate_bps: int | None = None
    audio_duration_s: float | None = None
    """The encoded audio stream's own duration, s (`duration_s` is the video stream's)."""
    handling: str | None = None
    """What the transcode does about what is unusual in the source, sentences joined by "; "
    (`media.source_handling`); None when nothing is."""


class ToolState(_Frozen):
    """What a worker saw of its tool's process (ffmpeg) while heartbeating, from `/proc/<pid>/stat`
    (`processors/media.py` `ToolWatch`): `tool` (its name), `process_state` (the kernel's letter: R
    running, S sleeping, D waiting on I/O, T stopped by a signal, Z exited), `cpu_s` (user + system
    CPU seconds, every thread, used over the last `window_s` wall seconds: the last minute at most,
    and not before its progress counters last moved), `last_progress` (its last `-progress` block,
    one line), `stderr_tail` (its last stderr lines, at most 500 characters) and `cpu_wait_s`
    (seconds its threads were runnable but waited for a CPU over the same window: a busy host).
    Interpreted by `domain/policy/tool_state.py` `explain_tool_state`."""

    tool: str
    process_state: str | None = None
    cpu_s: float | None = None
    window_s: float | None = None
    last_progress: str | None = None
    stderr_tail: str | None = None
    cpu_wait_s: float | None = None


class Event(_Frozen):
    """The envelope every event starts with (see `avro/Envelope.avsc` for each field's meaning)."""

    registry: ClassVar[dict[str, type["Event"]]] = {}

    event_id: str
    event_type: str
    job_id: str
    stage: str
    attempt: int
    claim_token: str | None = None
    occurred_at: datetime
    recorded_by: str
    correlation_id: str
    causation_id: str | None = None
    dedup_key: str

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Event.registry[cls.__name__] = cls

    @classmethod
    def new(cls, stamp: Stamp, *, job_id: str, stage: str, attempt: int, recorded_by: str, correlation_id: str,
            claim_token: str | None = None, causation_id: str | None = None,
            sequence: int | str | None = None, occurred_at: datetime | None = None, **fields: Any) -> "Event":
        """Build an event with the `event_id` and `occurred_at` of `stamp` (an explicit `occurred_at`
        wins: golden files and tests fix it) and its deterministic dedup key.

        `sequence` (heartbeats, checkpoints, ticks) goes into the dedup key and, where the event
        has a `sequence` field, into that field too.
        """
        if sequence is not None and "sequence" in cls.model_fields:
            fields["sequence"] = sequence
        return cls(event_id=stamp.event_id, event_type=cls.__name__, job_id=job_id, stage=stage,
                   attempt=attempt, claim_token=claim_token, occurred_at=occurred_at or stamp.occurred_at,
                   recorded_by=recorded_by, correlation_id=correlation_id, causation_id=causation_id,
                   dedup_key=dedup_key(job_id, stage, attempt, cls.__name__, sequence), **fields)

    def to_record(self) -> dict:
        """The dict the codec encodes."""
        return self.model_dump()

    @staticmethod
    def from_record(record: dict) -> "Event":
        """The model of a decoded record. Raises `SchemaError` for an unknown or malformed event."""
        cls = Event.registry.get(record.get("event_type", ""))
        if cls is None:
            raise SchemaError(f"unknown event_type {record.get('event_type')!r}")
        try:
            return cls.model_validate(record)
        except ValueError as exc:
            raise SchemaError(f"{cls.__name__}: {exc}") from exc

    @staticmethod
    def from_decoded(record: dict) -> "Event":
        """The model of a record the codec just decoded (so resolved to the current schema of its type).

        For an event type whose fields are all plain scalars (`str`, `int`, `float`, `bool`,
        `datetime`, or `None` for an optional one), nested records of such scalars, or lists of
        those, and that has no validators, the Avro reader has already guaranteed every field's
        type, so the model is built around `record` (which it then owns) without validation: about
        1 µs instead of 10-15 µs (40 µs for a `JobAccepted`). Heartbeats and checkpoints, most of
        the log, are such types. Anything else (maps, bytes, a field count that is not the model's)
        goes through `from_record`. Raises `SchemaError` like `from_record`.
        """
        cls = Event.registry.get(record.get("event_type", ""))
        plan = _plan(cls) if cls is not None else None
        if plan is not None and len(record) == plan[0]:
            try:
                for name, model, many in plan[1]:
                    value = record[name]
                    if many:
                        record[name] = [_bare(model, item) for item in value]
                    elif value is not None:
                        record[name] = _bare(model, value)
            except _NotBare:
                return Event.from_record(record)
            return _bare(cls, record)
        return Event.from_record(record)


_SCALARS = (str, int, float, bool, datetime, type(None))
_plans: dict[type, "tuple[int, tuple[tuple[str, type | None, bool], ...]] | None"] = {}


_field_counts: dict[type, int] = {}


class _NotBare(Exception):
    """A nested record whose field count is not its model's: validate the whole event instead."""


def _bare(cls: type[BaseModel], values: dict) -> BaseModel:
    """An instance of `cls` around `values` (which it then owns), without validation."""
    count = _field_counts.get(cls)
    if count is None:  # `model_fields` is a property in pydantic 2.10+ (~1 µs a call): counted once per class
        count = _field_counts[cls] = len(cls.model_fields)
    if type(values) is not dict or len(values) != count:
        raise _NotBare(cls.__name__)
    instance = cls.__new__(cls)
    object.__setattr__(instance, "__dict__", values)
    object.__setattr__(instance, "__pydantic_fields_set__", set(values))
    object.__setattr__(instance, "__pydantic_extra__", None)
    object.__setattr__(instance, "__pydantic_private__", None)
    return instance


def _members(annotation: Any) -> tuple:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def _plain_class(cls: type[BaseModel]) -> bool:
    decorators = cls.__pydantic_decorators__
    return not (decorators.validators or decorators.field_validators or decorators.model_validators
                or decorators.root_validators or cls.__private_attributes__)


def _scalar_only(cls: Any) -> bool:
    """A model class with no validators whose fields are all (optional) plain scalars."""
    return isinstance(cls, type) and issubclass(cls, BaseModel) and _plain_class(cls) and all(
        all(member in _SCALARS for member in _members(field.annotation)) and not field.metadata
        for field in cls.model_fields.values())


def _plan(cls: type[Event]) -> "tuple[int, tuple[tuple[str, type | None, bool], ...]] | None":
    """How `from_decoded` builds `cls` without validation: (field count, nested fields as (name,
    model or None for a list of scalars, is a list)); None when it cannot (a map, bytes, a validator,
    a nested model with non-scalar fields)."""
    if cls in _plans:
        return _plans[cls]
    plan: "tuple[int, tuple[tuple[str, type | None, bool], ...]] | None" = None
    if _plain_class(cls):
        nested = []
        for name, field in cls.model_fields.items():
            members = _members(field.annotation)
            if field.metadata:
                break
            if all(member in _SCALARS for member in members):
                continue
            if len(members) == 1 and _scalar_only(members[0]):
                nested.append((name, members[0], False))
            elif len(members) == 2 and type(None) in members and _scalar_only(
                    next(member for member in members if member is not type(None))):
                nested.append((name, next(member for member in members if member is not type(None)), False))
            elif len(members) == 1 and typing.get_origin(members[0]) is list and _scalar_only(
                    typing.get_args(members[0])[0]):
                nested.append((name, typing.get_args(members[0])[0], True))
            elif len(members) == 1 and typing.get_origin(members[0]) is list and \
                    typing.get_args(members[0])[0] in (str, int, float, bool):
                continue  # a list of scalars: the Avro array is already that list
            else:
                break
        else:
            plan = (len(cls.model_fields), tuple(nested))
    _plans[cls] = plan
    return plan


class UploadCompleted(Event):
    upload_id: str
    bucket: str
    object_key: str
    size_bytes: int
    sha256: str
    filename: str
    priority: str
    profile: str = "default"
    submitter: str = "anonymous"


class JobAccepted(Event):
    upload_id: str
    source_key: str
    source_sha256: str
    source_size_bytes: int
    priority: str
    profile: str
    media: SourceMedia
    ladder: list[Rendition]
    profile_fingerprint: str | None = None
    degraded: bool = False
    degraded_reason: str | None = None
    x264_preset: str | None = None
    pipeline: str | None = None
    pipeline_stages: list[str] = Field(default_factory=list)


class JobRejected(Event):
    upload_id: str
    error_class: str
    reason: str


class StageSkipped(Event):
    """An optional stage (the envelope's `stage`, attempt 0) was not run for the job, and why."""

    reason: str


class StageQueued(Event):
    tier: str
    work_topic: str


class AttemptStarted(Event):
    lease_s: float
    worker: str
    work_topic: str
    work_partition: int
    work_offset: int


class Heartbeat(Event):
    sequence: int
    frames_done: int
    frames_total: int | None = None
    out_time_s: float
    speed: float | None = None
    progress_grace_s: float | None = None
    """Seconds added to the no-progress timeout while ffmpeg decodes silently up to a resume point."""
    tool_state: ToolState | None = None
    """The tool's process as the worker saw it at this heartbeat (None: no tool running, or an older worker)."""


class CheckpointRecorded(Event):
    sequence: int
    segment_index: int
    rendition: str
    object_key: str
    sha256: str
    frames: int
    media_start_s: float
    media_duration_s: float


class AttemptSucceeded(Event):
    outputs: list[OutputFile]
    renditions: list[Rendition]
    audio_playlist_key: str | None = None
    media_duration_s: float | None = None
    elapsed_s: float


class ObjectFound(_Frozen):
    """An object found in the way of a write (class `output_conflict`): its key, the hex sha256 of
    its stored bytes, its size in bytes and when the store says it was written (UTC; None: it did
    not say)."""

    key: str
    sha256: str
    size_bytes: int
    written_at: datetime | None = None


class AttemptFailed(Event):
    """`retryable` is the error class's (`domain/error_classes.py`); `in_the_way`: the object an
    `output_conflict` met (None otherwise)."""

    error_class: str
    retryable: bool
    reason: str
    in_the_way: ObjectFound | None = None


class AttemptYielded(Event):
    reason: str
    resume_from_segment: int | None = None


class StallDetected(Event):
    kind: str
    stalled_attempt: int
    last_progress_at: datetime | None = None
    since_s: float
    detail: str = ""
    tool_state: ToolState | None = None
    """A no_progress stall: the stalled attempt's last heartbeat's `tool_state` (None: none was seen)."""


class RetryScheduled(Event):
    next_attempt: int
    not_before: datetime
    error_class: str


class JobFailed(Event):
    """Terminal, not retryable. From `tapeline dlq fail`: `operator`, the `dead_letter_id` and whether
    the submitter's quota is credited back (`refunded`)."""

    error_class: str
    reason: str
    operator: str | None = None
    dead_letter_id: str | None = None
    refunded: bool = False


class JobDeadLettered(Event):
    """`in_the_way`: the object an `output_conflict` met (None for any other class)."""

    error_class: str
    reason: str
    attempts: int
    evidence: str
    in_the_way: ObjectFound | None = None


class JobReplayed(Event):
    """An operator reopened a dead-lettered or needs-review job. Always committed in one transaction
    with the events it causes (their `causation_id` is its event id): the next `StageQueued`, or
    `Published` + `JobCompleted` (a review resolved as posted), or the `JobFailed` of `dlq fail`.
    The notifier relies on it (`notify_new_deliveries`)."""

    operator: str
    reason: str
    dead_letter_id: str | None = None


class PublishIntended(Event):
    provider: str
    idempotency_key: str


class Published(Event):
    provider: str
    provider_ref: str
    master_key: str
    master_url: str
    renditions: list[Rendition]


class PublishDeferred(Event):
    """The provider was not called (quota, breaker cooldown, probe in flight, in-flight slots); the
    attempt is retried at `until` and does not use up an attempt (see processors/provider_guard.py)."""

    provider: str
    wait: str
    until: datetime
    window: str | None = None
    window_s: float | None = None
    limit: int | None = None
    used: int | None = None
    detail: str = ""


class ProviderBreakerChanged(Event):
    """A provider's circuit breaker changed state (domain/policy/breaker.py); `version` orders changes."""

    provider: str
    from_state: str
    to_state: str
    until: datetime | None = None
    reason: str
    http_status: int | None = None
    failures: int
    version: int


class NeedsReview(Event):
    reason: str


class JobCompleted(Event):
    master_url: str
    media_duration_s: float | None = None


class ResultReused(Event):
    """Intake reused the published outputs of `reused_job_id` (same source sha256 and output profile,
    every object verified to exist): the job completes without a transcode attempt."""

    reused_job_id: str
    profile_fingerprint: str
    master_key: str
    master_url: str
    renditions: list[Rendition]
    outputs: list[OutputFile]
    media_duration_s: float | None = None


class JobCancelled(Event):
    operator: str
    reason: str


class OutputsWithdrawn(Event):
    """The job's published outputs were deleted from the bucket because the job ended otherwise than
    completed while, or after, a publish made them public (a cancel or a fail that raced it;
    domain/policy/withdrawal.py). `keys`: the objects removed under `published/{job}/`;
    `public_since`: when the first of them was written (the store's time, UTC); `withdrawn_by`: who
    removed them (`operator cancel`, `operator fail`, `publish attempt N`); `reason`: the ending."""

    keys: list[str]
    public_since: datetime | None = None
    withdrawn_by: str
    reason: str


class RegionFailedOver(Event):
    """`tapeline region failover`: `to_region` holds the job history from region epoch `epoch` on;
    `from_region` is fenced. On `<prefix>.regions` (never the lifecycle topic); envelope job_id and
    stage `region`, attempt = epoch (docs/regions.md "Failover")."""

    from_region: str
    to_region: str
    epoch: int
    reason: str
    operator: str
    planned: bool


class JobDelayed(Event):
    """A job in flight when its region was left: the failover tells its submitter once (`job.delayed`)
    from the region now serving it. Written by `regions/failover.py` for each job accepted, queued,
    running or waiting for a retry in the target's projection (`domain/regions.py` `delayed_event`);
    stage `region`, attempt = the failover's epoch (one dedup key per job and failover); changes no state."""

    reason: str
    serving_region: str
    from_region: str
    epoch: int
    state: str


class WatchdogTick(Event):
    partition: int
    sequence: int


class WorkItem(Event):
    """A unit of stage work on `<prefix>.work.<stage>.<tier>`; `attempt` is the attempt it starts."""

    tier: str
    source_key: str
    inputs: list[OutputFile]
    renditions: list[Rendition]
    audio_playlist_key: str | None = None
    media_duration_s: float | None = None
    checkpoint_refs: list[str] = Field(default_factory=list)
    x264_preset: str | None = None
    degraded: bool = False
    pipeline_stages: list[str] = Field(default_factory=list)


class DeadLetter(Event):
    """A record that could not be processed, kept raw with where it came from and why."""

    source_topic: str
    source_partition: int
    source_offset: int
    key: bytes | None = None
    value: bytes | None = None
    headers: dict[str, bytes] = Field(default_factory=dict)
    error_class: str
    error: str
    processor: str



class DeadLetterDismissed(Event):
    """An operator closed a dead letter that has nothing to replay or fail: an undecodable record
    (`DeadLetter`, kind record or projection) whose producer was fixed or whose bytes were inspected.
    On the dead-letter topic, like the `DeadLetter` it closes; its envelope job id is the dead
    letter's id (the record's source position), stage "operator", attempt 0. The dead letter stays
    (its raw record and position), marked dismissed, and no longer counts as pending (nor in the
    dead-letter alert). Issue 44 item 6."""

    dead_letter_id: str
    operator: str
    reason: str


class NotificationIntended(Event):
    """The notifier will notify endpoint `endpoint_id` of one lifecycle event of the job
    (processors/notify.py); `delivery_id` is the `webhook-id` of every POST of it."""

    delivery_id: str
    endpoint_id: str
    notification_type: str
    source_event_id: str
    source_dedup_key: str
    notifier_token: str


class NotificationDelivered(Event):
    """The endpoint answered 2xx to try `try_number` of the delivery: it is never sent again."""

    delivery_id: str
    endpoint_id: str
    try_number: int
    http_status: int
    elapsed_s: float
    notifier_token: str


class NotificationFailed(Event):
    """Try `try_number` of the delivery failed; the next is due at `retry_at` (None: dead-lettered)."""

    delivery_id: str
    endpoint_id: str
    try_number: int
    http_status: int | None = None
    reason: str
    retry_at: datetime | None = None
    notifier_token: str


class NotificationDeadLettered(Event):
    """The delivery's retries are spent: it is not sent again."""

    delivery_id: str
    endpoint_id: str
    tries: int
    reason: str
    notifier_token: str


class WebhookEndpointDisabled(Event):
    """An endpoint failing without a success since `failing_since` for too long was disabled."""

    endpoint_id: str
    submitter: str
    failing_since: datetime
    reason: str
    notifier_token: str


"""The intake decision: what one `UploadCompleted` becomes, as pure functions.

- `preflight(upload, settings)`: what is wrong with an upload judged by its event alone (before
  any download), or None;
- `decide(existing, upload, probe, profile, reusable, settings, recorded_by, stamp)`: the events
  of one upload, `JobAccepted` + `StageQueued` + the transcode `WorkItem`, or `JobRejected`, or
  (a reusable result) `JobAccepted` + `ResultReused` + `JobCompleted`.

The I/O side (reading the upload, the caught-up projection, the quota count, the download and
probe, the profile and reuse look-up, the transaction) is `processors/intake.py`
`IntakeProcessor`; its `decide` calls this one with the system clock and the full profile by
default.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from domain import events as ev
from domain import pipeline
from domain.errors import InvalidInput, LimitsExceeded, MediaError, TapelineError
from domain.policy.tiers import TIERS

Outgoing = tuple[str, ev.Event]
"""(topic, event): one record a decision wants produced."""


class IntakeSettings(Protocol):
    """The settings the intake decision reads (`tapeline.settings.Settings` has them):
    `max_upload_bytes` (bytes), the bucket sources are taken from, the lifecycle topic and the
    work topic of a stage and tier."""

    max_upload_bytes: int
    s3_bucket: str

    @property
    def jobs_topic(self) -> str: ...

    def work_topic(self, stage: str, tier: str) -> str: ...


class Profile(Protocol):
    """A job's output profile (`processors/reuse.py` `OutputProfile`): the ladder (largest first),
    the x264 preset, the fingerprint (64 hex chars), whether it is degraded and why."""

    ladder: Sequence[ev.Rendition]
    x264_preset: str
    fingerprint: str
    degraded: bool
    reason: str | None


class Reusable(Protocol):
    """A completed job's published result that may be reused (`processors/reuse.py` `Reusable`):
    the origin job, the fingerprint it matched, its master playlist key and URL, renditions,
    published objects and media duration (s, None when unknown)."""

    origin_job_id: str
    fingerprint: str
    master_key: str
    master_url: str
    renditions: list[ev.Rendition]
    outputs: list[ev.OutputFile]
    media_duration_s: float | None


def upload_prefix(upload_id: str) -> str:
    """`uploads/{upload_id}/`: where an upload's source objects live (`tapeline submit` puts the
    file right under it, the HTTP intake under a claim's folder in it). Pure."""
    return f"uploads/{upload_id}/"


def source_outside_upload(upload_id: str, object_key: str) -> bool:
    """True unless `object_key` names an object under `upload_prefix(upload_id)`: an upload id
    with no `/`, and a key whose every segment after the prefix is a name (no empty, `.` or `..`
    segment that a store might collapse into another folder). Pure."""
    prefix = upload_prefix(upload_id)
    if not upload_id or "/" in upload_id or upload_id in (".", "..") or not object_key.startswith(prefix):
        return True
    return any(part in ("", ".", "..") for part in object_key[len(prefix):].split("/"))


def preflight(upload: ev.UploadCompleted, settings: IntakeSettings) -> MediaError | None:
    """What is wrong with an upload judged by its event alone (before any download), or None. Pure.

    Unknown priority tier or an empty upload -> `InvalidInput`; larger than `max_upload_bytes` ->
    `LimitsExceeded` naming the limit. A source outside the configured bucket (`s3_bucket`) or
    outside the upload's own prefix (`source_outside_upload`) -> `InvalidInput`: an event's pointer
    is not trusted (issue 44 item 5: a forged `UploadCompleted` named an unpublished `work/`
    segment of another job, which was then transcoded and published).
    """
    if upload.bucket != settings.s3_bucket:
        return InvalidInput(f"the upload names bucket {upload.bucket!r}; sources are taken only from "
                            f"{settings.s3_bucket!r}")
    if source_outside_upload(upload.upload_id, upload.object_key):
        return InvalidInput(f"source object {upload.object_key!r} is not under the upload's own prefix "
                            f"{upload_prefix(upload.upload_id)!r}")
    if upload.priority not in TIERS:
        return InvalidInput(f"unknown priority tier {upload.priority!r}")
    if upload.size_bytes <= 0:
        return InvalidInput(f"the upload declares {upload.size_bytes} bytes; a source has at least one")
    if upload.size_bytes > settings.max_upload_bytes:
        return LimitsExceeded(f"file size {upload.size_bytes} bytes exceeds the limit "
                              f"max_upload_bytes = {settings.max_upload_bytes}")
    return None


def decide(existing: dict[str, Any] | None, upload: ev.UploadCompleted, probe: ev.SourceMedia | TapelineError,
           profile: Profile | None, reusable: Reusable | None, settings: IntakeSettings, recorded_by: str,
           stamp: Callable[[], ev.Stamp]) -> list[Outgoing]:
    """The intake decision for one upload. Pure: `stamp` gives each event its time and id, in order
    (the writer's clock, `tapeline.clock.system_clock.stamp` in production).

    - the job already exists (`existing`, its `job_state` row: a duplicate upload event): nothing;
    - the probe failed, or the submitter's quota is used up (`probe` is then the `TapelineError`):
      `JobRejected` with the error's class and message;
    - a `reusable` result (same source sha256 and profile fingerprint, outputs verified to exist):
      `JobAccepted` + `ResultReused` + `JobCompleted` pointing at that job's published outputs, with
      no transcode attempt; only for a job of the `default` pipeline (an `archive` job preserves its
      own source, so it runs every stage of its profile);
    - otherwise `JobAccepted` (with the probe, the ladder and preset of `profile`, its fingerprint,
      whether it is degraded, and its pipeline: `pipeline.profile_for_tier`), `StageQueued` and the
      `WorkItem` of the pipeline's first stage for attempt 1 on the upload's priority tier.

    `profile` may be None only when the answer needs none (an existing job or a failed probe);
    otherwise it raises `ValueError`.
    """
    if existing is not None:
        return []
    common = dict(job_id=upload.job_id, recorded_by=recorded_by, correlation_id=upload.upload_id,
                  causation_id=upload.event_id)
    jobs = settings.jobs_topic
    if isinstance(probe, TapelineError):
        return [(jobs, ev.JobRejected.new(stamp(), stage="intake", attempt=0, upload_id=upload.upload_id,
                                          error_class=probe.error_class, reason=str(probe), **common))]
    if profile is None:
        raise ValueError("an accepted upload needs its output profile")
    ladder = list(profile.ladder)
    pipeline_name = pipeline.profile_for_tier(upload.priority)
    stages = list(pipeline.profile_stages(pipeline_name))
    first = stages[0]
    work_topic = settings.work_topic(first, upload.priority)
    accepted = ev.JobAccepted.new(stamp(), stage="intake", attempt=0, upload_id=upload.upload_id,
                                  source_key=upload.object_key, source_sha256=upload.sha256,
                                  source_size_bytes=upload.size_bytes, priority=upload.priority,
                                  profile=upload.profile, media=probe, ladder=ladder,
                                  profile_fingerprint=profile.fingerprint, degraded=profile.degraded,
                                  degraded_reason=profile.reason, x264_preset=profile.x264_preset,
                                  pipeline=pipeline_name, pipeline_stages=stages, **common)
    if reusable is not None and pipeline_name == pipeline.DEFAULT_PROFILE:
        duration = reusable.media_duration_s if reusable.media_duration_s is not None else probe.duration_s
        return [
            (jobs, accepted),
            (jobs, ev.ResultReused.new(stamp(), stage="intake", attempt=0, reused_job_id=reusable.origin_job_id,
                                       profile_fingerprint=reusable.fingerprint, master_key=reusable.master_key,
                                       master_url=reusable.master_url, renditions=reusable.renditions,
                                       outputs=reusable.outputs, media_duration_s=duration, **common)),
            (jobs, ev.JobCompleted.new(stamp(), stage="intake", attempt=0, master_url=reusable.master_url,
                                       media_duration_s=duration, **common)),
        ]
    return [
        (jobs, accepted),
        (jobs, ev.StageQueued.new(stamp(), stage=first, attempt=1, tier=upload.priority,
                                  work_topic=work_topic, **common)),
        (work_topic, ev.WorkItem.new(stamp(), stage=first, attempt=1, tier=upload.priority,
                                     source_key=upload.object_key, inputs=[], renditions=ladder,
                                     media_duration_s=probe.duration_s, x264_preset=profile.x264_preset,
                                     degraded=profile.degraded, pipeline_stages=stages, **common)),
    ]

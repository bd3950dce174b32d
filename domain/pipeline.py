"""The stage registry and the pipeline profiles: a pipeline is data.

A stage is declared once here, as a `StageSpec` (its name, the module and class of its worker, what
its work item must carry, whether it may be skipped, its default lease and no-progress timeout, the
crash points of its own side effects). A pipeline profile names stages in order. Everything else
derives from this one registry: the work topics (`tapeline.settings.Settings.all_topics`), the roles
of `tapeline run` and their health ports (`cli/run_command.py`, `cli/supervisor.py`), the
crash-point list (`tapeline/crashpoints.py`), the next stage after a success
(`processors.worker.StageWorker.hand_on`), the work item the watchdog rebuilds
(`processors/watchdog.py`), the display order (`projections/read_model.py`), and the fold's stage order for
a job (`stage_position`, mirrored in `native/src/lib.rs`).

`JobAccepted` records the profile's name (`pipeline`) and its stages (`pipeline_stages`), so a job
folds with the pipeline it ran with; events written before profiles existed carry neither and fold
with `LEGACY_STAGES` (transcode -> publish), exactly as before. Pure; standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from domain.lifecycle_data import LIFECYCLE

INTAKE = "intake"
"""The one step before every pipeline: it has no work topic and is always position 0."""

INTAKE_ABOUT = ("probes the upload, checks the submitter's quota, picks the profile and the ladder, and accepts "
                "or rejects the job (or reuses an earlier job's outputs)")
"""What intake does, in an operator's words (the glossary's `intake`)."""


@dataclass(frozen=True)
class StageSpec:
    """One stage's declaration.

    `name`: the stage (work topics `<prefix>.work.<name>.<tier>`, role `tapeline run --role <name>`);
    `worker`: `"module:Class"` of its `processors.worker.StageWorker` subclass (imported only by
    `cli.wiring`); `needs`: the `WorkItem` fields beyond the job's identity its work reads,
    which the watchdog fills in when it rebuilds a work item from the job's row (`inputs`: the
    outputs earlier stages recorded; `audio_playlist_key`; `x264_preset`); `optional`: under the
    degradation ladder (a degraded job) the stage is skipped with a `StageSkipped` event;
    `lease_s`: its attempts' lease in seconds (None: the `lease_s` setting; the heartbeat interval
    stays the global setting, so a stage's lease should not be shorter);
    `no_progress_s`: seconds its progress counters may stand still before the watchdog calls an
    attempt stalled (`no_progress`; None: the `no_progress_timeout_s` setting; `no_progress_timeout`);
    `side_effect_points`: the crash points its own code marks, in order, as
    `(after_event, name)`: each is listed after the generic point `<stage>.<after_event>.after_commit`
    (or after the claim for `after_event` "claim"), so the crash-point list keeps pipeline order;
    `uses_media_tool`: the worker takes the ffmpeg tool; `checkpoints`: its work records
    `CheckpointRecorded` events (crash points `<stage>.CheckpointRecorded.*`); `heartbeats`: it
    heartbeats with progress of its own while it works (crash points `<stage>.Heartbeat.*` join the
    list; False for a stage whose only heartbeats are `Attempt.keepalive`'s during a copy, archive: a
    short job ends before the first one, and those transactions are the same code as every stage's); `share`: its weight in a job's
    0-100 progress (`projections.presenter.percent_done`); `final`: the stage that ends a job
    (`JobCompleted`, publish): its outputs are not carried to the job's row; `about`: what it does,
    in an operator's words (the glossary's line for the stage, `projections/glossary.py`).
    """

    name: str
    worker: str
    needs: frozenset[str] = frozenset()
    optional: bool = False
    lease_s: float | None = None
    no_progress_s: float | None = None
    side_effect_points: tuple[tuple[str, str], ...] = ()
    uses_media_tool: bool = False
    checkpoints: bool = False
    heartbeats: bool = True
    share: float = 1.0
    final: bool = False
    about: str = ""


STAGES: tuple[StageSpec, ...] = (
    StageSpec("archive", "processors.archive:ArchiveWorker", heartbeats=False, share=0.05,
              about="keeps the source for good under archive/{job}/ with a sha256 manifest (jobs of the archive "
                    "tier)",
              side_effect_points=(("claim", "archive.before_put"), ("claim", "archive.after_put"),
                                  ("claim", "archive.after_manifest"))),
    StageSpec("transcode", "processors.transcode:TranscodeWorker", needs=frozenset({"x264_preset"}),
              uses_media_tool=True, checkpoints=True, share=0.85,
              about="encodes the ladder's renditions with ffmpeg in checkpointed segments; a retry resumes after "
                    "the last checkpoint"),
    StageSpec("thumbnails", "processors.thumbnails:ThumbnailsWorker", needs=frozenset({"inputs"}), optional=True,
              uses_media_tool=True, share=0.05,
              about="makes the poster, the storyboard sprite and the WebVTT thumbnails track; skipped for a "
                    "degraded job",
              side_effect_points=(("Heartbeat", "thumbnails.before_upload"), ("Heartbeat", "thumbnails.after_upload"))),
    StageSpec("publish", "processors.publish:PublishWorker", needs=frozenset({"inputs", "audio_playlist_key"}),
              final=True, share=0.1,
              about="promotes the outputs to published/{job}/ with conditional puts, writes the master playlist "
                    "and announces to the provider; ends the job",
              side_effect_points=(("PublishIntended", "publish.before_promote"), ("PublishIntended", "publish.after_promote"),
                                  ("PublishIntended", "publish.before_marker"), ("PublishIntended", "publish.after_marker"),
                                  ("Heartbeat", "publish.before_provider_call"),
                                  ("Heartbeat", "publish.after_provider_call"))),
)
"""Every stage, in the one order any profile may use them (a profile is a subsequence of it)."""

PROFILES: dict[str, tuple[str, ...]] = {
    "default": ("transcode", "thumbnails", "publish"),
    "archive": ("archive", "transcode", "thumbnails", "publish"),
}
"""Pipeline profile -> its stages in order (intake precedes each)."""

DEFAULT_PROFILE = "default"
LEGACY_STAGES: tuple[str, ...] = tuple(s for s in LIFECYCLE.stage_order if s != INTAKE)
"""The pipeline of a job accepted before profiles existed (its `JobAccepted` has no `pipeline_stages`):
transcode, publish (`stage_order` of `schemas/lifecycle.json`, which both fold engines fall back to)."""

BY_NAME: dict[str, StageSpec] = {spec.name: spec for spec in STAGES}
STAGE_NAMES: tuple[str, ...] = tuple(BY_NAME)


class UnknownStage(KeyError):
    """A stage or profile name the registry does not hold."""


def spec(stage: str) -> StageSpec:
    """The declaration of `stage`. Raises `UnknownStage`."""
    try:
        return BY_NAME[stage]
    except KeyError:
        raise UnknownStage(stage) from None


def profile_stages(profile: str) -> tuple[str, ...]:
    """The stages of pipeline profile `profile`, in order. Raises `UnknownStage` for an unknown profile."""
    try:
        return PROFILES[profile]
    except KeyError:
        raise UnknownStage(profile) from None


def profile_for_tier(tier: str) -> str:
    """The profile a job of priority tier `tier` runs: `tier` when a profile of that name exists
    (the `archive` tier's jobs run the `archive` profile once it is registered), else `default`."""
    return tier if tier in PROFILES else DEFAULT_PROFILE


def profiled_stages() -> tuple[str, ...]:
    """Every stage some profile runs, in registry order (`STAGES`)."""
    used = {stage for stages in PROFILES.values() for stage in stages}
    return tuple(s.name for s in STAGES if s.name in used)


def profile_running(stage: str) -> str:
    """The first profile (default first) whose stages include `stage`. Raises `UnknownStage`."""
    for name in (DEFAULT_PROFILE, *PROFILES):
        if stage in PROFILES[name]:
            return name
    raise UnknownStage(stage)


def lease(stage: str | None, default_s: float) -> float:
    """Seconds of an attempt's lease for `stage`: its declaration's `lease_s`, else `default_s` (the
    `lease_s` setting); `default_s` for an unknown stage."""
    declared = BY_NAME.get(stage) if stage is not None else None
    return declared.lease_s if declared is not None and declared.lease_s is not None else default_s


def no_progress_timeout(stage: str | None, default_s: float) -> float:
    """Seconds of frozen progress counters after which an attempt of `stage` is stalled: its
    declaration's `no_progress_s`, else `default_s` (the setting); `default_s` for an unknown stage."""
    declared = BY_NAME.get(stage) if stage is not None else None
    return declared.no_progress_s if declared is not None and declared.no_progress_s is not None else default_s


def declared_no_progress() -> dict[str, float]:
    """Stage -> its declared no-progress timeout in seconds, for the stages that declare one (the
    watchdog writes them to the `stage_stall_policy` table so the `stalled_attempts` view agrees)."""
    return {s.name: s.no_progress_s for s in STAGES if s.no_progress_s is not None}


def job_stages(recorded: Sequence[str] | None) -> tuple[str, ...]:
    """A job's stages: those its `JobAccepted` recorded, or `LEGACY_STAGES` for an older job."""
    return tuple(recorded) if recorded else LEGACY_STAGES


def stage_position(stage: str | None, recorded: Sequence[str] | None) -> int:
    """Where `stage` comes in a job's pipeline: intake 0, the job's stages 1.. in order. For a job
    without recorded stages, or a stage not in them, its place in `intake` + `LEGACY_STAGES`; an
    unknown stage counts as 0 (as `lifecycle.STAGE_ORDER.get(stage, 0)` always did). The fold's
    order of attempts (`domain/lifecycle.py`; `stage_position` in native/src/lib.rs is the same)."""
    if recorded and stage in recorded:
        return list(recorded).index(stage) + 1
    return LIFECYCLE.stage_order.get(stage, 0) if stage is not None else 0


def next_stage(stages: Sequence[str], current: str) -> str | None:
    """The stage after `current` in `stages` (None after the last, or for a stage not in them)."""
    stages = list(stages)
    if current == INTAKE:
        return stages[0] if stages else None
    if current not in stages:
        return None
    i = stages.index(current)
    return stages[i + 1] if i + 1 < len(stages) else None


def following_stage(stages: Sequence[str], current: str, degraded: bool) -> tuple[str | None, list[str]]:
    """The stage to queue after `current` succeeds, and the optional stages skipped on the way (a
    degraded job skips every optional stage). Pure. Returns (next stage or None, skipped stages)."""
    skipped: list[str] = []
    nxt = next_stage(stages, current)
    while nxt is not None and degraded and spec(nxt).optional:
        skipped.append(nxt)
        nxt = next_stage(stages, nxt)
    return nxt, skipped


def stage_crash_points(stage: str) -> tuple[str, ...]:
    """Every crash point one attempt of `stage` passes through, in order: the claim's, the side
    effects declared after the claim, then for each event kind it records (checkpoints, heartbeats,
    what its declaration names, completion) its produce/commit points and the side effects declared
    after it."""
    s = spec(stage)
    points = [f"{stage}.claim.after_produce", f"{stage}.claim.after_send_offsets", f"{stage}.claim.after_commit"]
    points += [p for after, p in s.side_effect_points if after == "claim"]
    kinds = [after for after, _ in s.side_effect_points if after != "claim"]
    kinds = list(dict.fromkeys(kinds + (["Heartbeat"] if s.heartbeats else [])
                               + (["CheckpointRecorded"] if s.checkpoints else [])))
    for kind in kinds:
        if kind == "CheckpointRecorded":
            points.append(f"{stage}.CheckpointRecorded.before_produce")
        points += [f"{stage}.{kind}.after_produce", f"{stage}.{kind}.after_commit"]
        points += [p for after, p in s.side_effect_points if after == kind]
    if not s.final:
        points.append(f"{stage}.AttemptSucceeded.before_produce")
    points += [f"{stage}.AttemptSucceeded.after_produce", f"{stage}.AttemptSucceeded.after_commit"]
    return tuple(points)

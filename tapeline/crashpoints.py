"""Named crash and failure points at side-effect boundaries, for fault-injection tests only.

`crash_point("intake.after_send_offsets")` kills the process with SIGKILL when that name is listed
in `TAPELINE_CRASH_POINTS` (comma-separated) or in the file `TAPELINE_CRASH_POINTS_FILE` names. With `TAPELINE_CRASH_ONCE_DIR` set, each point fires
once: a marker file `<dir>/<name>` is created just before the kill, so a supervised restart passes
the point. Without the variable nothing happens (one dictionary lookup).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from domain import pipeline
from domain.errors import TapelineError

PIPELINE_CRASH_POINTS: tuple[str, ...] = (
    # intake: UploadCompleted -> JobAccepted + StageQueued + WorkItem, with the upload's offset
    "intake.before_produce", "intake.after_produce", "intake.after_send_offsets", "intake.after_commit",
    # every stage a profile runs, in registry order (archive, transcode, thumbnails, publish): claim
    # (AttemptStarted + the work item's offset), heartbeats, checkpoints, its declared side effects,
    # completion (domain/pipeline.py stage_crash_points)
    *(point for stage in pipeline.profiled_stages() for point in pipeline.stage_crash_points(stage)),
    # projector: the PostgreSQL transaction of a batch (rows + offsets)
    "projector.before_commit", "projector.after_commit",
    # watchdog: ticks and its decisions
    "watchdog.tick.after_produce", "watchdog.tick.after_commit",
)
"""Every crash point a job passes through with a webhook provider configured, in pipeline order (a
stage outside the default profile, archive, is passed by a job of a profile that runs it:
`tests/faults/test_crash_points.py` kills the pipeline at each in turn)."""

def tier_for_point(point: str) -> str:
    """The priority tier of a job that passes `point`: `standard` (the default profile) unless the
    point's stage runs only in another profile (archive), then the tier of that profile's name
    (`pipeline.profile_for_tier` maps a tier to the profile of its name)."""
    stage = point.partition(".")[0]
    if stage not in pipeline.BY_NAME or stage in pipeline.profile_stages(pipeline.DEFAULT_PROFILE):
        return "standard"
    return pipeline.profile_running(stage)


def crash_point_rounds(points: tuple[str, ...] = PIPELINE_CRASH_POINTS) -> list[tuple[tuple[str, ...], str]]:
    """`points` in rounds that one job can pass: at most one point per process (the point's first
    part: `intake`, a stage, `projector`, `watchdog`), taken in order, so each round kills each
    process at most once; with the tier of the round's job (`tier_for_point`: a round with an
    `archive` point runs a job of that profile, which passes every stage of the default one too).

    Returns `[(points, tier), ...]`, every point exactly once; raises `ValueError` when a round would
    need two profiles (two points whose stages no one profile runs).
    """
    queues: dict[str, list[str]] = {}
    for point in points:
        queues.setdefault(point.partition(".")[0], []).append(point)
    rounds: list[tuple[tuple[str, ...], str]] = []
    while any(queues.values()):
        taken = tuple(queue.pop(0) for queue in queues.values() if queue)
        tiers = {tier_for_point(point) for point in taken} - {"standard"}
        if len(tiers) > 1:
            raise ValueError(f"no one job passes {taken}: tiers {sorted(tiers)}")
        tier = tiers.pop() if tiers else "standard"
        profile = pipeline.profile_for_tier(tier)
        off_path = [p for p in taken if p.partition(".")[0] in pipeline.BY_NAME
                    and p.partition(".")[0] not in pipeline.profile_stages(profile)]
        if off_path:
            raise ValueError(f"a job of tier {tier} never passes {off_path}")
        rounds.append((taken, tier))
    return rounds


NOTIFY_CRASH_POINTS: tuple[str, ...] = (
    # the notifier (processors/notify.py): NotificationIntended, the POST, its record
    "notify.intended.before_produce", "notify.intended.after_produce", "notify.intended.after_commit",
    "notify.before_post", "notify.after_post",  # after_post: the receiver answered, nothing recorded yet
    "notify.delivered.before_produce", "notify.delivered.after_produce", "notify.delivered.after_commit",
    # a POST the receiver answered 500: its NotificationFailed (with the retry time), then the retry
    "notify.failed.before_produce", "notify.failed.after_produce", "notify.failed.after_commit",
)
"""Every crash point one customer notification passes through, in order (`tests/faults/test_notify_crashes.py`
kills the notifier at each in turn; at the `notify.failed.*` points the receiver answers the first POST
500)."""


_file_cache: tuple[float, frozenset[str]] = (-1.0, frozenset())


def enabled_crash_points() -> frozenset[str]:
    """The crash points enabled now: `TAPELINE_CRASH_POINTS` plus the lines of the file named by
    `TAPELINE_CRASH_POINTS_FILE` (re-read when its mtime changes, so a test can move the crash
    point of a running pipeline without restarting it)."""
    global _file_cache
    names = set(filter(None, os.environ.get("TAPELINE_CRASH_POINTS", "").split(",")))
    path = os.environ.get("TAPELINE_CRASH_POINTS_FILE")
    if path:
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            mtime = -1.0
        if mtime != _file_cache[0]:
            try:
                lines = Path(path).read_text().split()
            except OSError:
                lines = []
            _file_cache = (mtime, frozenset(lines))
        names |= _file_cache[1]
    return frozenset(names)


def crash_point(name: str) -> None:
    """SIGKILL this process if `name` is an enabled crash point (see module docstring)."""
    if not os.environ.get("TAPELINE_CRASH_POINTS") and not os.environ.get("TAPELINE_CRASH_POINTS_FILE"):
        return
    if name not in enabled_crash_points():
        return
    once_dir = os.environ.get("TAPELINE_CRASH_ONCE_DIR")
    if once_dir:
        marker = Path(once_dir) / name
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


class InjectedFault(TapelineError):
    """A failure injected by `TAPELINE_FAIL_POINTS` (tests only)."""


def fail_point(name: str) -> None:
    """Raise `InjectedFault` classified as the class named in `TAPELINE_FAIL_POINTS`.

    The variable lists `name:error_class` pairs, comma-separated (for example
    `transcode.download:storage_transient`); with `TAPELINE_CRASH_ONCE_DIR` each fires once.
    """
    enabled = os.environ.get("TAPELINE_FAIL_POINTS")
    if not enabled:
        return
    classes = dict(item.split(":", 1) for item in enabled.split(",") if ":" in item)
    if name not in classes:
        return
    once_dir = os.environ.get("TAPELINE_CRASH_ONCE_DIR")
    if once_dir:
        marker = Path(once_dir) / f"fail-{name}"
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(os.getpid()))
    fault = InjectedFault(f"injected failure at {name}")
    fault.error_class = classes[name]
    raise fault


def delay_point(name: str) -> None:
    """Sleep the seconds `TAPELINE_DELAY_POINTS` gives `name` (`name:seconds` pairs, comma-separated,
    for example `transcode.download:12`): a slow step (a slow store, a slow disk) for fault tests."""
    enabled = os.environ.get("TAPELINE_DELAY_POINTS")
    if not enabled:
        return
    delays = dict(item.split(":", 1) for item in enabled.split(",") if ":" in item)
    if name in delays:
        time.sleep(float(delays[name]))

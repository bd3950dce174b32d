"""Cleanup of the bucket: what the watchdog leader removes, decided by a pure planner.

`plan_cleanup` classifies every listed key (rows and listings in, a plan out); `Watchdog.tick` lists
one page of keys per tick, reads the rows, and performs at most `cleanup_max_deletes` removals.

- `published/...` and `archive/...` are never removed (the planner refuses them whatever the rows say);
- `work/{job}/...` and `markers/{job}/...` of an ended job (completed with its master URL, failed,
  rejected, cancelled: nothing reopens those) are removed `cleanup_retention_s` after it ended;
- a dead_lettered or needs_review job may be replayed: its marker and every key a recorded
  checkpoint or its last completion names are kept, only unreferenced keys older than the retention
  go (no attempt ever reads an object without a record);
- a live job's objects (accepted, queued, running, retry_scheduled) are never touched;
- with `cleanup_orphans`: keys of a job the projection does not know, and sources
  (`uploads/{upload_id}/...`) whose job never appeared, once older than the retention (plus the
  intake timeout for sources). The source of a job that exists is kept (it is the original);
- multipart uploads started longer than `multipart_stale_s` ago are aborted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import Enum
from typing import Any, Iterable

from typing import Protocol

from domain.events import job_id_for
from domain.lifecycle import FINAL_STATES, REOPENABLE_STATES


class CleanupSettings(Protocol):
    """The settings the planner reads (seconds and counts; `tapeline.settings.Settings` has them)."""

    cleanup_retention_s: float
    cleanup_orphans: bool
    cleanup_max_deletes: int
    intake_timeout_s: float
    multipart_stale_s: float
    storage_pressure_retention_s: float

    def model_copy(self, *, update: dict[str, Any]) -> "CleanupSettings": ...
SWEPT_PREFIXES = ("work/", "markers/", "uploads/")  # never "published/" nor "archive/"
NEVER_REMOVED = ("published/", "archive/")
"""Prefixes the planner refuses whatever the rows say: published outputs and archived sources
(processors/archive.py)."""


class Disposition(str, Enum):
    DELETE_ENDED = "delete_ended"              # an ended job's work object or marker, retention passed
    DELETE_UNREFERENCED = "delete_unreferenced"  # a replayable job's object no record names
    DELETE_ORPHAN = "delete_orphan"            # a job the projection does not know
    DELETE_UPLOAD = "delete_upload"            # a source that never became a job
    KEEP_PUBLISHED = "keep_published"
    KEEP_ARCHIVED = "keep_archived"            # an archived source or its manifest: never removed
    KEEP_LIVE = "keep_live"
    KEEP_REFERENCED = "keep_referenced"
    KEEP_RETENTION = "keep_retention"          # ended, or an orphan, but not long enough ago
    KEEP_SOURCE = "keep_source"
    KEEP_UNKNOWN = "keep_unknown"              # not ours to judge (`cleanup_orphans` off, or an unknown prefix)

    @property
    def deletes(self) -> bool:
        return self.value.startswith("delete_")


@dataclass(frozen=True)
class StoredObject:
    key: str
    last_modified: datetime


@dataclass(frozen=True)
class MultipartUpload:
    key: str
    upload_id: str
    initiated: datetime


@dataclass
class CleanupPlan:
    """What to remove this tick: keys (capped), multipart uploads to abort, counts per disposition."""

    delete: list[str] = field(default_factory=list)
    abort: list[MultipartUpload] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {d.value: 0 for d in Disposition})
    deferred: int = 0  # removals decided but left for a later tick (the cap)


def job_ids_of(keys: Iterable[str]) -> set[str]:
    """The job ids the rows of a listing are needed for (an upload's job id is derived, uuid5)."""
    ids = set()
    for key in keys:
        parts = key.split("/")
        if len(parts) >= 3 and parts[0] in ("work", "markers"):
            ids.add(parts[1])
        elif len(parts) >= 3 and parts[0] == "uploads":
            ids.add(job_id_for(parts[1]))
    return ids


def classify(obj: StoredObject, jobs: dict[str, dict[str, Any]], referenced: set[str], now: datetime,
             settings: CleanupSettings) -> Disposition:
    """The disposition of one key. Pure."""
    retention = timedelta(seconds=settings.cleanup_retention_s)
    parts = obj.key.split("/")
    if obj.key.startswith("published/"):
        return Disposition.KEEP_PUBLISHED
    if obj.key.startswith("archive/"):
        return Disposition.KEEP_ARCHIVED
    if len(parts) < 3 or parts[0] not in ("work", "markers", "uploads") or not parts[1]:
        return Disposition.KEEP_UNKNOWN
    old = obj.last_modified + retention <= now
    if parts[0] == "uploads":
        if job_id_for(parts[1]) in jobs:
            return Disposition.KEEP_SOURCE
        if not settings.cleanup_orphans:
            return Disposition.KEEP_UNKNOWN
        intake = timedelta(seconds=settings.intake_timeout_s)
        return Disposition.DELETE_UPLOAD if obj.last_modified + retention + intake <= now else Disposition.KEEP_RETENTION
    job = jobs.get(parts[1])
    if job is None:
        if not settings.cleanup_orphans:
            return Disposition.KEEP_UNKNOWN
        return Disposition.DELETE_ORPHAN if old else Disposition.KEEP_RETENTION
    state = job["state"]
    if state in FINAL_STATES:
        ended_at = job.get("completed_at")
        if state == "completed" and not job.get("master_url"):
            return Disposition.KEEP_LIVE  # completed without its published outputs: not ours to judge
        if ended_at is None or ended_at + retention > now:
            return Disposition.KEEP_RETENTION
        return Disposition.DELETE_ENDED
    if state in REOPENABLE_STATES:
        if parts[0] == "markers":
            return Disposition.KEEP_LIVE  # a replayed publish reconciles against it
        if obj.key in referenced:
            return Disposition.KEEP_REFERENCED
        return Disposition.DELETE_UNREFERENCED if old else Disposition.KEEP_RETENTION
    return Disposition.KEEP_LIVE


def plan_cleanup(objects: Iterable[StoredObject], jobs: dict[str, dict[str, Any]], referenced: set[str],
                 now: datetime, settings: CleanupSettings, multipart: Iterable[MultipartUpload] = ()) -> CleanupPlan:
    """Classify every listed key and every multipart upload; at most `cleanup_max_deletes` removals
    (aborts first), the rest counted as deferred. Pure: rows and listings in, a plan out.

    `jobs`: job_state rows by job id for every id of `job_ids_of(keys)` the projection knows;
    `referenced`: keys named by recorded checkpoints and completions of those jobs; `now`: the log
    clock (the oldest partition's, so every partition has passed it)."""
    plan = CleanupPlan()
    budget = max(0, settings.cleanup_max_deletes)
    stale = timedelta(seconds=settings.multipart_stale_s)
    for upload in multipart:
        if upload.key.startswith(NEVER_REMOVED) or upload.initiated + stale > now:
            continue
        if len(plan.abort) < budget:
            plan.abort.append(upload)
        else:
            plan.deferred += 1
    for obj in objects:
        disposition = classify(obj, jobs, referenced, now, settings)
        plan.counts[disposition.value] += 1
        if not disposition.deletes:
            continue
        if len(plan.delete) + len(plan.abort) < budget:
            plan.delete.append(obj.key)
        else:
            plan.deferred += 1
    return plan


def retention_under_pressure(settings: CleanupSettings, over_limit: bool) -> CleanupSettings:
    """The settings cleanup plans with: while object storage is past `storage_limit_bytes`
    (`over_limit`), ended jobs' work objects and unreferenced checkpoints are kept only
    `storage_pressure_retention_s` (when shorter than `cleanup_retention_s`). Pure."""
    if not over_limit or settings.storage_pressure_retention_s >= settings.cleanup_retention_s:
        return settings
    return settings.model_copy(update={"cleanup_retention_s": settings.storage_pressure_retention_s})

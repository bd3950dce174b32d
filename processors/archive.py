"""Archive: a claimed work item -> the job's original source preserved under `archive/{job_id}/`,
with a sha256 manifest, before anything else of the `archive` profile runs.

A stage of the registry (`domain/pipeline.py`; the `archive` profile, which the `archive` tier's jobs
run: archive -> transcode -> thumbnails -> publish). What it writes, never under an attempt's prefix,
so that every attempt of every job writes the same keys:

- `archive/{job_id}/{file name of the source key}`: the source's bytes, written with a conditional
  put (`If-None-Match: *`, `ObjectStorage.put_file_if_absent`): a retry, a zombie or a second
  deployment finding the same bytes there goes on; different bytes are an `OutputConflict` (class
  `output_conflict`, dead-lettered for an operator): an archived copy is never overwritten;
- `archive/{job_id}/manifest.json`: what was archived (`manifest`: the job, the source key, the copy's
  key, its size in bytes and hex sha256), created only if absent, the same bytes on every attempt.

Verified after writing: the copy is read back whole and must have the source's size and sha256
(the one the intake recorded in `JobAccepted`, `job_state.source_sha256`); the manifest is read back
and must be the one this attempt would write. A copy that does not verify is a `StorageError`
(`storage_transient`, retried; a later attempt meets the same object and ends in `OutputConflict`).
The watchdog's cleanup never removes anything under `archive/` (`domain/policy/cleanup.py`), and
publish never promotes it (`processors.providers.promotable`).

Heartbeats come from `Attempt.keepalive` while the three passes over the bytes run (download, put,
read-back), with a no-progress grace of `PASSES * size / ARCHIVE_MIN_BYTES_PER_S` seconds: a copy has
no media progress to report. Crash points: the generic `archive.claim.*`, `archive.AttemptSucceeded.*`,
and `archive.before_put`, `archive.after_put`, `archive.after_manifest`.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import tempfile
import time
from pathlib import Path

import structlog

from domain import events as ev
from domain.errors import OutputConflict, StorageError
from processors.runtime import Outgoing
from processors.worker import Attempt, StageWorker
from tapeline.crashpoints import crash_point
from tapeline.objects import sha256_file
from tapeline.ports import ObjectStorage

log = structlog.get_logger("tapeline.archive")

STAGE = "archive"
ARCHIVE_PREFIX = "archive/"
"""Where archived sources live: never swept by cleanup, never published."""
ARCHIVE_MIN_BYTES_PER_S = 10 * 1024 * 1024
"""The slowest copy rate (bytes per second) the stage's no-progress grace allows for: 10 MiB/s."""
PASSES = 3
"""Passes over the source's bytes: download, conditional put, read-back."""


def archive_keys(job_id: str, source_key: str) -> tuple[str, str]:
    """(copy key, manifest key) of `job_id`'s archived source `source_key`. Pure.
    `uploads/u1/clip.mp4` -> (`archive/{job_id}/clip.mp4`, `archive/{job_id}/manifest.json`); a
    source whose file name is `manifest.json` is kept as `source-manifest.json`."""
    name = posixpath.basename(source_key) or "source"
    if name == "manifest.json":
        name = "source-manifest.json"
    return f"{ARCHIVE_PREFIX}{job_id}/{name}", f"{ARCHIVE_PREFIX}{job_id}/manifest.json"


def manifest(job_id: str, source_key: str, copy_key: str, size_bytes: int, sha256: str) -> bytes:
    """The manifest of an archived source: canonical JSON (sorted keys, no timestamps), so every
    attempt of the job writes the same bytes and a conditional create can compare them. Pure."""
    return (json.dumps({"job_id": job_id, "source_key": source_key, "archive_key": copy_key,
                        "size_bytes": size_bytes, "sha256": sha256, "algorithm": "sha256",
                        "written_by": "tapeline archive stage"}, sort_keys=True, indent=2) + "\n").encode()


def progress_grace_s(size_bytes: int) -> float:
    """Seconds the no-progress timeout grows by while `size_bytes` are archived (`PASSES` passes at
    `ARCHIVE_MIN_BYTES_PER_S`). Pure."""
    return PASSES * size_bytes / ARCHIVE_MIN_BYTES_PER_S


class ArchiveWorker(StageWorker):
    """The `archive` stage (see the module's docstring)."""

    stage = STAGE

    def recorded_source(self, job_id: str) -> tuple[str | None, int | None]:
        """(hex sha256, size in bytes) the intake recorded for the job's source, from its projected row
        (None, None when the row does not say)."""
        row = self.jobs.one("job_state_by_ids", {"job_ids": [job_id]}) or {}
        return row.get("source_sha256"), row.get("source_size_bytes")

    def work(self, attempt: Attempt, store: ObjectStorage) -> list[Outgoing]:
        item, identity, settings = attempt.item, attempt.identity, self.settings
        copy_key, manifest_key = archive_keys(identity.job_id, item.source_key)
        expected_sha, expected_size = self.recorded_source(identity.job_id)
        started = time.monotonic()
        grace = progress_grace_s(expected_size or 0) or None
        with tempfile.TemporaryDirectory(prefix="tapeline-archive-") as tmp, \
                attempt.keepalive(0, 0.0, None, progress_grace_s=grace):
            source = Path(tmp) / "source"
            store.download(item.source_key, source)
            sha, size = sha256_file(source), source.stat().st_size
            if expected_sha is not None and (sha, size) != (expected_sha, expected_size or size):
                raise StorageError(f"{item.source_key} read {size} bytes with sha256 {sha[:12]}..., not the "
                                   f"{expected_size} bytes with sha256 {expected_sha[:12]}... the intake recorded")
            crash_point("archive.before_put")
            created = store.put_file_if_absent(source, copy_key, "application/octet-stream", sha,
                                               metadata={"source-key": item.source_key})
            crash_point("archive.after_put")
            differs = store.stored_mismatch(copy_key, size, sha)
            if differs is not None:
                raise StorageError(f"the archived copy {copy_key} does not verify: {differs}")
        body = manifest(identity.job_id, item.source_key, copy_key, size, sha)
        existing = store.create_exclusive(manifest_key, body)
        if existing is not None and existing != body:
            raise OutputConflict.found(manifest_key, "it describes another archive", store.object_found(manifest_key))
        if store.get_bytes(manifest_key) != body:
            raise StorageError(f"the manifest {manifest_key} read back differs from the one written")
        crash_point("archive.after_manifest")
        outputs = [ev.OutputFile(key=copy_key, sha256=sha, size_bytes=size, content_type="application/octet-stream"),
                   ev.OutputFile(key=manifest_key, sha256=hashlib.sha256(body).hexdigest(), size_bytes=len(body),
                                 content_type="application/json")]
        log.info("source archived", job_id=identity.job_id, key=copy_key, size_bytes=size, sha256=sha,
                 created=created)
        return [(settings.jobs_topic, attempt.event(ev.AttemptSucceeded, outputs=outputs, renditions=[],
                                                    media_duration_s=item.media_duration_s,
                                                    elapsed_s=round(time.monotonic() - started, 3)))] + \
            self.hand_on(attempt, inputs=list(item.inputs) + outputs, renditions=list(item.renditions),
                         audio_playlist_key=item.audio_playlist_key, media_duration_s=item.media_duration_s)

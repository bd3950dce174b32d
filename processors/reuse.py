"""Output profiles, the degradation ladder and reuse of valid results (issue 9, items 5 and 6).

- `OutputProfile`: what determines a job's outputs (ladder, x264 preset, segment length, codec
  settings, the profile name) and its `fingerprint`, a sha256 of those values in canonical JSON.
  Two jobs with the same source sha256 and the same fingerprint produce the same renditions.
- `plan_profile` (pure): the full profile, or the degraded one (top rendition dropped, a faster
  preset) while the job's tier has a backlog above `degrade_backlog_threshold`.
- `find_reusable` (reads the projection, HEADs the bucket): a completed job with the same source
  sha256 and fingerprint whose published objects all still exist, or None.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import structlog

from processors import media
from domain import events as ev
from tapeline.ports import JobStore, ObjectStorage
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.reuse")

PROFILE_FORMAT = 1
"""Version of what the encoder does beyond the fingerprinted settings (segments.build_segment_command).
Bump it when a code change alters outputs for the same settings: old results then stop matching."""
VIDEO_CODEC = {"codec": "libx264", "profile": "high", "pix_fmt": "yuv420p", "keyframes": "segment boundaries",
               "container": "hls/mpegts"}
"""The fixed codec settings of every rendition (`segments.build_segment_command`), part of the fingerprint."""
REUSE_CANDIDATES = 3
"""Completed jobs checked per fingerprint, newest first, before intake gives up and transcodes."""


@dataclass(frozen=True)
class OutputProfile:
    """A job's output profile: the ladder (largest first), the x264 preset, whether it is the degraded
    one and why (`reason`: tier, backlog and threshold), and `fingerprint` (64 hex chars)."""

    ladder: tuple[ev.Rendition, ...]
    x264_preset: str
    fingerprint: str
    degraded: bool = False
    reason: str | None = None


def profile_fingerprint(profile_name: str, ladder: list[ev.Rendition] | tuple[ev.Rendition, ...], x264_preset: str,
                        settings: Settings) -> str:
    """sha256 (hex) of everything that determines the outputs: the profile's name, each rung's name,
    size and bitrate, the preset, the segment length (s), the audio bitrate and the fixed codec
    settings, and `PROFILE_FORMAT`. Pure and stable: canonical JSON, no time, no host."""
    spec = {"format": PROFILE_FORMAT, "profile": profile_name, "x264_preset": x264_preset,
            "segment_s": settings.segment_s, "audio_kbps": media.AUDIO_BITRATE_KBPS, "video": VIDEO_CODEC,
            "ladder": [[r.name, r.width, r.height, r.video_bitrate_kbps] for r in ladder]}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def degraded_ladder(ladder: list[ev.Rendition]) -> list[ev.Rendition]:
    """The cheaper ladder: the top (largest) rendition dropped; a one-rung ladder is kept as it is."""
    return list(ladder[1:]) if len(ladder) > 1 else list(ladder)


def plan_profile(profile_name: str, tier: str, full_ladder: list[ev.Rendition], backlog: int | None,
                 settings: Settings) -> OutputProfile:
    """The profile a new job of `tier` gets. Pure.

    Degraded (`degraded_ladder`, `degraded_x264_preset`) when `degrade_backlog_threshold` is set,
    the tier is one of `degrade_tiers` and its `backlog` (waiting + running jobs before this one;
    None: unknown, never degraded) is above the threshold; otherwise the full ladder and `x264_preset`.
    """
    threshold = settings.degrade_backlog_threshold
    if threshold is not None and backlog is not None and tier in settings.degrade_tiers and backlog > threshold:
        ladder = degraded_ladder(full_ladder)
        preset = settings.degraded_x264_preset
        reason = (f"{tier} backlog {backlog} > threshold {threshold}: "
                  f"{', '.join(r.name for r in ladder)} at preset {preset}")
        return OutputProfile(tuple(ladder), preset, profile_fingerprint(profile_name, ladder, preset, settings),
                             True, reason)
    return full_profile(profile_name, full_ladder, settings)


def full_profile(profile_name: str, full_ladder: list[ev.Rendition], settings: Settings) -> OutputProfile:
    """The full-quality profile: the whole ladder at `x264_preset`. Pure."""
    return OutputProfile(tuple(full_ladder), settings.x264_preset,
                         profile_fingerprint(profile_name, full_ladder, settings.x264_preset, settings))


@dataclass(frozen=True)
class Reusable:
    """A completed job's published result that may be reused: `origin_job_id` (the job that
    transcoded and published), the fingerprint it matched, its master playlist key and URL, the
    published renditions, every published object (verified to exist) and the media duration (s)."""

    origin_job_id: str
    fingerprint: str
    master_key: str
    master_url: str
    renditions: list[ev.Rendition]
    outputs: list[ev.OutputFile]
    media_duration_s: float | None


def missing_outputs(store: ObjectStorage, outputs: list[ev.OutputFile]) -> list[str]:
    """Keys of `outputs` that are gone from the bucket or differ from their record (size, or the
    sha256 kept in the object's metadata). One HEAD per object; raises `StorageError` when S3 fails."""
    missing = []
    for output in outputs:
        found = store.head(output.key)
        if found is None:
            missing.append(output.key)
            continue
        size, metadata = found
        if size != output.size_bytes or metadata.get("sha256", output.sha256) != output.sha256:
            missing.append(output.key)
    return missing


def published_result(db: JobStore, job_id: str) -> Reusable | None:
    """The published result of `job_id` from the projection (its applied publish success and
    `JobCompleted`, the `published_result` operation), not yet verified against the bucket; None
    when it has none."""
    row = db.one("published_result", {"job_id": job_id})
    if row is None:
        return None
    payload: dict[str, Any] = row["published"]
    outputs = [ev.OutputFile(**o) for o in payload.get("outputs") or []]
    masters = [o.key for o in outputs if o.key.endswith("/master.m3u8")]
    if not masters or not row["master_url"]:
        return None
    return Reusable(origin_job_id=job_id, fingerprint="", master_key=masters[0], master_url=row["master_url"],
                    renditions=[ev.Rendition(**r) for r in payload.get("renditions") or []], outputs=outputs,
                    media_duration_s=payload.get("media_duration_s"))


def find_reusable(db: JobStore, store: ObjectStorage, sha256: str, fingerprints: list[str]) -> Reusable | None:
    """The first completed job (per fingerprint in the given order, newest first, at most
    `REUSE_CANDIDATES` each) with source `sha256` whose published objects all still exist, or None.

    A job that itself reused a result points at the job that transcoded (`reused_from`), so a chain
    always lends the original outputs. A candidate with a missing or changed object is logged and
    skipped (a real transcode follows). The master and rendition URLs are `store`'s (this region's
    origin), not the recorded ones. Raises `StorageError` when S3 cannot answer.
    """
    tried: set[str] = set()
    for fingerprint in fingerprints:
        rows = db.all("reuse_candidates", {"sha256": sha256, "fingerprint": fingerprint, "limit": REUSE_CANDIDATES})
        for row in rows:
            origin = row["origin_job_id"]
            if origin in tried:
                continue
            tried.add(origin)
            result = published_result(db, origin)
            if result is None:
                continue
            missing = missing_outputs(store, result.outputs)
            if missing:
                log.info("completed job's outputs are incomplete; not reused", origin_job_id=origin,
                         missing=len(missing), first_missing=missing[0])
                continue
            # The URLs of this region's origin: the recorded ones name the origin the job was published
            # at, another region's after a failover (docs/regions.md); the keys are the same in both.
            renditions = [r.model_copy(update={"url": store.public_url(r.playlist_key)}) if r.playlist_key else r
                          for r in result.renditions]
            return Reusable(**{**result.__dict__, "fingerprint": fingerprint,
                               "master_url": store.public_url(result.master_key), "renditions": renditions})
    return None

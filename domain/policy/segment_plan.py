"""The pure side of checkpointed segments: where segment boundaries fall, which recorded checkpoints
a new attempt reuses (`plan_resume`), the checks a segment and a whole rendition pass before they
are trusted (`check_join`, `check_rendition`), and the HLS media playlist (`media_playlist`). Times are
seconds of source time; frame durations `frame_s` in seconds. The ffmpeg command and the watching of
its files are `processors/segments.py`; reading a segment's packets is `processors/ts_scan.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Iterable

from domain.errors import OutputMismatch, TranscodeFailed

BOUNDARY_EPS_S = 0.001
"""Segment boundaries sit this far before `j * segment_s`, so a frame stamped exactly on the
boundary (or a microsecond early after rounding) starts the new segment in every run."""
AUDIO = "audio"
"""Rendition name of the audio-only HLS rendition."""
SEGMENT_NAME = "seg_{index:05d}.ts"


def boundary_s(index: int, segment_s: float) -> float:
    """Source time (s) where segment `index` starts: 0 for the first, else `index * segment_s - eps`."""
    return 0.0 if index <= 0 else index * segment_s - BOUNDARY_EPS_S


def resume_seek_s(index: int, segment_s: float, frame_rate: Fraction | None) -> float:
    """Source time (s) a run resuming at segment `index` seeks to (`-ss`, accurate: frames before
    it are decoded and dropped).

    The encoder rounds every frame timestamp to its time base 1/`frame_rate`, and compares the
    rounded value with the forced keyframe times (rounded the same way). So segment `index` starts
    with the first frame whose *rounded* time reaches the rounded boundary, which in source time is
    half a frame before the rounded boundary: a source whose frames sit off the grid (a loop, a
    timestamp jump) otherwise loses the frame that rounds up onto the boundary when resuming.
    Without a frame rate: the boundary itself."""
    boundary = boundary_s(index, segment_s)
    if index <= 0 or not frame_rate:
        return boundary
    tick = 1 / Fraction(frame_rate)
    first = round(Fraction(boundary) / tick)  # the boundary on the encoder's grid, in frames
    return float((first - Fraction(1, 2)) * tick)


def expected_segments(duration_s: float, segment_s: float) -> int:
    """How many segments a source of `duration_s` seconds should give (the last may be short)."""
    return max(1, math.ceil((duration_s - BOUNDARY_EPS_S) / segment_s))


def segment_name(index: int) -> str:
    return SEGMENT_NAME.format(index=index)


@dataclass(frozen=True)
class LocalSegment:
    """One completed segment file: rendition, index, path, hex sha256, bytes, frames, and its media
    start and duration in seconds of source time."""

    rendition: str
    index: int
    path: Path
    sha256: str
    size_bytes: int
    frames: int
    start_s: float
    duration_s: float


# --- Recorded checkpoints and resuming --------------------------------------------------------

@dataclass(frozen=True)
class Checkpoint:
    """A recorded `CheckpointRecorded`: which attempt stored which segment where, and what it holds."""

    attempt: int
    rendition: str
    index: int
    key: str
    sha256: str
    frames: int
    start_s: float
    duration_s: float


@dataclass(frozen=True)
class ResumePlan:
    """Where a new attempt starts: segments `0..start_index-1` of every video rendition are reused
    (`video`), and `audio` is the complete audio set to reuse, or empty to encode it again."""

    start_index: int
    video: dict[str, list[Checkpoint]]
    audio: list[Checkpoint]

    @property
    def reused(self) -> list[Checkpoint]:
        return [c for name in self.video for c in self.video[name]] + list(self.audio)

    def video_complete(self, duration_s: float, frame_s: float) -> bool:
        """Whether the reused segments already reach the end of a source of `duration_s` seconds."""
        return bool(self.video) and self.start_index > 0 and self.start_s >= duration_s - frame_s

    @property
    def start_s(self) -> float:
        """Source time (s) the encode resumes at: the end of the last reused segment (0 when none)."""
        first = next(iter(self.video.values()), [])
        return first[-1].start_s + first[-1].duration_s if first else 0.0


def plan_resume(verified: Iterable[Checkpoint], renditions: list[str], segment_s: float,
                frame_s: float, duration_s: float | None = None) -> ResumePlan:
    """Choose what to reuse from sha256-verified checkpoints. Pure.

    Video: the longest prefix `0..k-1` such that every rendition has segment `i`, segment 0 starts
    at 0, each starts where the previous ended and at the same time in every rendition (within half
    a frame, `frame_s` seconds per frame), and each starts and ends at its planned boundaries
    (within one frame; a checkpoint made with another `segment_s` does not fit) unless it is the
    source's last (it ends within a frame of `duration_s`). Several checkpoints of one segment (a
    retry redid it): the newest attempt's wins, and within an attempt the later record (`verified`
    is in log order). Audio: the complete set of the newest attempt that
    recorded audio, all of it verified and contiguous from 0, else none.
    """
    tolerance = frame_s / 2
    best: dict[tuple[str, int], Checkpoint] = {}
    for c in verified:
        key = (c.rendition, c.index)
        if key not in best or c.attempt >= best[key].attempt:  # in log order: the later record of a segment wins
            best[key] = c
    video: dict[str, list[Checkpoint]] = {name: [] for name in renditions}
    index = 0
    while renditions:
        row = [best.get((name, index)) for name in renditions]
        if any(c is None for c in row):
            break
        start = row[0].start_s
        if abs(start - max(0.0, index * segment_s)) > frame_s or any(abs(c.start_s - start) > tolerance for c in row):
            break
        end = start + row[0].duration_s
        last = duration_s is not None and end >= duration_s - frame_s
        if abs(end - (index + 1) * segment_s) > frame_s and not last:
            break
        if index > 0:
            previous = video[renditions[0]][-1]
            if abs(previous.start_s + previous.duration_s - start) > tolerance:
                break
        for name, c in zip(renditions, row):
            video[name].append(c)
        index += 1
    audio_sets: dict[int, list[Checkpoint]] = {}
    for c in verified:
        if c.rendition == AUDIO:
            audio_sets.setdefault(c.attempt, []).append(c)
    audio: list[Checkpoint] = []
    for attempt in sorted(audio_sets, reverse=True):
        chosen = sorted(audio_sets[attempt], key=lambda c: c.index)
        if [c.index for c in chosen] == list(range(len(chosen))):
            audio = chosen
            break
    return ResumePlan(index, video, audio)


def check_join(previous: Checkpoint | LocalSegment, segment: LocalSegment, frame_s: float,
               max_gap_s: float = 0.0) -> None:
    """Raise `TranscodeFailed` unless `segment` starts where `previous` ended (within half a frame;
    a later start by up to `max_gap_s` seconds is accepted: a variable-frame-rate source's own hole
    between two frames): a resumed encode whose seek landed elsewhere (a container without an
    index) must not be joined."""
    end = previous.start_s + previous.duration_s
    if not -frame_s / 2 <= segment.start_s - end <= max(frame_s / 2, max_gap_s):
        raise TranscodeFailed(f"{segment.rendition} segment {segment.index} starts at {segment.start_s:.3f} s, "
                              f"the previous one ends at {end:.3f} s")


# --- Assembly -------------------------------------------------------------------------------

def media_playlist(durations: list[float]) -> str:
    """An HLS VOD media playlist (RFC 8216) of `seg_00000.ts`.. with these durations in seconds."""
    target = max(1, math.ceil(max(durations, default=1.0) - 1e-6))
    lines = ["#EXTM3U", "#EXT-X-VERSION:3", f"#EXT-X-TARGETDURATION:{target}", "#EXT-X-MEDIA-SEQUENCE:0",
             "#EXT-X-PLAYLIST-TYPE:VOD", "#EXT-X-INDEPENDENT-SEGMENTS"]
    for index, duration in enumerate(durations):
        lines += [f"#EXTINF:{duration:.6f},", segment_name(index)]
    lines.append("#EXT-X-ENDLIST")
    return "\n".join(lines) + "\n"


def check_rendition(name: str, segments: list[LocalSegment | Checkpoint], frame_s: float,
                    expected_frames: int | None, duration_s: float, tolerance_s: float, start_s: float = 0.0,
                    max_gap_s: float = 0.0) -> None:
    """Check one assembled rendition against the source stream it comes from, before it is trusted. Pure.

    Its segments are numbered 0..n-1, the first starts at `start_s` (the stream's start after the
    file's, `media.Probe.video_start_s` / `audio_start_s`), each starts where the previous ended
    (within half a frame; later by up to `max_gap_s` for a variable-frame-rate source), the
    rendition ends within `tolerance_s` of `start_s + duration_s` (`duration_s`: that stream's own
    duration), and (video) the frames add up to `expected_frames` when the probe knew it.
    Raises `OutputMismatch` (not retryable: a new attempt encodes the same) naming the rendition
    and what is wrong.
    """
    if not segments:
        raise OutputMismatch(f"rendition {name}: no segments")
    if [s.index for s in segments] != list(range(len(segments))):
        raise OutputMismatch(f"rendition {name}: segments are not numbered 0..{len(segments) - 1}")
    slack = frame_s / 2 if name != AUDIO else 0.05
    if abs(segments[0].start_s - start_s) > max(slack, 0.03):
        raise OutputMismatch(f"rendition {name}: starts at {segments[0].start_s:.3f} s, its source stream at "
                             f"{start_s:.3f} s")
    for previous, segment in zip(segments, segments[1:]):
        step = segment.start_s - (previous.start_s + previous.duration_s)
        if not -slack <= step <= max(slack, max_gap_s if name != AUDIO else 0.0):
            raise OutputMismatch(f"rendition {name}: a gap or overlap before segment {segment.index} "
                                  f"({previous.start_s + previous.duration_s:.3f} s -> {segment.start_s:.3f} s)")
    total = segments[-1].start_s + segments[-1].duration_s - start_s
    if abs(total - duration_s) > tolerance_s:
        raise OutputMismatch(f"rendition {name}: {total:.3f} s long, its source stream {duration_s:.3f} s "
                             "(a source that decodes short?)")
    frames = sum(s.frames for s in segments)
    if name != AUDIO and expected_frames is not None and abs(frames - expected_frames) > 1:
        raise OutputMismatch(f"rendition {name}: {frames} frames, the source has {expected_frames}")

"""Checkpointed segment transcoding: plan, encode, watch, verify and assemble HLS segments.

One ffmpeg process encodes the whole ladder (one decode, `split` + `scale` per rung), forcing a
keyframe at every segment boundary `j * segment_s` (minus `BOUNDARY_EPS_S`) of *source* time in
every rung, and cuts each rung's MPEG-TS with the `segment` muxer at every keyframe, so segment `j`
of every rendition covers the same frames: those with source time in
`[j * segment_s - eps, (j + 1) * segment_s - eps)` (the first from 0).

Timestamps are the source's own (`-copyts -start_at_zero`), shifted by `TS_OFFSET_S` so B-frame
decode timestamps never go negative (the muxer would otherwise shift a first run and not a resumed
one), so a segment encoded by a resumed run has exactly the packet timestamps a single pass gives it.
A resumed run seeks the input to its first boundary (`-ss`, accurate: decoded from the keyframe
before and trimmed) and numbers its files from `start_index`. Keyframes are forced by an absolute
time list, not an expression: `force_key_frames` expressions see `t` relative to the first frame
of the run, which differs between a full and a resumed run.

Audio is encoded once per job, never per segment (per-segment AAC leaves priming gaps at the
joins): it is a separate output of the same ffmpeg, from a second, unseeked input when resuming,
and is checkpointed as a whole once ffmpeg finished.

A segment file is complete when the muxer has opened the next file of its rendition (the segment
muxer closes one file before it opens the next) or ffmpeg ended cleanly; `SegmentWatcher` reports
each completed file once, with its sha256, frame count and media times read from its own packets.
"""

from __future__ import annotations

import hashlib
import math
from fractions import Fraction
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import ffmpeg

from processors import media
from processors.encode_plan import rung_video_options
from domain.events import Rendition
from domain.errors import OutputMismatch, TranscodeFailed

BOUNDARY_EPS_S = 0.001
"""Segment boundaries sit this far before `j * segment_s`, so a frame stamped exactly on the
boundary (or a microsecond early after rounding) starts the new segment in every run."""
TS_OFFSET_S = 10.0
"""`-output_ts_offset`: output timestamps are source time + 10 s (+ the MPEG-TS muxer's own delay)."""
MPEGTS_DELAY_S = 1.4
"""The MPEG-TS muxer adds 2 x its default `max_delay` (0.7 s) to every timestamp."""
PTS_ORIGIN_S = TS_OFFSET_S + MPEGTS_DELAY_S
"""PTS (seconds) of source time 0 in every segment we write."""
AUDIO = "audio"
"""Rendition name of the audio-only HLS rendition."""
SEGMENT_NAME = "seg_{index:05d}.ts"
ADTS_RATES = (96000, 88200, 64000, 48000, 44100, 32000, 24000, 22050, 16000, 12000, 11025, 8000, 7350, 0, 0, 0)
"""AAC sampling frequencies by ADTS `sampling_frequency_index`, Hz."""
H264, AAC = 0x1B, 0x0F
"""MPEG-TS stream types of our outputs."""


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


def build_segment_command(source: Path, out_dir: Path, ladder: list[Rendition], *, with_audio: bool,
                          segment_s: float, preset: str, duration_s: float, start_index: int = 0,
                          list_dir: Path | None = None, video_stream: int | None = None,
                          audio_stream: int | None = None, frame_rate: Fraction | None = None,
                          deinterlace: bool = False, audio_rate_hz: int | None = None) -> list[str]:
    """ffmpeg arguments encoding segments `start_index..` of every rung (and all audio, if asked;
    with an empty `ladder`, only the audio).

    Writes `out_dir/<rung>/seg_NNNNN.ts` (numbered from `start_index`) and, with audio,
    `out_dir/audio/seg_NNNNN.ts` (from 0, 4 s each, `segment_s` apart). The segment muxers' CSV
    lists go to `list_dir` (default `out_dir/../lists`), so `out_dir` holds only media.
    `video_stream` / `audio_stream`: absolute stream indexes from the probe (`media.Probe`; default:
    ffmpeg's own choice), so cover art or a second audio track is never encoded by mistake.
    `frame_rate`: the probe's `encoder_frame_rate`; the encoder time base is set to its inverse
    explicitly and a resumed run seeks to `resume_seek_s`, so full and resumed runs cut alike.
    `deinterlace` (the probe's): `bwdif` in `send_frame` mode before the split (one frame out per
    frame in, so frame counts and timestamps stay the source's). `audio_rate_hz`: the audio's
    sampling rate; above `media.MAX_AUDIO_RATE_HZ` it is resampled to that rate.
    """
    list_dir = list_dir or out_dir.parent / "lists"
    list_dir.mkdir(parents=True, exist_ok=True)
    last = expected_segments(duration_s, segment_s) + 1
    keyframes = ",".join(f"{boundary_s(j, segment_s):.6f}" for j in range(start_index, last + 1))
    seek = {"ss": f"{resume_seek_s(start_index, segment_s, frame_rate):.6f}"} if start_index > 0 and ladder else {}
    time_base = {"enc_time_base:v": f"{frame_rate.denominator}:{frame_rate.numerator}"} if frame_rate else {}
    video_in = ffmpeg.input(str(source), protocol_whitelist="file", format_whitelist=media.ALLOWED_CONTAINERS,
                            **seek)
    video = video_in[str(video_stream)] if video_stream is not None else video_in.video
    if deinterlace and ladder:
        video = video.filter("bwdif", mode="send_frame", parity="auto", deint="all")
    split = video.filter_multi_output("split", len(ladder)) if ladder else None
    segment = {"f": "segment", "segment_format": "mpegts", "segment_list_type": "csv",
               "output_ts_offset": f"{TS_OFFSET_S:g}"}
    outputs = []
    for index, rung in enumerate(ladder):
        (out_dir / rung.name).mkdir(parents=True, exist_ok=True)
        video = split.stream(index).filter("scale", rung.width, rung.height).filter("setsar", 1)
        outputs.append(ffmpeg.output(video, str(out_dir / rung.name / "seg_%05d.ts"), **{
            **rung_video_options(rung, preset),
            # Keyframes only at boundaries: forced there, no scene cuts, no periodic ones.
            "force_key_frames": keyframes, "sc_threshold": 0, "g": 1_000_000,
            # One frame out per decoded frame, with its own timestamp (frame-exact against the source).
            "fps_mode": "passthrough", **time_base,
            # A cut at every keyframe: the boundaries are the keyframes.
            "segment_time": "0.001", "segment_start_number": start_index,
            "segment_list": str(list_dir / f"{rung.name}.csv"), **segment}))
    if with_audio:
        (out_dir / AUDIO).mkdir(parents=True, exist_ok=True)
        audio_in = ffmpeg.input(str(source), protocol_whitelist="file", format_whitelist=media.ALLOWED_CONTAINERS) \
            if seek else video_in
        times = ",".join(f"{TS_OFFSET_S + j * segment_s:g}" for j in range(1, last + 1))
        audio = audio_in[str(audio_stream)] if audio_stream is not None else audio_in.audio
        outputs.append(ffmpeg.output(audio, str(out_dir / AUDIO / "seg_%05d.ts"), **{
            "c:a": "aac", "b:a": f"{media.AUDIO_BITRATE_KBPS}k", "ac": 2,
            **({"ar": media.MAX_AUDIO_RATE_HZ} if audio_rate_hz and audio_rate_hz > media.MAX_AUDIO_RATE_HZ else {}),
            "segment_times": times, "segment_list": str(list_dir / f"{AUDIO}.csv"), **segment}))
    stream = ffmpeg.merge_outputs(*outputs).global_args(
        "-hide_banner", "-nostdin", "-loglevel", "error", "-nostats", "-progress", "pipe:1",
        "-copyts", "-start_at_zero")
    return stream.overwrite_output().compile()


# --- Reading our own MPEG-TS segments ------------------------------------------------------------

@dataclass(frozen=True)
class TsScan:
    """What one of our MPEG-TS files holds, read from its packets (no decoding).

    `stream_types`: PMT stream types (0x1B H.264, 0x0F AAC); `frames`: video access units (one PES
    each) or AAC frames (ADTS headers) of the first stream; `first_pts`/`last_pts`: 90 kHz ticks;
    `frame_ticks`: one frame's duration in 90 kHz ticks (video: the most common distance between
    consecutive frame timestamps; AAC: 1024 samples at the ADTS header's sampling rate).
    """

    stream_types: tuple[int, ...]
    frames: int
    first_pts: int | None
    last_pts: int | None
    frame_ticks: int = 0

    def start_s(self) -> float:
        """Source time (s) of the first frame."""
        return (self.first_pts or 0) / 90000 - PTS_ORIGIN_S

    def duration_s(self) -> float:
        """Seconds from the first frame's timestamp to the end of the last frame."""
        if self.first_pts is None or self.last_pts is None:
            return 0.0
        return (self.last_pts - self.first_pts + self.frame_ticks) / 90000


def _pes_pts(payload: bytes) -> int | None:
    if len(payload) < 14 or payload[:3] != b"\x00\x00\x01" or not payload[7] & 0x80:
        return None
    p = payload[9:14]
    return ((p[0] >> 1) & 0x07) << 30 | p[1] << 22 | (p[2] >> 1) << 15 | p[3] << 7 | p[4] >> 1


def scan_ts(data: bytes) -> TsScan:
    """Parse MPEG-TS bytes (188-byte packets): the PMT's streams, and for the first elementary
    stream every PES start (its PTS) and, for AAC, every ADTS frame. Pure.

    Raises `TranscodeFailed` when the bytes are not MPEG-TS (no sync byte) or hold no PMT.
    """
    if len(data) < 188 or data[0] != 0x47:
        raise TranscodeFailed("segment is not MPEG-TS (no sync byte)")
    pmt_pid, streams = None, []
    pes: dict[int, list[bytearray]] = {}
    for offset in range(0, len(data) - 187, 188):
        packet = data[offset:offset + 188]
        if packet[0] != 0x47:
            raise TranscodeFailed(f"segment has no sync byte at {offset}")
        pid = (packet[1] & 0x1F) << 8 | packet[2]
        start = bool(packet[1] & 0x40)
        afc = (packet[3] >> 4) & 0x3
        if not afc & 0x1:
            continue
        body = packet[5 + packet[4]:] if afc == 0x3 else packet[4:]
        if pid == 0 and start:
            section = body[1 + body[0]:]
            pmt_pid = (section[10] & 0x1F) << 8 | section[11]
        elif pid == pmt_pid and start and not streams:
            section = body[1 + body[0]:]
            length = (section[1] & 0x0F) << 8 | section[2]
            info = (section[10] & 0x0F) << 8 | section[11]
            at, end = 12 + info, 3 + length - 4
            while at + 5 <= end:
                streams.append((section[at], (section[at + 1] & 0x1F) << 8 | section[at + 2]))
                at += 5 + ((section[at + 3] & 0x0F) << 8 | section[at + 4])
        elif streams and pid == streams[0][1]:
            if start:
                pes.setdefault(pid, []).append(bytearray(body))
            elif pes.get(pid):
                pes[pid][-1] += body
    if not streams:
        raise TranscodeFailed("segment has no program map (no streams)")
    stream_type, pid = streams[0]
    units = pes.get(pid, [])
    ordered = sorted(s for s in (_pes_pts(bytes(u[:14])) for u in units) if s is not None)
    frames, ticks = len(units), 0
    last = ordered[-1] if ordered else None
    if stream_type == AAC:  # several ADTS frames per PES: count them; the last PES ends after all of its own
        frames, rate, in_unit = 0, 0, 0
        for unit in units:
            at, in_unit = (9 + unit[8] if len(unit) > 9 else len(unit)), 0
            while at + 7 <= len(unit) and unit[at] == 0xFF and unit[at + 1] & 0xF0 == 0xF0:
                rate = rate or ADTS_RATES[(unit[at + 2] >> 2) & 0x0F]
                in_unit += 1
                at += max(7, (unit[at + 3] & 0x03) << 11 | unit[at + 4] << 3 | unit[at + 5] >> 5)
            frames += in_unit
        ticks = round(1024 * 90000 / rate) if rate else 1920
        last_stamp = _pes_pts(bytes(units[-1][:14])) if units else None
        if last_stamp is not None and in_unit:
            last = last_stamp + (in_unit - 1) * ticks  # the last frame's timestamp
    else:
        gaps = [b - a for a, b in zip(ordered, ordered[1:]) if b > a]
        ticks = max(set(gaps), key=gaps.count) if gaps else 3600
    return TsScan(tuple(t for t, _ in streams), frames, ordered[0] if ordered else None, last, ticks)


# --- Completed segments ----------------------------------------------------------------------

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


def read_segment(rendition: str, index: int, path: Path) -> LocalSegment:
    """Hash and scan one segment file.

    Raises `TranscodeFailed` when it is missing, empty, not MPEG-TS, holds no frame, or its streams
    are not the one expected (H.264 for a video rendition, AAC for `audio`).
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TranscodeFailed(f"{rendition} segment {index} is missing: {exc}") from exc
    if not data:
        raise TranscodeFailed(f"{rendition} segment {index} is empty (0 bytes)")
    scan = scan_ts(data)
    expected = (AAC,) if rendition == AUDIO else (H264,)
    if scan.stream_types != expected:
        raise TranscodeFailed(f"{rendition} segment {index} holds streams {scan.stream_types}, expected {expected}")
    if scan.first_pts is None or not scan.frames:
        raise TranscodeFailed(f"{rendition} segment {index} holds no frame")
    return LocalSegment(rendition, index, path, hashlib.sha256(data).hexdigest(), len(data), scan.frames,
                        round(scan.start_s(), 6), round(scan.duration_s(), 6))


@dataclass
class SegmentWatcher:
    """Reports each segment file of `renditions` under `out_dir` once, when it is complete.

    `poll(ended=False)`: files whose successor exists; `poll(ended=True)` (ffmpeg exited 0): every
    remaining file. Segments come rendition by rendition, each in index order.
    """

    out_dir: Path
    renditions: list[str]
    start_index: int = 0
    reported: dict[str, int] = field(default_factory=dict)

    def poll(self, ended: bool = False) -> list[LocalSegment]:
        done = []
        for name in self.renditions:
            next_index = self.reported.get(name, self.start_index)
            while True:
                path = self.out_dir / name / segment_name(next_index)
                if not path.exists():
                    break
                if not ended and not (self.out_dir / name / segment_name(next_index + 1)).exists():
                    break
                done.append(read_segment(name, next_index, path))
                next_index += 1
            self.reported[name] = next_index
        return done


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

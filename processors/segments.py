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

This module is the I/O side (the ffmpeg command, reading and watching segment files); the pure
planning and checks are `domain/policy/segment_plan.py`, the packet scanning `processors/ts_scan.py`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import ffmpeg

from processors import media
from processors.encode_plan import rung_video_options
from domain.policy.segment_plan import AUDIO, LocalSegment, boundary_s, expected_segments, resume_seek_s, segment_name
from processors.ts_scan import AAC, H264, TS_OFFSET_S, scan_ts
from domain.events import Rendition
from domain.errors import TranscodeFailed


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


# --- Completed segments ----------------------------------------------------------------------

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

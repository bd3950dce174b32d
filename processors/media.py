"""The media pipeline: probe a source, plan its ladder, run ffmpeg with progress, check the result.

ffmpeg command lines are built with ffmpeg-python; the process itself is run and supervised here so
its `-progress` output and stderr are always read (a full pipe never hangs the worker).
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import threading
import time
from collections import deque
from fractions import Fraction
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import ffmpeg

from domain.events import Rendition, SourceMedia
from domain.errors import (InvalidInput, LimitsExceeded, OutputMismatch, TapelineError, TranscodeFailed, TranscodeTimeout,
                             UnsupportedMedia)
from tapeline.settings import Settings

ALLOWED_CONTAINERS = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,mpegts,flv,mpeg"
"""ffmpeg demuxers a source may be read with. Playlists (hls, concat) are refused: they name other
files and URLs (local-services.md: a text playlist saved as .mp4 is detected as HLS)."""

VIDEO_BITRATE_KBPS = {1080: 5000, 720: 2800, 480: 1400, 360: 800, 240: 400}
"""H.264 bitrate per rung height, kbit/s (in the range of Apple's HLS authoring spec ladder)."""
AUDIO_BITRATE_KBPS = 128


PLAYLIST_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"#EXTM3U", "an HLS playlist"),
    (b"ffconcat version", "an ffconcat playlist"),
    (b"<?xml", "an XML document (a DASH manifest?)"),
    (b"<MPD", "a DASH manifest"),
    (b"v=0", "an SDP session description"),
)
"""Text formats that name other files or URLs. ffmpeg would open what they name, so they are refused
by their first bytes before ffprobe runs (and `-format_whitelist` refuses them again inside ffprobe)."""


def sniff_playlist(head: bytes) -> str | None:
    """What kind of playlist `head` (the first bytes of a file) starts, or None when it is not one.

    Leading whitespace and a UTF-8 byte-order mark are ignored. Pure.
    """
    text = head.lstrip(b"\xef\xbb\xbf").lstrip()
    for signature, kind in PLAYLIST_SIGNATURES:
        if text.startswith(signature):
            return kind
    return None


def _run_probe(args: list[str], timeout_s: float = 60.0) -> tuple[dict, str]:
    """Run ffprobe with JSON output; returns (parsed output, stderr text).

    Raises `LimitsExceeded` when it runs longer than `timeout_s` seconds and `InvalidInput` when it
    exits non-zero or prints something that is not JSON.
    """
    try:
        done = subprocess.run(["ffprobe", "-v", "error", "-print_format", "json", *args],
                              capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise LimitsExceeded(f"probing took longer than the limit probe_timeout_s = {timeout_s:g} s") from exc
    stderr = done.stderr.decode(errors="replace")
    if done.returncode != 0:
        raise InvalidInput(f"not a readable video: {_probe_message(stderr, args[-1])}")
    try:
        info = json.loads(done.stdout or b"{}")
    except ValueError as exc:
        raise InvalidInput(f"not a readable video: ffprobe printed no JSON ({exc})") from exc
    return (info if isinstance(info, dict) else {}), stderr


def _probe_message(stderr: str, path: str) -> str:
    """The most telling line of ffprobe's stderr, without our temporary path in it."""
    lines = [line.replace(path, "source").strip() for line in stderr.splitlines() if line.strip()]
    if any("moov atom not found" in line for line in lines):
        return "the mp4 index (moov atom) is missing: the upload is truncated or was never finished"
    whitelist = next((line for line in lines if "not on whitelist" in line), None)
    if whitelist is not None:
        return f"container not on the allow-list ({whitelist.split(']', 1)[-1].strip()})"
    return lines[-1] if lines else "ffprobe failed"


def _ratio(text: Any) -> float:
    """A ffprobe ratio ("25/1", "1:1") as a float; 0.0 when absent, undefined or not finite."""
    num, _, den = str(text or "").replace(":", "/").partition("/")
    try:
        value = float(num) / float(den or 1)
    except (ValueError, ZeroDivisionError, OverflowError):
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


def _number(value: Any) -> float | None:
    """A ffprobe number (often a string; "N/A" when unknown) as a finite float, else None."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _count(value: Any) -> int | None:
    """A non-negative integer count from ffprobe ("132"), else None."""
    text = str(value) if isinstance(value, (int, str)) else ""
    return int(text) if text.isascii() and text.isdigit() and len(text) < 19 else None


def _dicts(value: Any) -> list[dict]:
    """The dict items of a JSON list (anything else: none)."""
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _rotation(stream: dict) -> int:
    """Display rotation of a video stream in degrees, 0..359 (display matrix first, then the old
    `rotate` tag). Angles that are not a multiple of 90 are ignored, as ffmpeg's autorotate does."""
    candidates = [side.get("rotation") for side in _dicts(stream.get("side_data_list"))]
    tags = stream.get("tags")
    candidates.append(tags.get("rotate") if isinstance(tags, dict) else None)
    for value in candidates:
        degrees = _number(value)
        if degrees is not None:
            rounded = int(round(degrees / 90.0)) * 90 if abs(degrees) < 1e6 else 0
            return rounded % 360 if abs(degrees - rounded) <= 2 else 0
    return 0


@dataclass(frozen=True)
class Probe:
    """What ffprobe found in a source: the summary recorded in `JobAccepted` and the streams used.

    `video_stream` and `audio_stream` are absolute stream indexes in the file (`-map 0:<index>`);
    `audio_stream` is None when the source has no audio.
    """

    media: SourceMedia
    video_stream: int
    audio_stream: int | None
    encoder_frame_rate: Fraction | None = None
    """Frames per second ffmpeg derives for the video stream and makes its encoder time base
    (`encoder_frame_rate_of`); None when the file states no rate."""
    video_start_s: float = 0.0
    """Where the video stream starts, seconds after the file's start (the earliest stream's start,
    which `-copyts -start_at_zero` makes 0 in our outputs)."""
    audio_start_s: float = 0.0
    """The same for the chosen audio stream (0.0 without audio)."""
    audio_duration_s: float | None = None
    """The chosen audio stream's own duration, s (None without audio)."""
    deinterlace: bool = False
    """The video is interlaced (ffprobe `field_order` tt, bb, tb or bt): the encode deinterlaces it."""
    audio_sample_rate: int | None = None
    """The chosen audio stream's sampling rate, Hz (None when unknown or without audio)."""
    variable_frame_rate: bool = False
    """The frame intervals vary (`avg_frame_rate` more than 1 % off `r_frame_rate`): a source hole
    between frames is no gap in our encode (`segments.check_rendition`'s `max_gap_s`)."""


def _fraction(text: Any) -> Fraction | None:
    """A ffprobe rate ("30000/1001") as a positive Fraction, else None."""
    num, _, den = str(text or "").replace(":", "/").partition("/")
    try:
        value = Fraction(int(num), int(den or 1))
    except (ValueError, ZeroDivisionError):
        return None
    return value if 0 < value < 1_000_000 else None


def encoder_frame_rate_of(video: dict) -> Fraction | None:
    """The frame rate ffmpeg guesses for a video stream (`av_guess_frame_rate` in libavformat):
    `r_frame_rate`, unless it is implausibly high (> 210) while `avg_frame_rate` is under 70, then
    `avg_frame_rate`. ffmpeg encodes with time base 1/rate, so every frame timestamp is rounded to
    that grid (source: libavformat/utils.c `av_guess_frame_rate`, fftools/ffmpeg.c
    `init_output_stream_encode` in ffmpeg 5.1)."""
    real, average = _fraction(video.get("r_frame_rate")), _fraction(video.get("avg_frame_rate"))
    if real and average and average < 70 and real > 210:
        return average
    return real or average


INTERLACED_FIELD_ORDERS = ("tt", "bb", "tb", "bt")
"""ffprobe `field_order` values of interlaced video (libavcodec `AVFieldOrder`); `progressive` and
`unknown` are encoded as they are."""
MAX_AUDIO_RATE_HZ = 48000
"""Audio sampled faster is resampled to this (the highest rate in Apple's HLS authoring spec for
AAC; a 96 kHz AAC track is valid but many players and TVs refuse it)."""
STREAM_LENGTH_NOTE_S = 0.1
"""Streams whose lengths differ by more than this many seconds are noted in `SourceMedia.handling`
(a few AAC frames of difference are normal in every file)."""


def _clock(value: Any) -> float | None:
    """A Matroska `DURATION` tag ("00:00:03.008000000") in seconds, else None."""
    parts = str(value or "").split(":")
    try:
        seconds = sum(float(p) * 60 ** i for i, p in enumerate(reversed(parts))) if len(parts) == 3 else None
    except ValueError:
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds > 0 else None


def stream_duration(stream: dict, fmt: dict) -> float | None:
    """A stream's own duration in seconds: its `duration`, else its `DURATION` tag (Matroska), else
    the container's duration; None when none is stated. Pure."""
    tags = stream.get("tags") if isinstance(stream.get("tags"), dict) else {}
    for value in (_number(stream.get("duration")), _clock(tags.get("DURATION"))):
        if value is not None and value > 0:
            return value
    value = _number(fmt.get("duration"))
    return value if value is not None and value > 0 else None


def choose_audio(streams: list[dict]) -> dict | None:
    """The audio stream a job encodes: the first with the `default` disposition, else the first
    audio stream, else None. Pure. (Players pick the default track too; a second commentary or
    silent track is never mixed in.)"""
    audio = [s for s in streams if s.get("codec_type") == "audio"]
    for s in audio:
        disposition = s.get("disposition") if isinstance(s.get("disposition"), dict) else {}
        if disposition.get("default") == 1:
            return s
    return audio[0] if audio else None


def source_handling(video: dict, audio: dict | None, audio_count: int, video_s: float, audio_s: float | None,
                    video_start_s: float, audio_start_s: float, file_start_s: float) -> list[str]:
    """What the transcode does about what is unusual in a source, one sentence each (recorded, joined
    by "; ", in `SourceMedia.handling` of `JobAccepted`; docs/media-corpus.md explains each). Pure."""
    notes = []
    if audio_s is not None and abs(audio_s - video_s) > STREAM_LENGTH_NOTE_S:
        longer = "audio" if audio_s > video_s else "video"
        notes.append(f"streams differ in length (video {video_s:.3f} s, audio {audio_s:.3f} s): kept both as they "
                     f"are, the {longer} plays on alone")
    if abs(video_start_s - audio_start_s) > STREAM_LENGTH_NOTE_S and audio is not None:
        notes.append(f"streams start apart (video at {video_start_s:.3f} s, audio at {audio_start_s:.3f} s): "
                     "the offset is kept")
    if file_start_s > 0.001:
        notes.append(f"timestamps start at {file_start_s:.3f} s: shifted to start at 0")
    real, average = _ratio(video.get("r_frame_rate")), _ratio(video.get("avg_frame_rate"))
    if real and average and abs(average / real - 1) > 0.01:
        notes.append(f"variable frame rate (average {average:.3f} fps, base {real:.3f} fps): every frame kept at "
                     "its own time")
    if str(video.get("field_order")) in INTERLACED_FIELD_ORDERS:
        notes.append(f"interlaced (field order {video.get('field_order')}): deinterlaced with bwdif, one frame per frame")
    pix_fmt = str(video.get("pix_fmt") or "")
    if pix_fmt and pix_fmt != "yuv420p" and pix_fmt != "yuvj420p":
        notes.append(f"pixel format {pix_fmt}: converted to 8-bit yuv420p")
    if audio_count > 1 and audio is not None:
        notes.append(f"{audio_count} audio tracks: encoded stream {audio.get('index')} (the default track, else the "
                     "first); the others are not used")
    rate = _count(audio.get("sample_rate")) if audio else None
    if rate and rate > MAX_AUDIO_RATE_HZ:
        notes.append(f"audio sampled at {rate} Hz: resampled to {MAX_AUDIO_RATE_HZ} Hz")
    return notes


def interpret_probe(info: dict) -> Probe:
    """Turn ffprobe's JSON (`-show_format -show_streams`, optionally `-count_packets`) into a `Probe`.

    Pure; every value from the file is treated as untrusted. Raises `UnsupportedMedia` when there is
    no video stream (audio-only, image), `InvalidInput` when the video stream has no picture size or
    the source has no duration, or the packets read fall short of what the index lists (truncated).
    """
    streams = _dicts(info.get("streams"))
    fmt = info.get("format") if isinstance(info.get("format"), dict) else {}

    def is_picture(s: dict) -> bool:
        disposition = s.get("disposition") if isinstance(s.get("disposition"), dict) else {}
        return s.get("codec_type") == "video" and not disposition.get("attached_pic")

    video = next((s for s in streams if is_picture(s)), None)
    audio = choose_audio(streams)
    if video is None:
        what = "audio only" if audio is not None else "no video stream"
        raise UnsupportedMedia(f"{what}: uploads without a video stream are not processed")
    width, height = _count(video.get("width")) or 0, _count(video.get("height")) or 0
    if width <= 0 or height <= 0 or width > 65536 or height > 65536:
        raise InvalidInput("the video stream has no valid picture size")
    duration = stream_duration(video, fmt) or 0.0
    if duration <= 0:
        raise InvalidInput("the source has no duration")
    listed, read = _count(video.get("nb_frames")), _count(video.get("nb_read_packets"))
    if listed is not None and read is not None and read < listed - max(1, listed // 100):
        raise InvalidInput(f"truncated: the index lists {listed} video frames but the file holds only {read}")
    avg_fps = _ratio(video.get("avg_frame_rate"))
    if listed is not None and avg_fps and listed > round(duration * avg_fps) + 1:
        listed = int(round(duration * avg_fps))  # an edit list hides frames the index lists: they never decode
    sar = _ratio(video.get("sample_aspect_ratio")) or 1.0
    if not 0.01 <= sar <= 100:
        sar = 1.0
    display_w, display_h = width * sar, float(height)
    rotation = _rotation(video)
    if rotation in (90, 270):
        display_w, display_h = display_h, display_w
    fps = _ratio(video.get("avg_frame_rate")) or _ratio(video.get("r_frame_rate"))
    frames = listed if listed is not None else (int(round(duration * fps)) if fps and duration * fps < 1e12 else None)
    bit_rate = _count(fmt.get("bit_rate"))
    audio_s = stream_duration(audio, fmt) if audio else None
    starts = [t for t in (_number(s.get("start_time")) for s in streams) if t is not None]
    file_start = _number(fmt.get("start_time"))
    file_start = min(starts) if file_start is None and starts else (file_start or 0.0)
    video_start = max(0.0, (_number(video.get("start_time")) or file_start) - file_start)
    audio_start = max(0.0, (_number(audio.get("start_time")) or file_start) - file_start) if audio else 0.0
    media = SourceMedia(
        format_name=str(fmt.get("format_name") or "unknown"), duration_s=duration, width=width, height=height,
        display_width=max(1, int(round(display_w))), display_height=max(1, int(round(display_h))),
        rotation=rotation, fps=fps, frames=frames, video_codec=str(video.get("codec_name") or "unknown"),
        audio_codec=str(audio.get("codec_name") or "unknown") if audio else None,
        bit_rate_bps=bit_rate if bit_rate is not None and bit_rate < 2**62 else None,
        audio_duration_s=audio_s, handling="; ".join(source_handling(
            video, audio, sum(1 for s in streams if s.get("codec_type") == "audio"), duration, audio_s,
            video_start, audio_start, file_start)) or None)
    index = _count(video.get("index"))
    audio_index = _count(audio.get("index")) if audio else None
    real = _ratio(video.get("r_frame_rate"))
    return Probe(media=media, video_stream=index if index is not None else 0,
                 audio_stream=audio_index if audio is not None and audio_index is not None else None,
                 encoder_frame_rate=encoder_frame_rate_of(video), video_start_s=video_start,
                 audio_start_s=audio_start, audio_duration_s=audio_s,
                 deinterlace=str(video.get("field_order")) in INTERLACED_FIELD_ORDERS,
                 audio_sample_rate=_count(audio.get("sample_rate")) if audio else None,
                 variable_frame_rate=bool(real and avg_fps and abs(avg_fps / real - 1) > 0.01))


def inspect_source(path: Path, *, count_packets: bool = True, timeout_s: float = 300.0) -> Probe:
    """Probe a local source file, refusing playlists and containers not in `ALLOWED_CONTAINERS`.

    The file's first bytes are checked for playlists before ffprobe runs; ffprobe itself runs with
    `-format_whitelist ALLOWED_CONTAINERS -protocol_whitelist file`, so it opens no other file or URL.
    `count_packets` reads every packet (no decoding) to find sources cut short of their index.
    Raises `InvalidInput` (unreadable, truncated, a playlist), `UnsupportedMedia` (no video) and
    `LimitsExceeded` (probing ran longer than `timeout_s` seconds).
    """
    with open(path, "rb") as fh:
        kind = sniff_playlist(fh.read(64))
    if kind is not None:
        raise InvalidInput(f"not a readable video: the upload is {kind}, a text file naming other files or URLs; "
                           "upload the media file itself")
    args = ["-format_whitelist", ALLOWED_CONTAINERS, "-protocol_whitelist", "file",
            "-show_format", "-show_streams", *(["-count_packets"] if count_packets else []), str(path)]
    info, stderr = _run_probe(args, timeout_s)
    if count_packets and "partial file" in stderr:
        raise InvalidInput("truncated: the index points past the end of the file (upload cut short?)")
    return interpret_probe(info)


def probe_source(path: Path) -> SourceMedia:
    """The `SourceMedia` summary of a local source (`inspect_source(path).media`); same errors."""
    return inspect_source(path).media


def check_limits(media: SourceMedia, settings: Settings, size_bytes: int | None = None) -> None:
    """Pre-flight limits on a probed source: picture size, duration and bitrate. Pure.

    Bitrate is the container's (bit/s), or `size_bytes * 8 / duration` when the container states
    none. Raises `LimitsExceeded` naming the first limit passed, its setting and both values.
    """
    pixels = media.width * media.height
    if pixels > settings.max_source_pixels:
        raise LimitsExceeded(f"picture size {media.width}x{media.height} = {pixels} pixels exceeds the limit "
                             f"max_source_pixels = {settings.max_source_pixels}")
    if media.duration_s > settings.max_source_duration_s:
        raise LimitsExceeded(f"duration {media.duration_s:.1f} s exceeds the limit "
                             f"max_source_duration_s = {settings.max_source_duration_s:g} s")
    bit_rate = media.bit_rate_bps
    if bit_rate is None and size_bytes is not None and media.duration_s > 0:
        bit_rate = int(size_bytes * 8 / media.duration_s)
    if bit_rate is not None and bit_rate > settings.max_source_bitrate_kbps * 1000:
        raise LimitsExceeded(f"bitrate {bit_rate // 1000} kbit/s exceeds the limit "
                             f"max_source_bitrate_kbps = {settings.max_source_bitrate_kbps}")


def _even(value: float) -> int:
    """`value` rounded to the nearest even integer, at least 2."""
    return max(2, int(round(value / 2)) * 2)


def _even_floor(value: float) -> int:
    """`value` rounded down to an even integer, at least 2 (never above `value` when it is >= 2)."""
    return max(2, int(value) // 2 * 2)


def plan_ladder(media: SourceMedia, heights: tuple[int, ...]) -> list[Rendition]:
    """The renditions for a source: every rung at or below its display height, never upscaled.

    Sizes are display sizes (sample aspect ratio and rotation applied): widths keep the display
    aspect ratio and every width and height is even; a source smaller than the lowest rung gets one
    rendition at its own size rounded down to even. Largest first.
    """
    aspect = media.display_width / media.display_height
    widest = _even_floor(media.display_width)
    rungs = [h for h in sorted(set(heights), reverse=True) if h % 2 == 0 and 2 <= h <= media.display_height]
    ladder = [Rendition(name=f"{h}p", width=min(_even(h * aspect), widest), height=h,
                        video_bitrate_kbps=VIDEO_BITRATE_KBPS.get(h, max(200, h * 4))) for h in rungs]
    if not ladder:
        h = _even_floor(media.display_height)
        ladder = [Rendition(name=f"{h}p", width=widest, height=h, video_bitrate_kbps=VIDEO_BITRATE_KBPS[240])]
    return ladder


def build_hls_command(source: Path, out_dir: Path, ladder: list[Rendition], *, video_stream: int,
                      audio_stream: int | None, segment_s: float, preset: str) -> list[str]:
    """ffmpeg arguments encoding the whole ladder in one pass: one decode, split and scaled per rung.

    Follows the streams that exist: video from stream `video_stream` (absolute index, as in
    `Probe`), audio from `audio_stream` or none when it is None. The input is read only with a
    demuxer from `ALLOWED_CONTAINERS` and only through the `file` protocol. ffmpeg's default
    autorotate turns rotated sources upright before scaling, so each rung's size (a display size,
    see `plan_ladder`) is the stored size of its frames, with square pixels.
    Video: H.264, keyframes forced every `segment_s` seconds in every rendition (aligned across the
    ladder), no scene-cut keyframes. Audio: AAC encoded once per job into its own HLS rendition.
    Writes `out_dir/<rendition>/index.m3u8` + `seg_00000.ts`..., and `out_dir/audio/index.m3u8`.
    """
    src = ffmpeg.input(str(source), protocol_whitelist="file", format_whitelist=ALLOWED_CONTAINERS)
    split = src[str(video_stream)].filter_multi_output("split", len(ladder))
    outputs = []
    hls = {"f": "hls", "hls_time": f"{segment_s:g}", "hls_playlist_type": "vod", "hls_list_size": 0,
           "protocol_whitelist": "file"}
    for index, rung in enumerate(ladder):
        (out_dir / rung.name).mkdir(parents=True, exist_ok=True)
        video = split.stream(index).filter("scale", rung.width, rung.height).filter("setsar", 1)
        outputs.append(ffmpeg.output(video, str(out_dir / rung.name / "index.m3u8"), **{
            "c:v": "libx264", "preset": preset, "profile:v": "high", "pix_fmt": "yuv420p",
            "b:v": f"{rung.video_bitrate_kbps}k", "maxrate": f"{int(rung.video_bitrate_kbps * 1.07)}k",
            "bufsize": f"{rung.video_bitrate_kbps * 2}k",
            "force_key_frames": f"expr:gte(t,n_forced*{segment_s:g})", "sc_threshold": 0,
            "hls_segment_filename": str(out_dir / rung.name / "seg_%05d.ts"), **hls}))
    if audio_stream is not None:
        (out_dir / "audio").mkdir(parents=True, exist_ok=True)
        outputs.append(ffmpeg.output(src[str(audio_stream)], str(out_dir / "audio" / "index.m3u8"), **{
            "c:a": "aac", "b:a": f"{AUDIO_BITRATE_KBPS}k", "ac": 2,
            "hls_segment_filename": str(out_dir / "audio" / "seg_%05d.ts"), **hls}))
    stream = ffmpeg.merge_outputs(*outputs).global_args(
        "-hide_banner", "-nostdin", "-loglevel", "error", "-nostats", "-progress", "pipe:1")
    return stream.overwrite_output().compile()


@dataclass(frozen=True)
class Progress:
    """One `-progress` block: frames encoded, media time reached (s), speed (x realtime)."""

    frames: int
    out_time_s: float
    speed: float | None
    ended: bool


@dataclass(frozen=True)
class FfmpegResult:
    """How an ffmpeg run ended: exit code (negative: killed by that signal), the last lines of
    stderr, the last progress block, wall-clock seconds, and whether the wall-clock limit stopped it."""

    returncode: int
    stderr_tail: str
    last_progress: Progress | None
    elapsed_s: float
    timed_out: bool = False


def keyframe_before(path: Path, time_s: float, stream: int | None = None, timeout_s: float = 60.0) -> float | None:
    """Presentation time (s) of the video keyframe at or before `time_s`: where an accurate seek to
    `time_s` starts decoding. Reads one packet after ffprobe's own seek (`-read_intervals T%+#1`,
    which lands on the keyframe before T); no decoding. `stream`: the absolute stream index (default:
    the first video stream). None when ffprobe cannot tell (no index, an error)."""
    selector = str(stream) if stream is not None else "v:0"
    try:
        done = subprocess.run(["ffprobe", "-v", "error", "-protocol_whitelist", "file", "-read_intervals",
                               f"{max(0.0, time_s):.6f}%+#1", "-select_streams", selector, "-show_entries",
                               "packet=pts_time,flags", "-of", "json", str(path)],
                              capture_output=True, text=True, timeout=timeout_s, check=False)
        packets = _dicts(json.loads(done.stdout or "{}").get("packets"))
    except (subprocess.TimeoutExpired, json.JSONDecodeError, OSError):
        return None
    if done.returncode != 0 or not packets or "K" not in str(packets[0].get("flags", "")):
        return None
    return _number(packets[0].get("pts_time"))


def wall_clock_limit_s(duration_s: float, settings: Settings) -> float:
    """How long one transcode's ffmpeg may run, in seconds: `ffmpeg_timeout_s` plus
    `ffmpeg_timeout_factor` seconds per second of source media."""
    return settings.ffmpeg_timeout_s + settings.ffmpeg_timeout_factor * max(0.0, duration_s)


def run_ffmpeg(args: list[str], *, on_progress: Callable[[Progress], None] | None = None,
               on_tick: Callable[[], None] | None = None, should_stop: Callable[[], bool] | None = None,
               tick_s: float = 1.0, timeout_s: float | None = None) -> FfmpegResult:
    """Run ffmpeg, reading `-progress` from stdout and draining stderr in a thread.

    `on_tick` runs about every `tick_s` seconds on this thread, whether or not ffmpeg advances (the
    caller heartbeats there); `should_stop()` returning True terminates ffmpeg. After `timeout_s`
    seconds of wall-clock time ffmpeg is terminated and the result says `timed_out` (stalls without
    progress are the watchdog's business; this bounds a run that progresses too slowly). Returns the
    exit code, the last lines of stderr and the last progress block; raises only what the callbacks raise.
    """
    started = time.monotonic()
    deadline = started + timeout_s if timeout_s is not None else None
    timed_out = False
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=_die_with_parent)
    tail: deque[str] = deque(maxlen=40)
    drain = threading.Thread(target=lambda: [tail.append(line.decode(errors="replace").rstrip())
                                             for line in iter(proc.stderr.readline, b"")], daemon=True)
    drain.start()
    block: dict[str, str] = {}
    last: Progress | None = None
    buffer = b""
    next_tick = time.monotonic() + tick_s
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    key, _, value = raw.decode(errors="replace").strip().partition("=")
                    block[key] = value
                    if key == "progress":
                        last = _parse_progress(block)
                        block = {}
                        if on_progress:
                            on_progress(last)
            if on_tick and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + tick_s
                on_tick()
            if should_stop and should_stop():
                _stop(proc)
                break
            if deadline is not None and time.monotonic() >= deadline:
                timed_out = True
                _stop(proc)
                break
        proc.wait()
    except BaseException:
        _stop(proc)
        raise
    finally:
        drain.join(timeout=5)
    return FfmpegResult(proc.returncode, "\n".join(tail), last, time.monotonic() - started, timed_out)


def ffmpeg_failure(result: FfmpegResult, timeout_s: float | None = None) -> TapelineError | None:
    """The classified error of a finished ffmpeg run, or None when it succeeded. Pure.

    Wall-clock limit reached -> `TranscodeTimeout` (class `timeout`); killed by SIGKILL (the OOM
    killer, or a memory limit) -> `TranscodeFailed` of class `out_of_memory`; any other non-zero
    exit -> `TranscodeFailed` (class `unknown`) with ffmpeg's last stderr line, unless stderr says
    the source uses something ffmpeg cannot decode (`UNSUPPORTED_MARKERS`): then `UnsupportedMedia`,
    not retried, since every attempt would fail the same way.
    """
    if result.timed_out:
        limit = f"{timeout_s:g} s" if timeout_s is not None else "its limit"
        reached = result.last_progress.out_time_s if result.last_progress else 0.0
        return TranscodeTimeout(f"ffmpeg ran longer than the wall-clock limit ({limit}); stopped at "
                                f"{reached:.1f} s of media")
    if result.returncode == 0:
        return None
    last_line = result.stderr_tail.splitlines()[-1] if result.stderr_tail else "no message"
    unsupported = next((line for line in result.stderr_tail.splitlines()
                        if any(marker in line for marker in UNSUPPORTED_MARKERS)), None)
    if unsupported is not None:
        return UnsupportedMedia(f"ffmpeg cannot process this source: {unsupported.split('] ', 1)[-1].strip()}")
    error = TranscodeFailed(f"ffmpeg exited with {result.returncode}: {last_line}")
    if result.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL):
        error.error_class = "out_of_memory"
    return error


UNSUPPORTED_MARKERS = ("is not implemented", "not yet implemented", "not found for input stream", "Unsupported codec",
                       "unsupported codec", "Unknown decoder", "Unsupported bit depth")
"""ffmpeg stderr phrases of a feature it lacks (libavcodec's `avpriv_report_missing_feature` prints
"... is not implemented. Update your FFmpeg version ..."; fftools prints "Decoder (codec X) not
found"): deterministic, so the attempt fails as `unsupported_media` at once."""


def _die_with_parent() -> None:
    """In the ffmpeg child: ask Linux to SIGKILL it when the worker dies (prctl PR_SET_PDEATHSIG),
    so a worker killed with SIGKILL never leaves an orphan encode running."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


def _stop(proc: subprocess.Popen) -> None:
    """Terminate ffmpeg (its whole process group), then kill it after 5 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        os.killpg(proc.pid, signal.SIGCONT)  # a stopped (hung) ffmpeg must wake up to handle SIGTERM
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def _parse_progress(block: dict[str, str]) -> Progress:
    def number(key: str) -> float | None:
        try:
            return float(block[key].rstrip("x"))
        except (KeyError, ValueError):
            return None
    # ffmpeg 5.1: out_time_ms is in microseconds despite its name (local-services.md); prefer out_time_us.
    micros = number("out_time_us") or number("out_time_ms") or 0.0
    return Progress(frames=int(number("frame") or 0), out_time_s=max(0.0, micros / 1e6),
                    speed=number("speed"), ended=block.get("progress") == "end")


def probe_duration(path: Path) -> float:
    """Duration in seconds of one of our own local outputs (an HLS media playlist or a file); 0.0
    when ffprobe states none. Raises `InvalidInput` when ffprobe cannot read it."""
    info, _ = _run_probe(["-protocol_whitelist", "file", "-show_entries", "format=duration", str(path)])
    fmt = info.get("format")
    return (_number(fmt.get("duration")) if isinstance(fmt, dict) else None) or 0.0


def verify_outputs(out_dir: Path, ladder: list[Rendition], media: SourceMedia, has_audio: bool,
                   tolerance_s: float) -> None:
    """Check the encode before trusting it: every playlist exists, is non-empty, ends, and lasts as
    long as the source's probe promised (within `tolerance_s`).

    Raises `TranscodeFailed` naming the first rendition that is incomplete, `OutputMismatch` (not
    retried) for one whose duration is not its source stream's (`media.duration_s`, the video's).
    """
    names = [r.name for r in ladder] + (["audio"] if has_audio else [])
    for name in names:
        playlist = out_dir / name / "index.m3u8"
        if not playlist.is_file() or playlist.stat().st_size == 0:
            raise TranscodeFailed(f"rendition {name}: playlist missing or empty")
        text = playlist.read_text()
        if "#EXT-X-ENDLIST" not in text:
            raise TranscodeFailed(f"rendition {name}: playlist has no end marker")
        segments = [line for line in text.splitlines() if line and not line.startswith("#")]
        if not segments or any((out_dir / name / seg).stat().st_size == 0 for seg in segments):
            raise TranscodeFailed(f"rendition {name}: a segment is missing or empty")
        if name == "audio":
            continue
        try:
            duration = probe_duration(playlist)
        except InvalidInput as exc:  # our own output, not the source, is unreadable
            raise TranscodeFailed(f"rendition {name}: {exc}") from exc
        if abs(duration - media.duration_s) > tolerance_s:
            raise OutputMismatch(f"rendition {name}: {duration:.3f} s long, its source stream "
                                 f"{media.duration_s:.3f} s (a source that decodes short?)")

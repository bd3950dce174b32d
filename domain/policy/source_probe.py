"""What a source is: ffprobe's answer about it, interpreted. Pure (no process is run here).

`interpret_probe` turns ffprobe's JSON (`-show_format -show_streams -count_packets`) into a `Probe`
(the `SourceMedia` recorded in `JobAccepted`, the streams used and how the encode treats them),
treating every value from the file as untrusted; `sniff_playlist` refuses text playlists by their
first bytes. Running ffprobe is `processors/media.py` (`inspect_source`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from domain.errors import InvalidInput, UnsupportedMedia
from domain.events import SourceMedia

ALLOWED_CONTAINERS = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,mpegts,flv,mpeg"
"""ffmpeg demuxers a source may be read with. Playlists (hls, concat) are refused: they name other
files and URLs (local-services.md: a text playlist saved as .mp4 is detected as HLS)."""


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


def _ratio(text: Any) -> float:
    """A ffprobe ratio ("25/1", "1:1") as a float; 0.0 when absent, undefined or not finite."""
    num, _, den = str(text or "").replace(":", "/").partition("/")
    try:
        value = float(num) / float(den or 1)
    except (ValueError, ZeroDivisionError, OverflowError):
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


def as_number(value: Any) -> float | None:
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


def as_dicts(value: Any) -> list[dict]:
    """The dict items of a JSON list (anything else: none)."""
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _rotation(stream: dict) -> int:
    """Display rotation of a video stream in degrees, 0..359 (display matrix first, then the old
    `rotate` tag). Angles that are not a multiple of 90 are ignored, as ffmpeg's autorotate does."""
    candidates = [side.get("rotation") for side in as_dicts(stream.get("side_data_list"))]
    tags = stream.get("tags")
    candidates.append(tags.get("rotate") if isinstance(tags, dict) else None)
    for value in candidates:
        degrees = as_number(value)
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
    between frames is no gap in our encode (`segment_plan.check_rendition`'s `max_gap_s`)."""


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
    for value in (as_number(stream.get("duration")), _clock(tags.get("DURATION"))):
        if value is not None and value > 0:
            return value
    value = as_number(fmt.get("duration"))
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
    streams = as_dicts(info.get("streams"))
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
    starts = [t for t in (as_number(s.get("start_time")) for s in streams) if t is not None]
    file_start = as_number(fmt.get("start_time"))
    file_start = min(starts) if file_start is None and starts else (file_start or 0.0)
    video_start = max(0.0, (as_number(video.get("start_time")) or file_start) - file_start)
    audio_start = max(0.0, (as_number(audio.get("start_time")) or file_start) - file_start) if audio else 0.0
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

"""What an encode will do, planned before ffmpeg runs. Pure (no process is run here).

The pre-flight limits on a probed source (`check_limits`), the ladder of renditions
(`plan_ladder`: never upscaled, even sizes, display aspect kept), the one-pass HLS command line
(`build_hls_command`, built with ffmpeg-python), the wall-clock limit of a run
(`wall_clock_limit_s`) and its memory, CPU-time, temp-disk and open-file limits (`ffmpeg_limits`).
Segmented encoding and resume are `processors/segments.py`; running ffmpeg is `processors/media.py`
(`run_ffmpeg`).
"""

from __future__ import annotations

from pathlib import Path

import ffmpeg

from domain.errors import LimitsExceeded
from domain.events import Rendition, SourceMedia
from domain.policy.ffmpeg_limits import FfmpegLimits, Rung, attempt_limits, expected_frames
from domain.policy.source_probe import ALLOWED_CONTAINERS
from tapeline.settings import Settings

VIDEO_BITRATE_KBPS = {1080: 5000, 720: 2800, 480: 1400, 360: 800, 240: 400}
"""H.264 bitrate per rung height, kbit/s (in the range of Apple's HLS authoring spec ladder)."""
AUDIO_BITRATE_KBPS = 128


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
            **rung_video_options(rung, preset),
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


def rung_video_options(rung: Rendition, preset: str) -> dict[str, str]:
    """ffmpeg output options of one rung's H.264 video, the same in the single-pass HLS encode and the
    checkpointed segment encode (processors/segments.py): x264 `preset`, High profile, 8-bit 4:2:0,
    the rung's bitrate (kb/s) capped at +7 % with a two-second buffer."""
    kbps = rung.video_bitrate_kbps
    return {"c:v": "libx264", "preset": preset, "profile:v": "high", "pix_fmt": "yuv420p", "b:v": f"{kbps}k",
            "maxrate": f"{int(kbps * 1.07)}k", "bufsize": f"{kbps * 2}k"}


def ffmpeg_limits(media: SourceMedia, ladder: list[Rendition], source_bytes: int, has_audio: bool, settings: Settings,
                  cpus: int = 1) -> FfmpegLimits:
    """The limits of one transcode's ffmpeg (`domain.policy.ffmpeg_limits.attempt_limits`) for the
    probed source `media` stored in `source_bytes` bytes, encoding `ladder` (and the audio at
    `AUDIO_BITRATE_KBPS` when `has_audio`) with `cpus` processors (frames: `expected_frames`). Pure."""
    frames = expected_frames(media.frames, media.duration_s, media.fps)
    rungs = [Rung(pixels=r.width * r.height, video_kbps=r.video_bitrate_kbps) for r in ladder]
    return attempt_limits(settings, source_pixels=media.width * media.height, frames=frames,
                          duration_s=media.duration_s, rungs=rungs, source_bytes=source_bytes,
                          audio_kbps=AUDIO_BITRATE_KBPS if has_audio else 0, cpus=cpus)


def wall_clock_limit_s(duration_s: float, settings: Settings) -> float:
    """How long one transcode's ffmpeg may run, in seconds: `ffmpeg_timeout_s` plus
    `ffmpeg_timeout_factor` seconds per second of source media."""
    return settings.ffmpeg_timeout_s + settings.ffmpeg_timeout_factor * max(0.0, duration_s)

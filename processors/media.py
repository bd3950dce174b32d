"""The media pipeline: probe a source, plan its ladder, run ffmpeg with progress, check the result.

ffmpeg command lines are built with ffmpeg-python; the process itself is run and supervised here so
its `-progress` output and stderr are always read (a full pipe never hangs the worker).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import ffmpeg

from schemas.models import Rendition, SourceMedia
from tapeline.errors import InvalidInput, TranscodeFailed, UnsupportedMedia

ALLOWED_CONTAINERS = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,mpegts,flv,mpeg"
"""ffmpeg demuxers a source may be read with. Playlists (hls, concat) are refused: they name other
files and URLs (local-services.md: a text playlist saved as .mp4 is detected as HLS)."""

VIDEO_BITRATE_KBPS = {1080: 5000, 720: 2800, 480: 1400, 360: 800, 240: 400}
"""H.264 bitrate per rung height, kbit/s (in the range of Apple's HLS authoring spec ladder)."""
AUDIO_BITRATE_KBPS = 128


def _run_probe(args: list[str], timeout_s: float = 60.0) -> dict:
    try:
        done = subprocess.run(["ffprobe", "-v", "error", "-print_format", "json", *args],
                              capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise InvalidInput(f"ffprobe took longer than {timeout_s:.0f} s") from exc
    if done.returncode != 0:
        message = done.stderr.decode(errors="replace").strip().splitlines()
        raise InvalidInput(f"not a readable video: {message[-1] if message else 'ffprobe failed'}")
    return json.loads(done.stdout or b"{}")


def _ratio(text: str | None) -> float:
    """A ffprobe ratio ("25/1", "1:1") as a float; 0.0 when absent or undefined."""
    num, _, den = (text or "").replace(":", "/").partition("/")
    try:
        return float(num) / float(den or 1)
    except (ValueError, ZeroDivisionError):
        return 0.0


def _rotation(stream: dict) -> int:
    for side in stream.get("side_data_list", []) or []:
        if "rotation" in side:
            return int(round(float(side["rotation"]))) % 360
    return int(stream.get("tags", {}).get("rotate", 0) or 0) % 360


def probe_source(path: Path) -> SourceMedia:
    """Probe a local source file, allowing only `ALLOWED_CONTAINERS` and local-file reads.

    Raises `InvalidInput` when ffprobe cannot read it or it has no duration, `UnsupportedMedia`
    when it has no video stream.
    """
    info = _run_probe(["-format_whitelist", ALLOWED_CONTAINERS, "-protocol_whitelist", "file",
                       "-show_format", "-show_streams", str(path)])
    streams = info.get("streams", [])
    video = next((s for s in streams if s.get("codec_type") == "video"
                  and not s.get("disposition", {}).get("attached_pic")), None)
    audio = next((s for s in streams if s.get("codec_type") == "audio"), None)
    fmt = info.get("format", {})
    if video is None:
        raise UnsupportedMedia("no video stream (audio-only and image uploads are not processed)")
    width, height = int(video.get("width") or 0), int(video.get("height") or 0)
    if width <= 0 or height <= 0:
        raise InvalidInput("video stream has no picture size")
    duration = float(video.get("duration") or fmt.get("duration") or 0.0)
    if duration <= 0:
        raise InvalidInput("source has no duration")
    sar = _ratio(video.get("sample_aspect_ratio")) or 1.0
    display_w, display_h = width * sar, float(height)
    rotation = _rotation(video)
    if rotation in (90, 270):
        display_w, display_h = display_h, display_w
    fps = _ratio(video.get("avg_frame_rate")) or _ratio(video.get("r_frame_rate"))
    frames = int(video["nb_frames"]) if str(video.get("nb_frames", "")).isdigit() else (
        int(round(duration * fps)) if fps else None)
    return SourceMedia(
        format_name=fmt.get("format_name", "unknown"), duration_s=duration, width=width, height=height,
        display_width=int(round(display_w)), display_height=int(round(display_h)), rotation=rotation,
        fps=fps, frames=frames, video_codec=video.get("codec_name", "unknown"),
        audio_codec=audio.get("codec_name") if audio else None,
        bit_rate_bps=int(fmt["bit_rate"]) if str(fmt.get("bit_rate", "")).isdigit() else None)


def _even(value: float) -> int:
    return max(2, int(round(value / 2)) * 2)


def plan_ladder(media: SourceMedia, heights: tuple[int, ...]) -> list[Rendition]:
    """The renditions for a source: every rung at or below its display height, never upscaled.

    Widths keep the display aspect ratio and are even; a source smaller than the lowest rung gets
    one rendition at its own (even-rounded) size. Largest first.
    """
    aspect = media.display_width / media.display_height
    rungs = [h for h in sorted(heights, reverse=True)
             if h <= media.display_height and _even(h * aspect) <= _even(media.display_width)]
    ladder = [Rendition(name=f"{h}p", width=_even(h * aspect), height=h,
                        video_bitrate_kbps=VIDEO_BITRATE_KBPS.get(h, max(200, h * 4))) for h in rungs]
    if not ladder:
        h = _even(media.display_height) if media.display_height >= 2 else 2
        ladder = [Rendition(name=f"{h}p", width=_even(media.display_width), height=h,
                            video_bitrate_kbps=VIDEO_BITRATE_KBPS[240])]
    return ladder


def build_hls_command(source: Path, out_dir: Path, ladder: list[Rendition], has_audio: bool,
                      segment_s: float, preset: str) -> list[str]:
    """ffmpeg arguments encoding the whole ladder in one pass: one decode, split and scaled per rung.

    Video: H.264, keyframes forced every `segment_s` seconds in every rendition (aligned across the
    ladder), no scene-cut keyframes. Audio: AAC encoded once per job into its own HLS rendition.
    Writes `out_dir/<rendition>/index.m3u8` + `seg_00000.ts`..., and `out_dir/audio/index.m3u8`.
    """
    src = ffmpeg.input(str(source), protocol_whitelist="file", format_whitelist=ALLOWED_CONTAINERS)
    split = src.video.filter_multi_output("split", len(ladder))
    outputs = []
    hls = {"f": "hls", "hls_time": f"{segment_s:g}", "hls_playlist_type": "vod", "hls_list_size": 0}
    for index, rung in enumerate(ladder):
        (out_dir / rung.name).mkdir(parents=True, exist_ok=True)
        video = split.stream(index).filter("scale", rung.width, rung.height).filter("setsar", 1)
        outputs.append(ffmpeg.output(video, str(out_dir / rung.name / "index.m3u8"), **{
            "c:v": "libx264", "preset": preset, "profile:v": "high", "pix_fmt": "yuv420p",
            "b:v": f"{rung.video_bitrate_kbps}k", "maxrate": f"{int(rung.video_bitrate_kbps * 1.07)}k",
            "bufsize": f"{rung.video_bitrate_kbps * 2}k",
            "force_key_frames": f"expr:gte(t,n_forced*{segment_s:g})", "sc_threshold": 0,
            "hls_segment_filename": str(out_dir / rung.name / "seg_%05d.ts"), **hls}))
    if has_audio:
        (out_dir / "audio").mkdir(parents=True, exist_ok=True)
        outputs.append(ffmpeg.output(src.audio, str(out_dir / "audio" / "index.m3u8"), **{
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
    returncode: int
    stderr_tail: str
    last_progress: Progress | None
    elapsed_s: float


def run_ffmpeg(args: list[str], *, on_progress: Callable[[Progress], None] | None = None,
               on_tick: Callable[[], None] | None = None, should_stop: Callable[[], bool] | None = None,
               tick_s: float = 1.0) -> FfmpegResult:
    """Run ffmpeg, reading `-progress` from stdout and draining stderr in a thread.

    `on_tick` runs about every `tick_s` seconds on this thread, whether or not ffmpeg advances (the
    caller heartbeats there); `should_stop()` returning True terminates ffmpeg. Returns the exit
    code, the last lines of stderr and the last progress block.
    """
    started = time.monotonic()
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
        proc.wait()
    except BaseException:
        _stop(proc)
        raise
    finally:
        drain.join(timeout=5)
    return FfmpegResult(proc.returncode, "\n".join(tail), last, time.monotonic() - started)


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
    """Duration in seconds of one of our own outputs (an HLS media playlist or a file)."""
    info = _run_probe(["-protocol_whitelist", "file,http,tcp", "-show_entries", "format=duration", str(path)])
    return float(info.get("format", {}).get("duration") or 0.0)


def verify_outputs(out_dir: Path, ladder: list[Rendition], media: SourceMedia, has_audio: bool,
                   tolerance_s: float) -> None:
    """Check the encode before trusting it: every playlist exists, is non-empty, ends, and lasts as
    long as the source's probe promised (within `tolerance_s`).

    Raises `TranscodeFailed` naming the first rendition that does not match.
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
        duration = probe_duration(playlist)
        if abs(duration - media.duration_s) > tolerance_s:
            raise TranscodeFailed(f"rendition {name}: {duration:.3f} s long, source promised "
                                  f"{media.duration_s:.3f} s (a source that decodes short?)")

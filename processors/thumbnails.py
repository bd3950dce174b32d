"""Thumbnails: a claimed work item -> a poster JPEG, a storyboard sprite sheet and a WebVTT
thumbnails track, written beside the job's HLS outputs (publish promotes them to
`published/{job_id}/thumbnails/`).

A stage of the registry (`domain/pipeline.py`, declared optional: a degraded job skips it). What it
makes, all from the job's source (`item.source_key`), under the attempt's prefix
`work/{job_id}/thumbnails/{attempt}/thumbnails/`:

- `storyboard.jpg`: one tile every `interval_s` seconds of media (tile `t` shows the frame at
  `t * interval`), `tile_width` pixels wide (height by the display aspect, even), `columns` tiles
  per row, at most `max_tiles` tiles (a longer source widens the interval to duration / max_tiles);
  a clip shorter than the interval gets one tile;
- `storyboard.vtt`: a WebVTT track with one cue per tile, `storyboard.jpg#xywh=x,y,w,h` (the media
  fragment video.js, Plyr and JW Player read for scrubbing previews), the cues back to back from 0
  to the media's whole duration;
- `poster.jpg`: the frame at the storyboard tile with the highest luma variance (the variance of
  the 8-bit grey levels of the tile scaled to 64x36): a black, blank or fade frame has almost none,
  so it is never chosen while any other tile exists; at most `poster_width` pixels wide.

One ffmpeg pass decodes the source once for the sprite and the small grey tiles (heartbeats from
its progress, media seconds decoded); a second one cuts the poster. `AttemptSucceeded` names the
three objects with their sha256; the next stage (publish) gets them beside the transcode outputs.
Crash points: the generic `thumbnails.claim.*`, `thumbnails.Heartbeat.*`,
`thumbnails.AttemptSucceeded.*`, and `thumbnails.before_upload` / `thumbnails.after_upload`.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import structlog

from domain import events as ev
from domain.errors import TranscodeFailed
from domain.policy.ffmpeg_limits import FfmpegLimits, Rung, attempt_limits, expected_frames
from processors import media
from processors.runtime import Outgoing
from processors.worker import Attempt, StageWorker, Yielded
from tapeline.crashpoints import crash_point
from tapeline.objects import attempt_prefix
from tapeline.ports import MediaTool, ObjectStorage
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.thumbnails")

STAGE = "thumbnails"
GREY_W, GREY_H = 64, 36
"""Size of the grey copy of each tile the poster is chosen by (luma variance)."""
BLANK_VARIANCE = 20.0
"""Luma variance (8-bit levels squared) below which a tile counts as blank (black, a flat colour, a fade)."""


@dataclass(frozen=True)
class Options:
    """The stage's options (`settings.stage_options["thumbnails"]`, these defaults otherwise):
    `interval_s` seconds of media per storyboard tile; `tile_width` pixels; `columns` tiles per
    sprite row; `max_tiles` per storyboard; `poster_width` the poster's largest width in pixels."""

    interval_s: float = 2.0
    tile_width: int = 160
    columns: int = 10
    max_tiles: int = 100
    poster_width: int = 1280

    @classmethod
    def of(cls, settings: Settings) -> "Options":
        """The options of `settings`. Raises `ValueError` for an unknown option or a value out of range."""
        given: Mapping[str, Any] = settings.stage_options.get(STAGE, {})
        unknown = set(given) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown thumbnails options {sorted(unknown)}")
        options = cls(**{k: type(getattr(cls, k))(v) for k, v in given.items()})
        if options.interval_s <= 0 or min(options.tile_width, options.columns, options.max_tiles,
                                          options.poster_width) < 1:
            raise ValueError(f"thumbnails options out of range: {options}")
        return options


@dataclass(frozen=True)
class Storyboard:
    """The storyboard's plan: `count` tiles of `tile_w` x `tile_h` pixels, `columns` per row,
    `rows` rows (the sprite is `columns * tile_w` x `rows * tile_h`), one per `interval_s` seconds
    of a `duration_s`-second source."""

    count: int
    interval_s: float
    tile_w: int
    tile_h: int
    columns: int
    rows: int
    duration_s: float

    @property
    def sprite_size(self) -> tuple[int, int]:
        return self.columns * self.tile_w, self.rows * self.tile_h

    def tile_xywh(self, index: int) -> tuple[int, int, int, int]:
        """(x, y, w, h) of tile `index` (0-based, row by row) in the sprite, pixels."""
        return (index % self.columns) * self.tile_w, (index // self.columns) * self.tile_h, self.tile_w, self.tile_h

    def cue_times(self, index: int) -> tuple[float, float]:
        """(start, end) seconds of tile `index`'s cue: back to back, the last ends at the duration."""
        start = index * self.interval_s
        end = self.duration_s if index == self.count - 1 else (index + 1) * self.interval_s
        return start, end


def plan_storyboard(duration_s: float, display_w: int, display_h: int, options: Options) -> Storyboard:
    """The storyboard of a `duration_s`-second source shown at `display_w` x `display_h`. Pure.

    Tiles every `options.interval_s` seconds (wider for a source longer than `max_tiles` intervals),
    at least one; the tile height keeps the display aspect, rounded to an even number of pixels.
    Raises `ValueError` for a duration that is not positive and finite."""
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError(f"no storyboard for a duration of {duration_s} s")
    interval = max(options.interval_s, duration_s / options.max_tiles)
    count = max(1, math.ceil(duration_s / interval - 1e-9))
    tile_h = max(2, 2 * round(options.tile_width * display_h / max(1, display_w) / 2))
    columns = min(options.columns, count)
    return Storyboard(count=count, interval_s=interval, tile_w=options.tile_width, tile_h=tile_h, columns=columns,
                      rows=math.ceil(count / columns), duration_s=duration_s)


def _timestamp(seconds: float) -> str:
    millis = round(seconds * 1000)
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    return f"{hours:02d}:{minutes:02d}:{rest // 1000:02d}.{rest % 1000:03d}"


def webvtt(board: Storyboard, sprite_name: str = "storyboard.jpg") -> str:
    """The WebVTT thumbnails track of `board`: one cue per tile, `sprite_name#xywh=x,y,w,h`. Pure."""
    lines = ["WEBVTT", ""]
    for index in range(board.count):
        start, end = board.cue_times(index)
        x, y, w, h = board.tile_xywh(index)
        lines += [f"{_timestamp(start)} --> {_timestamp(end)}", f"{sprite_name}#xywh={x},{y},{w},{h}", ""]
    return "\n".join(lines)


def luma_variance(grey: bytes) -> float:
    """Variance of 8-bit grey levels (levels squared); 0 for no pixels. Pure."""
    if not grey:
        return 0.0
    n = len(grey)
    mean = sum(grey) / n
    return sum((v - mean) ** 2 for v in grey) / n


def choose_poster(greys: list[bytes]) -> tuple[int, float]:
    """(index, variance) of the tile the poster is cut from: the highest luma variance (the first
    of equals). Pure. Raises `ValueError` for no tiles."""
    if not greys:
        raise ValueError("no tiles to choose a poster from")
    variances = [luma_variance(g) for g in greys]
    best = max(range(len(variances)), key=lambda i: (variances[i], -i))
    return best, variances[best]


def sprite_command(source: Path, board: Storyboard, sprite: Path, greys: Path, video_stream: int) -> list[str]:
    """ffmpeg: one decode of `source` into the sprite (JPEG) and the tiles' grey copies (raw 8-bit). Pure."""
    graph = (f"[0:{video_stream}]fps=fps={1 / board.interval_s:.6f}:round=down:eof_action=pass,split=2[t][g];"
             f"[t]scale={board.tile_w}:{board.tile_h},setsar=1,tile={board.columns}x{board.rows}[sprite];"
             f"[g]scale={GREY_W}:{GREY_H},format=gray[grey]")
    return ["ffmpeg", "-hide_banner", "-nostdin", "-y", "-protocol_whitelist", "file", "-progress", "pipe:1",
            "-nostats", "-i", str(source), "-filter_complex", graph,
            "-map", "[sprite]", "-frames:v", "1", "-q:v", "4", str(sprite),
            "-map", "[grey]", "-frames:v", str(board.count), "-f", "rawvideo", str(greys)]


def poster_command(source: Path, at_s: float, poster: Path, width: int, video_stream: int,
                   decode_through: bool = False) -> list[str]:
    """ffmpeg: the frame at `at_s` seconds as a JPEG at most `width` pixels wide. Pure.

    It seeks the input (fast: from the keyframe before `at_s`); with `decode_through` it decodes from
    the start and drops frames before `at_s` (slower, but it finds the frame where an input seek
    finds none: seen with MPEG-TS whose timestamps start at 11 s, where `-ss` before `-i` made no
    frame at all)."""
    seek = ["-ss", f"{at_s:.3f}"]
    return ["ffmpeg", "-hide_banner", "-nostdin", "-y", "-protocol_whitelist", "file", "-progress", "pipe:1",
            "-nostats", *([] if decode_through else seek), "-i", str(source), *(seek if decode_through else []),
            "-map", f"0:{video_stream}", "-frames:v", "1", "-update", "1",
            "-vf", f"scale='min({width},iw)':-2,setsar=1", "-q:v", "3", str(poster)]


def step_limits(found: ev.SourceMedia, board: Storyboard, source_bytes: int, settings: Settings,
                cpus: int = 1) -> FfmpegLimits:
    """The limits of this stage's ffmpeg runs (`domain.policy.ffmpeg_limits.attempt_limits`, the
    transcode's rule): the sprite counted as one rung of its own size with no bitrate (its outputs
    are a JPEG and the small grey tiles; frames: `expected_frames`). Pure."""
    width, height = board.sprite_size
    return attempt_limits(settings, source_pixels=found.width * found.height,
                          frames=expected_frames(found.frames, found.duration_s, found.fps),
                          duration_s=found.duration_s, rungs=[Rung(pixels=width * height, video_kbps=0)],
                          source_bytes=source_bytes, cpus=cpus)


class ThumbnailsWorker(StageWorker):
    """The `thumbnails` stage (see the module's docstring)."""

    stage = STAGE

    def __init__(self, settings: Settings, *, media: MediaTool, **adapters: Any) -> None:
        """`media`: ffprobe and ffmpeg (`MediaTool`); `adapters`: `StageWorker`'s."""
        super().__init__(settings, **adapters)
        self.media = media
        self.options = Options.of(settings)

    def run_step(self, attempt: Attempt, command: list[str], duration_s: float, frames_total: int | None,
                 limits: FfmpegLimits | None = None, temp_dir: Path | None = None) -> None:
        """Run one ffmpeg `command`, heartbeating its progress (media seconds decoded), within
        `limits` (`temp_dir`: the attempt's temp directory, measured against them). Raises
        `Yielded` on SIGTERM, the classified ffmpeg failure otherwise (`media.ffmpeg_failure`:
        `LimitsExceeded` past a limit)."""
        latest: list[media.Progress | None] = [None]
        tool: list = [None]  # what the worker last saw of its ffmpeg (`media.ToolWatch`): heartbeats carry it

        def tick() -> None:
            p = latest[0]
            attempt.heartbeat(p.frames if p else 0, min(duration_s, p.out_time_s) if p else 0.0,
                              p.speed if p else None, frames_total, tool_state=tool[0])

        def progressed(p: media.Progress) -> None:
            latest[0] = p
            self.health.record_progress(p.frames, p.out_time_s, p.speed)

        limit_s = max(60.0, duration_s * 4)
        result = self.media.run_ffmpeg(command, on_progress=progressed, on_tick=tick, should_stop=self.stop.is_set,
                                       tick_s=min(0.25, self.settings.heartbeat_s / 4), timeout_s=limit_s,
                                       limits=limits, temp_dir=temp_dir, on_sample=lambda state: tool.__setitem__(0, state))
        if self.stop.is_set() and result.returncode != 0:
            raise Yielded("worker shutting down (SIGTERM) while making thumbnails")
        failure = media.ffmpeg_failure(result, limit_s)
        if failure is not None:
            raise failure

    def work(self, attempt: Attempt, store: ObjectStorage) -> list[Outgoing]:
        item, identity, settings = attempt.item, attempt.identity, self.settings
        prefix = attempt_prefix(identity.job_id, STAGE, identity.attempt) + f"{STAGE}/"
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="tapeline-thumbnails-") as tmp:
            source, sprite, greys, poster, track = (Path(tmp) / n for n in
                                                    ("source", "storyboard.jpg", "tiles.grey", "poster.jpg",
                                                     "storyboard.vtt"))
            with attempt.keepalive(0, 0.0, None):
                store.download(item.source_key, source)
                probe = self.media.inspect_source(source, count_packets=False, timeout_s=settings.probe_timeout_s)
            found = probe.media
            duration = item.media_duration_s or found.duration_s
            board = plan_storyboard(duration, found.display_width, found.display_height, self.options)
            limits = step_limits(found, board, source.stat().st_size, settings, len(os.sched_getaffinity(0)))
            self.run_step(attempt, sprite_command(source, board, sprite, greys, probe.video_stream), duration,
                          found.frames, limits, Path(tmp))
            raw = greys.read_bytes() if greys.exists() else b""
            tiles = [raw[i:i + GREY_W * GREY_H] for i in range(0, len(raw) - GREY_W * GREY_H + 1, GREY_W * GREY_H)]
            if not sprite.exists() or not tiles:
                raise TranscodeFailed(f"ffmpeg made no storyboard for {item.source_key}")
            best, variance = choose_poster(tiles[:board.count])
            at_s = min(best * board.interval_s, max(0.0, duration - 0.05))
            for decode_through in (False, True):  # an input seek first; decoding through where it found no frame
                self.run_step(attempt, poster_command(source, at_s, poster, self.options.poster_width,
                                                      probe.video_stream, decode_through), duration, found.frames,
                              limits, Path(tmp))
                if poster.exists() and poster.stat().st_size > 0:
                    break
            if not poster.exists() or poster.stat().st_size == 0:
                raise TranscodeFailed(f"ffmpeg made no poster at {at_s:.3f} s of {item.source_key}")
            track.write_text(webvtt(board), encoding="utf-8")
            outputs = []
            with attempt.keepalive(found.frames or 0, duration, found.frames):
                crash_point("thumbnails.before_upload")
                for path, content_type in ((poster, "image/jpeg"), (sprite, "image/jpeg"), (track, "text/vtt")):
                    sha, size = store.upload_file(path, prefix + path.name, content_type)
                    outputs.append(ev.OutputFile(key=prefix + path.name, sha256=sha, size_bytes=size,
                                                 content_type=content_type))
                crash_point("thumbnails.after_upload")
        log.info("thumbnails made", job_id=identity.job_id, tiles=board.count, interval_s=board.interval_s,
                 poster_at_s=round(at_s, 3), poster_variance=round(variance, 1),
                 blank_poster=variance < BLANK_VARIANCE)
        return [(settings.jobs_topic, attempt.event(ev.AttemptSucceeded, outputs=outputs, renditions=[],
                                                    media_duration_s=duration,
                                                    elapsed_s=round(time.monotonic() - started, 3)))] + \
            self.hand_on(attempt, inputs=list(item.inputs) + outputs, renditions=list(item.renditions),
                         audio_playlist_key=item.audio_playlist_key, media_duration_s=duration)

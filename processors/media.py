"""The media processes: run ffprobe and ffmpeg, supervise them, classify how they ended, check
the outputs.

Each process is run and supervised here so its `-progress` output and stderr are always read (a
full pipe never hangs the worker). What ffprobe's answer means is `domain/policy/source_probe.py`;
the ladder, the limits and the ffmpeg command are planned in `processors/encode_plan.py`. Their
names are importable from here too (`media.plan_ladder`, `media.Probe`, ...), as callers always did.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from domain.events import Rendition, SourceMedia, ToolState
from domain.policy.ffmpeg_limits import FfmpegLimits, FfmpegMeasures, crossed_limit, rlimits, temp_disk_crossed
from domain.errors import (InvalidInput, LimitsExceeded, OutputMismatch, TapelineError, TranscodeFailed, TranscodeTimeout,
                             UnsupportedMedia)
from processors.encode_plan import (AUDIO_BITRATE_KBPS, VIDEO_BITRATE_KBPS, build_hls_command, check_limits,
                                    ffmpeg_limits, plan_ladder, wall_clock_limit_s)
from domain.policy.source_probe import (ALLOWED_CONTAINERS, INTERLACED_FIELD_ORDERS, MAX_AUDIO_RATE_HZ,
                                     PLAYLIST_SIGNATURES, STREAM_LENGTH_NOTE_S, Probe, choose_audio,
                                     encoder_frame_rate_of, interpret_probe, sniff_playlist, source_handling,
                                     stream_duration, as_dicts, as_number)

__all__ = [  # this module's own names and the pure ones it re-exports
    "ALLOWED_CONTAINERS", "AUDIO_BITRATE_KBPS", "INTERLACED_FIELD_ORDERS", "MAX_AUDIO_RATE_HZ", "PLAYLIST_SIGNATURES",
    "STREAM_LENGTH_NOTE_S", "UNSUPPORTED_MARKERS", "VIDEO_BITRATE_KBPS", "FfmpegResult", "Probe", "Progress", "ToolWatch",
    "build_hls_command", "check_limits", "choose_audio", "encoder_frame_rate_of", "ffmpeg_failure", "ffmpeg_limits",
    "inspect_source",
    "interpret_probe", "keyframe_before", "plan_ladder", "probe_duration", "probe_source", "run_ffmpeg",
    "sniff_playlist", "source_handling", "stream_duration", "verify_outputs", "wall_clock_limit_s"]


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


class FfmpegTool:
    """The `MediaTool` port (`tapeline/ports.py`) over this module's ffprobe and ffmpeg runs."""

    def inspect_source(self, path: Path, *, count_packets: bool = True, timeout_s: float = 300.0) -> Probe:
        """`inspect_source`."""
        return inspect_source(path, count_packets=count_packets, timeout_s=timeout_s)

    def keyframe_before(self, path: Path, time_s: float, stream: int | None = None,
                        timeout_s: float = 60.0) -> float | None:
        """`keyframe_before`."""
        return keyframe_before(path, time_s, stream, timeout_s=timeout_s)

    def run_ffmpeg(self, args: list[str], *, on_progress: Callable[[Progress], None] | None = None,
                   on_tick: Callable[[], None] | None = None, should_stop: Callable[[], bool] | None = None,
                   tick_s: float = 1.0, timeout_s: float | None = None, limits: FfmpegLimits | None = None,
                   temp_dir: Path | None = None, on_sample: Callable[[ToolState], None] | None = None) -> FfmpegResult:
        """`run_ffmpeg`."""
        return run_ffmpeg(args, on_progress=on_progress, on_tick=on_tick, should_stop=should_stop, tick_s=tick_s,
                          timeout_s=timeout_s, limits=limits, temp_dir=temp_dir, on_sample=on_sample)

    def verify_outputs(self, out_dir: Path, ladder: list[Rendition], media: SourceMedia, has_audio: bool,
                       tolerance_s: float) -> None:
        """`verify_outputs`."""
        verify_outputs(out_dir, ladder, media, has_audio, tolerance_s)


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
    stderr, the last progress block, wall-clock seconds, and whether the wall-clock limit stopped it;
    with `limits`, the limits it ran under and what was measured (`measured`)."""

    returncode: int
    stderr_tail: str
    last_progress: Progress | None
    elapsed_s: float
    timed_out: bool = False
    limits: FfmpegLimits | None = None
    measured: FfmpegMeasures | None = None


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
        packets = as_dicts(json.loads(done.stdout or "{}").get("packets"))
    except (subprocess.TimeoutExpired, json.JSONDecodeError, OSError):
        return None
    if done.returncode != 0 or not packets or "K" not in str(packets[0].get("flags", "")):
        return None
    return as_number(packets[0].get("pts_time"))


def run_ffmpeg(args: list[str], *, on_progress: Callable[[Progress], None] | None = None,
               on_tick: Callable[[], None] | None = None, should_stop: Callable[[], bool] | None = None,
               tick_s: float = 1.0, timeout_s: float | None = None, limits: FfmpegLimits | None = None,
               temp_dir: Path | None = None, on_sample: Callable[[ToolState], None] | None = None) -> FfmpegResult:
    """Run ffmpeg, reading `-progress` from stdout and draining stderr in a thread.

    `on_tick` runs about every `tick_s` seconds on this thread, whether or not ffmpeg advances (the
    caller heartbeats there); just before it, `on_sample` gets what `ToolWatch` sees of the process
    (its state, its CPU time since its counters last moved, at most the last minute, its last
    progress line and stderr lines): the tool state the caller's heartbeats carry. `should_stop()`
    returning True terminates ffmpeg. After `timeout_s`
    seconds of wall-clock time ffmpeg is terminated and the result says `timed_out` (stalls without
    progress are the watchdog's business; this bounds a run that progresses too slowly). Returns the
    exit code, the last lines of stderr and the last progress block; raises only what the callbacks raise.

    With `limits` (`domain.policy.ffmpeg_limits.attempt_limits`) the child runs under their rlimits
    (set between fork and exec, so the worker's own limits never change, and with `MALLOC_ARENA_MAX`
    = `MALLOC_ARENAS` so glibc's per-thread arenas do not fill the address space limit with
    reservations); its CPU time, address space and descriptors are sampled from `/proc` on every
    pass of the loop (at most 0.2 s apart, 0.05 s in the first second; the CPU time once more when
    it has exited, before it is reaped), and `temp_dir` (the attempt's temp directory) is measured
    every `TEMP_DISK_CHECK_S` seconds: past the temp-disk limit (`temp_disk_crossed`) ffmpeg is
    killed at once (SIGKILL). The result carries the limits and the measurements; `ffmpeg_failure` says
    which limit was crossed.
    """
    started = time.monotonic()
    deadline = started + timeout_s if timeout_s is not None else None
    timed_out = False
    pairs = rlimits(limits) if limits is not None else {}
    env = {**os.environ, "MALLOC_ARENA_MAX": str(MALLOC_ARENAS)} if "RLIMIT_AS" in pairs else None
    before = _Usage.files(temp_dir) if limits is not None and temp_dir is not None else {}
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env=env, preexec_fn=lambda: _child_setup(pairs))
    tail: deque[str] = deque(maxlen=40)
    drain = threading.Thread(target=lambda: [tail.append(line.decode(errors="replace").rstrip())
                                             for line in iter(proc.stderr.readline, b"")], daemon=True)
    drain.start()
    block: dict[str, str] = {}
    last: Progress | None = None
    buffer = b""
    next_tick = time.monotonic() + tick_s
    watch = _Usage(proc.pid, temp_dir, before) if limits is not None else None
    tool = ToolWatch(proc.pid, os.path.basename(args[0]) if args else "ffmpeg") if on_sample is not None else None
    next_disk = time.monotonic()
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    try:
        while True:
            # Limits crossed at start-up (an allocation, a file) end ffmpeg within a fraction of a
            # second: the first second is sampled more often.
            wait_s = 0.05 if watch is not None and time.monotonic() - started < 1.0 else 0.2
            ready, _, _ = select.select([fd], [], [], wait_s)
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
                        if tool is not None:
                            tool.progressed(block)
                        block = {}
                        if on_progress:
                            on_progress(last)
            if watch is not None:
                watch.sample()
                if time.monotonic() >= next_disk:
                    next_disk = time.monotonic() + TEMP_DISK_CHECK_S
                    if limits is not None and temp_disk_crossed(watch.measure_disk(), limits):
                        _kill(proc)  # not SIGTERM: a clean stop flushes every output, writing more
                        break
            if tool is not None:
                tool.sample()
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + tick_s
                if on_sample is not None and tool is not None:
                    on_sample(tool.state(tail))
                if on_tick:
                    on_tick()
            if should_stop and should_stop():
                _stop(proc)
                break
            if deadline is not None and time.monotonic() >= deadline:
                timed_out = True
                _stop(proc)
                break
        if watch is not None:
            watch.exited()
        proc.wait()
    except BaseException:
        _stop(proc)
        raise
    finally:
        drain.join(timeout=5)
    stderr_tail = "\n".join(tail)
    measured = None
    if watch is not None:
        watch.measure_disk()
        measured = FfmpegMeasures(returncode=proc.returncode, stderr_tail=stderr_tail, cpu_s=watch.cpu_s,
                                  peak_memory_bytes=watch.peak_memory_bytes, peak_open_files=watch.peak_open_files,
                                  temp_disk_bytes=watch.temp_disk_bytes, largest_file_bytes=watch.largest_file_bytes)
    return FfmpegResult(proc.returncode, stderr_tail, last, time.monotonic() - started, timed_out, limits, measured)


TEMP_DISK_CHECK_S = 0.5
"""How often `run_ffmpeg` measures the attempt's temp directory, seconds. What ffmpeg writes between
two measurements can pass the temp-disk limit (its outputs are bitrate-capped: a few MB per second
at most; and no single file can outgrow RLIMIT_FSIZE)."""

MALLOC_ARENAS = 2
"""`MALLOC_ARENA_MAX` of an ffmpeg under an address-space limit: glibc otherwise reserves a 64 MiB
arena per thread, up to 8 per CPU, which counts against RLIMIT_AS without being used (measured:
1011 MiB of address space for a four-rung 720p encode with the default, 884 MiB with 2, the same
CPU time)."""


class ToolWatch:
    """What one tool process (`pid`, named `tool`) is doing, for the heartbeats' `ToolState`
    (issue 45 item 2): its state letter from `/proc/<pid>/stat` (field 3; of all its threads, the
    stopped state first, then running, then waiting on I/O: `process_state`), its CPU time (utime +
    stime, every thread) and the time its threads waited for a CPU while runnable (field 2 of each
    `/proc/<pid>/task/<tid>/schedstat`), sampled at most every `SAMPLE_S` seconds over the last
    `WINDOW_S` seconds. The window starts when its progress counters last moved (`progressed`), so
    a stall's figures are what it used without output. A read that fails (the process is gone)
    keeps the last values."""

    WINDOW_S = 60.0
    SAMPLE_S = 1.0
    TICKS = os.sysconf("SC_CLK_TCK")

    def __init__(self, pid: int, tool: str = "ffmpeg") -> None:
        self.pid, self.tool = pid, tool
        self.samples: deque[tuple[float, float, float | None]] = deque()  # (monotonic s, CPU s, CPU wait s)
        self.moved_at = time.monotonic()  # when the progress counters last moved
        self.counters: tuple[str | None, str | None] | None = None
        self.last_line: str | None = None
        self.letter: str | None = None
        self.last_state: tuple[float, ToolState] | None = None  # (monotonic s, what `state` gave)

    def progressed(self, block: dict[str, str]) -> None:
        """One `-progress` block (key -> value): the last progress line; the window restarts when
        its counters (frame, out_time_us) moved."""
        counters = (block.get("frame"), block.get("out_time_us") or block.get("out_time_ms"))
        if counters != self.counters:
            self.counters, self.moved_at = counters, time.monotonic()
        shown = ("frame", "fps", "out_time", "speed", "total_size", "progress")
        self.last_line = " ".join(f"{k}={block[k].strip()}" for k in shown if k in block)

    @staticmethod
    def _stat(path: str) -> list[str] | None:
        try:
            return Path(path).read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None

    def _tasks(self) -> list[str]:
        try:
            return os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return []

    def _cpu_wait_s(self) -> float | None:
        """Seconds all its threads spent runnable but waiting for a CPU (schedstat), None when unknown."""
        total, read = 0, False
        for task in self._tasks():
            try:
                total += int(Path(f"/proc/{self.pid}/task/{task}/schedstat").read_text().split()[1])
                read = True
            except (OSError, IndexError, ValueError):
                continue
        return total / 1e9 if read else None

    def sample(self) -> None:
        """Read the CPU times, at most every `SAMPLE_S` seconds; samples older than the window go."""
        now = time.monotonic()
        if self.samples and now - self.samples[-1][0] < self.SAMPLE_S:
            return
        fields = self._stat(f"/proc/{self.pid}/stat")
        if fields is None:
            return
        self.letter = fields[0]
        self.samples.append((now, (int(fields[11]) + int(fields[12])) / self.TICKS, self._cpu_wait_s()))
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.WINDOW_S:
            self.samples.popleft()

    def process_state(self) -> str | None:
        """The process's state letter: T when it is stopped, else R when any thread runs, else D when
        any waits on I/O, else the main thread's (None: never read)."""
        main = self._stat(f"/proc/{self.pid}/stat")
        if main is None:
            return self.letter
        letters = {main[0]}
        if main[0] not in ("T", "t", "Z", "X"):
            for task in self._tasks():
                fields = self._stat(f"/proc/{self.pid}/task/{task}/stat")
                if fields is not None:
                    letters.add(fields[0])
        self.letter = next((letter for letter in ("T", "t", "Z", "X", "R", "D") if letter in letters), main[0])
        return self.letter

    def state(self, stderr_tail: "deque[str] | list[str]" = ()) -> ToolState:
        """The `ToolState` now: CPU seconds and CPU-wait seconds over the window (from the oldest
        sample at or after both the window's start and the counters' last move, to the newest), the
        last progress line and the last stderr lines (at most 5 lines, 500 characters). Read again
        at most every `SAMPLE_S` seconds (the threads' files are many); between, the last answer."""
        if self.last_state is not None and time.monotonic() - self.last_state[0] < self.SAMPLE_S:
            return self.last_state[1]
        self.sample()
        cpu_s = wait_s = window_s = None
        if self.samples:
            newest = self.samples[-1]
            start = max(newest[0] - self.WINDOW_S, self.moved_at)
            first = next((s for s in self.samples if s[0] >= start), newest)
            cpu_s, window_s = round(newest[1] - first[1], 3), round(newest[0] - first[0], 3)
            if newest[2] is not None and first[2] is not None:
                wait_s = round(max(0.0, newest[2] - first[2]), 3)
        lines = [line for line in list(stderr_tail)[-5:] if line]
        found = ToolState(tool=self.tool, process_state=self.process_state(), cpu_s=cpu_s, window_s=window_s,
                          last_progress=self.last_line, stderr_tail="\n".join(lines)[-500:] or None,
                          cpu_wait_s=wait_s)
        self.last_state = (time.monotonic(), found)
        return found


class _Usage:
    """Measurements of one ffmpeg process (`pid`) and of the attempt's temp directory, for
    `FfmpegMeasures`. Reads `/proc/<pid>/stat` (CPU clock ticks), `/proc/<pid>/status` (`VmPeak`,
    kB) and `/proc/<pid>/fd`; a read that fails (the process is gone) keeps the last value.
    `before`: the temp directory's files before the run (`files`): the largest
    file is looked for among the others, the ones ffmpeg wrote (not the source or reused segments)."""

    TICKS = os.sysconf("SC_CLK_TCK")

    def __init__(self, pid: int, temp_dir: Path | None, before: dict[str, tuple[int, int]]) -> None:
        self.pid, self.temp_dir, self.before = pid, temp_dir, before
        self.cpu_s: float | None = None
        self.peak_memory_bytes: int | None = None
        self.peak_open_files: int | None = None
        self.temp_disk_bytes: int | None = None
        self.largest_file_bytes: int | None = None

    def sample(self) -> None:
        self._cpu()
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
            opened = len(os.listdir(f"/proc/{self.pid}/fd"))
        except OSError:  # exited between two samples: the last values stand
            return
        for line in status.splitlines():
            if line.startswith("VmPeak:"):
                self.peak_memory_bytes = max(self.peak_memory_bytes or 0, int(line.split()[1]) * 1024)
        self.peak_open_files = max(self.peak_open_files or 0, opened)

    def _cpu(self) -> None:
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return
        self.cpu_s = (int(fields[11]) + int(fields[12])) / self.TICKS  # utime + stime, every thread

    def exited(self) -> None:
        """Wait until the process has exited without reaping it (`waitid` with `WNOWAIT`), then read
        its final CPU time: a zombie's `/proc/<pid>/stat` still holds it."""
        try:
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # already reaped (stopped by `_stop`): the last sample stands
            return
        self._cpu()

    def measure_disk(self) -> int | None:
        """The temp directory's total allocated bytes (every file, `st_blocks` x 512), and the
        largest file written or grown since the run started (its size); None without a directory."""
        if self.temp_dir is None:
            return None
        total = largest = 0
        for path, (size, allocated) in self.files(self.temp_dir).items():
            total += allocated
            if path not in self.before or self.before[path][0] != size:
                largest = max(largest, size)
        self.temp_disk_bytes = max(self.temp_disk_bytes or 0, total)
        self.largest_file_bytes = largest
        return total

    @staticmethod
    def files(directory: Path) -> dict[str, tuple[int, int]]:
        """Every file under `directory`: path -> (size, allocated bytes). A file removed while
        walking (a temporary file of ffmpeg's) is left out."""
        found: dict[str, tuple[int, int]] = {}
        for root, _, names in os.walk(directory):
            for name in names:
                path = os.path.join(root, name)
                try:
                    info = os.lstat(path)
                except FileNotFoundError:
                    continue
                found[path] = (info.st_size, info.st_blocks * 512)
        return found


def ffmpeg_failure(result: FfmpegResult, timeout_s: float | None = None) -> TapelineError | None:
    """The classified error of a finished ffmpeg run, or None when it succeeded. Pure.

    A limit of the run crossed (`domain.policy.ffmpeg_limits.crossed_limit` on its measurements) ->
    `LimitsExceeded` (class `limits_exceeded`, not retried) naming the limit, the measured value and
    the setting; checked first, since crossing one is what stopped or killed ffmpeg. Wall-clock limit reached -> `TranscodeTimeout` (class `timeout`); killed by SIGKILL (the OOM
    killer, or a memory limit) -> `TranscodeFailed` of class `out_of_memory`; any other non-zero
    exit -> `TranscodeFailed` (class `unknown`) with ffmpeg's last stderr line, unless stderr says
    the source uses something ffmpeg cannot decode (`UNSUPPORTED_MARKERS`): then `UnsupportedMedia`,
    not retried, since every attempt would fail the same way.
    """
    if result.limits is not None and result.measured is not None:
        crossed = crossed_limit(result.measured, result.limits)
        if crossed is not None:
            return LimitsExceeded(crossed.message)
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


def _child_setup(pairs: dict[str, tuple[int, int]]) -> None:
    """In the ffmpeg child, between fork and exec: `_die_with_parent`, then the rlimits `pairs`
    (`domain.policy.ffmpeg_limits.rlimits`), each kept within the worker's own hard limit (a
    process may not raise it). Only the child's limits change."""
    _die_with_parent()
    for name, (soft, hard) in pairs.items():
        which = getattr(resource, name)
        _, ceiling = resource.getrlimit(which)
        if ceiling != resource.RLIM_INFINITY:
            soft, hard = min(soft, ceiling), min(hard, ceiling)
        resource.setrlimit(which, (soft, hard))


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


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL ffmpeg's process group and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it had exited already: reaped below all the same
        pass
    proc.wait()


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
    return (as_number(fmt.get("duration")) if isinstance(fmt, dict) else None) or 0.0


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

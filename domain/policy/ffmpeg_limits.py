"""The limits of one ffmpeg run and which one it crossed. Pure (docs/media.md "ffmpeg within limits").

Two decisions, both taking their inputs and doing no I/O:

- `attempt_limits`: the memory (address space), CPU-time, temp-disk, per-file and open-file limits
  of one run, from the settings and the source (pixels x frames x rungs). A limit set explicitly
  (`ffmpeg_memory_bytes`, `ffmpeg_cpu_s`, `ffmpeg_temp_disk_bytes`, `ffmpeg_file_bytes`,
  `ffmpeg_open_files`) is used as it is; unset, it is derived from the source with the formula of
  its docstring. `rlimits` turns them into the (soft, hard) pairs the adapter applies in the child.
- `crossed_limit`: given how the run ended (exit status or signal, the tail of stderr) and what
  the adapter measured while it ran (CPU seconds, peak address space, open files, the attempt's
  temp-directory total, its largest file), which limit was crossed, with the measured value; None
  when the end is not a limit's (the caller classifies it as before: timeout, unsupported media,
  out of memory, unknown).

A crossed limit is `limits_exceeded` (`domain/policy/retry.py`: not retried, `JobFailed`): the
same source under the same limits crosses it again.

The process side (rlimits in the child, sampling `/proc`, measuring the temp directory, stopping
ffmpeg past the temp-disk limit) is `processors/media.py` `run_ffmpeg`.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Protocol

CPU_HARD_GRACE_S = 5
"""Seconds of CPU between the soft RLIMIT_CPU (SIGXCPU: ffmpeg stops cleanly, exit 255) and the hard
one (SIGKILL from the kernel): room to stop cleanly, and a bound when ffmpeg ignores the signal."""

TS_OVERHEAD_PER_FRAME_BYTES = 376
"""MPEG-TS bytes a frame costs beyond its payload, at most (a PES header and the padding of its
last 188-byte packet: two packets). It dominates the output of a high-frame-rate source of small,
nearly empty frames, which the bitrate alone would not foresee."""

CPU_TOLERANCE_S = 0.05
"""How far below the CPU limit a measured figure may be and still be the limit's: `/proc` counts CPU
in clock ticks (10 ms), the kernel checks RLIMIT_CPU on its exact runtime, so an ffmpeg that exits
at once on SIGXCPU can read a tick or two under its limit."""

MAXRATE_FACTOR = 1.07
"""A rung's peak bitrate over its nominal one (`processors/encode_plan.py` `rung_video_options`)."""

MEMORY_MARKERS = ("Cannot allocate memory", "Out of memory", "out of memory", "malloc of size",
                  "Resource temporarily unavailable")
"""ffmpeg stderr phrases of an allocation that failed: `av_strerror(ENOMEM)` is "Cannot allocate
memory"; x264 prints "malloc of size N failed"; a thread whose stack does not fit under RLIMIT_AS
fails `pthread_create` with EAGAIN, "Resource temporarily unavailable" (seen at 300 MB with a
four-rung 720p encode). Counted only when a memory limit was set and ffmpeg failed."""

MEMORY_CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS)
"""A library that does not check an allocation crashes instead of reporting it: such a death counts
as the memory limit when the sampled peak was within `MEMORY_CRASH_SHARE` of it."""
MEMORY_CRASH_SHARE = 0.9

OPEN_FILES_MARKER = "Too many open files"
"""strerror(EMFILE), what ffmpeg prints when an open fails under RLIMIT_NOFILE."""


class FfmpegLimitSettings(Protocol):
    """The settings `attempt_limits` reads (`tapeline.settings.Settings` has them; bytes, seconds)."""

    ffmpeg_memory_bytes: int | None
    ffmpeg_memory_base_bytes: int
    ffmpeg_memory_per_rung_bytes: int
    ffmpeg_memory_per_rung_per_cpu_bytes: int
    ffmpeg_memory_per_pixel_bytes: float
    ffmpeg_cpu_s: float | None
    ffmpeg_cpu_base_s: float
    ffmpeg_cpu_ns_per_pixel_frame: float
    ffmpeg_temp_disk_bytes: int | None
    ffmpeg_temp_disk_base_bytes: int
    ffmpeg_temp_disk_factor: float
    ffmpeg_file_bytes: int | None
    ffmpeg_open_files: int | None
    ffmpeg_open_files_base: int
    ffmpeg_open_files_per_rung: int


@dataclass(frozen=True)
class FfmpegLimits:
    """The limits of one ffmpeg run; None: not limited. `memory_bytes`: address space (RLIMIT_AS),
    bytes; `cpu_s`: CPU seconds, user + system, every thread (RLIMIT_CPU, whole seconds);
    `temp_disk_bytes`: the attempt's temp directory in all (measured); `file_bytes`: one file ffmpeg
    writes (RLIMIT_FSIZE); `open_files`: descriptors (RLIMIT_NOFILE). `explicit`: the limits set by
    their own setting rather than derived from the source (the message says which)."""

    memory_bytes: int | None = None
    cpu_s: int | None = None
    temp_disk_bytes: int | None = None
    file_bytes: int | None = None
    open_files: int | None = None
    explicit: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Rung:
    """One output rendition as the limits see it: pixels per frame and nominal bitrate (kbit/s)."""

    pixels: int
    video_kbps: int


def expected_frames(frames: int | None, duration_s: float, fps: float | None) -> int:
    """The frames a source decodes into, as the limits count them: the probe's count (`nb_frames`)
    when it states one, else duration (s) x frame rate (25 when unknown)."""
    return frames if frames else int(round(max(0.0, duration_s) * (fps or 25.0)))


def attempt_limits(settings: FfmpegLimitSettings, *, source_pixels: int, frames: int, duration_s: float,
                   rungs: list[Rung], source_bytes: int, audio_kbps: int = 0, cpus: int = 1) -> FfmpegLimits:
    """The limits of one ffmpeg run encoding `rungs` from a source of `source_pixels` (coded width x
    height) and `frames` frames (the probe's count, or duration x frame rate) lasting `duration_s`
    seconds, stored in `source_bytes` bytes inside the attempt's temp directory; `audio_kbps` of
    audio output (0: none); `cpus` the processors ffmpeg may use (its threads follow them).

    Unset limits are derived (pixel-frames = frames x (source pixels + the rungs' pixels): one
    decode, one scale and encode per rung):

    - memory = `ffmpeg_memory_base_bytes` + rungs x (`ffmpeg_memory_per_rung_bytes` +
      cpus x `ffmpeg_memory_per_rung_per_cpu_bytes`) + `ffmpeg_memory_per_pixel_bytes` x (source
      pixels + the rungs' pixels). Address space, not resident memory: thread stacks and malloc
      arenas count (measured here, 2 CPUs, veryfast: 430 MiB for one 144p rung, 884 MiB for 720p
      with four rungs, 1256 MiB for 1080p with five; the defaults give 645, 1272 and 1709 MiB);
    - CPU = `ffmpeg_cpu_base_s` + `ffmpeg_cpu_ns_per_pixel_frame` x pixel-frames / 1e9, rounded
      up (measured about 16 ns per pixel-frame at veryfast; the default 200 leaves room for slower
      presets and hosts);
    - temp disk = source bytes + `ffmpeg_temp_disk_base_bytes` + `ffmpeg_temp_disk_factor` x the
      expected output: duration x (each rung's peak bitrate + the audio's) plus
      `TS_OVERHEAD_PER_FRAME_BYTES` per frame per rung;
    - per file = the temp-disk limit (no file may hold the whole budget and more);
    - open files = `ffmpeg_open_files_base` + `ffmpeg_open_files_per_rung` x rungs (measured 16 with
      five rungs and audio).
    """
    count = max(1, len(rungs))
    rung_pixels = sum(r.pixels for r in rungs)
    explicit = set()
    memory = settings.ffmpeg_memory_bytes
    if memory is None:
        memory = int(settings.ffmpeg_memory_base_bytes
                     + count * (settings.ffmpeg_memory_per_rung_bytes
                                + max(1, cpus) * settings.ffmpeg_memory_per_rung_per_cpu_bytes)
                     + settings.ffmpeg_memory_per_pixel_bytes * (source_pixels + rung_pixels))
    else:
        explicit.add("memory")
    cpu = settings.ffmpeg_cpu_s
    if cpu is None:
        pixel_frames = max(0, frames) * (source_pixels + rung_pixels)
        cpu = settings.ffmpeg_cpu_base_s + settings.ffmpeg_cpu_ns_per_pixel_frame * pixel_frames / 1e9
    else:
        explicit.add("cpu_time")
    disk = settings.ffmpeg_temp_disk_bytes
    if disk is None:
        bytes_per_s = (sum(r.video_kbps for r in rungs) * MAXRATE_FACTOR + audio_kbps) * 1000 / 8
        expected = max(0.0, duration_s) * bytes_per_s + max(0, frames) * count * TS_OVERHEAD_PER_FRAME_BYTES
        disk = int(source_bytes + settings.ffmpeg_temp_disk_base_bytes + settings.ffmpeg_temp_disk_factor * expected)
    else:
        explicit.add("temp_disk")
    per_file = settings.ffmpeg_file_bytes
    if per_file is None:
        per_file = disk
    else:
        explicit.add("file_size")
    files = settings.ffmpeg_open_files
    if files is None:
        files = settings.ffmpeg_open_files_base + settings.ffmpeg_open_files_per_rung * count
    else:
        explicit.add("open_files")
    return FfmpegLimits(memory_bytes=memory, cpu_s=max(1, _ceil(cpu)), temp_disk_bytes=disk, file_bytes=per_file,
                        open_files=files, explicit=frozenset(explicit))


def _ceil(value: float) -> int:
    whole = int(value)
    return whole + 1 if whole < value else whole


def rlimits(limits: FfmpegLimits) -> dict[str, tuple[int, int]]:
    """The (soft, hard) pairs to set in the ffmpeg child, by `resource` constant name. RLIMIT_CPU's
    hard limit is `CPU_HARD_GRACE_S` above the soft one (SIGXCPU first, SIGKILL after); the others
    have soft = hard. The temp-disk total has no rlimit: the adapter measures it."""
    pairs: dict[str, tuple[int, int]] = {}
    if limits.memory_bytes is not None:
        pairs["RLIMIT_AS"] = (limits.memory_bytes, limits.memory_bytes)
    if limits.cpu_s is not None:
        pairs["RLIMIT_CPU"] = (limits.cpu_s, limits.cpu_s + CPU_HARD_GRACE_S)
    if limits.file_bytes is not None:
        pairs["RLIMIT_FSIZE"] = (limits.file_bytes, limits.file_bytes)
    if limits.open_files is not None:
        pairs["RLIMIT_NOFILE"] = (limits.open_files, limits.open_files)
    return pairs


@dataclass(frozen=True)
class FfmpegMeasures:
    """What the adapter saw of one run. `returncode`: the exit code, negative for the signal that
    killed it; `stderr_tail`: its last lines; `cpu_s`: CPU seconds used (user + system, read before
    the process is reaped, else the last sample); `peak_memory_bytes`: the largest address space
    sampled (`VmPeak`, every 0.2 s at most; None when no sample was taken); `peak_open_files`: the
    most descriptors sampled; `temp_disk_bytes`: the largest total of the attempt's temp directory
    measured (allocated bytes, including the source); `largest_file_bytes`: its largest file at the
    last measurement (after the run ended)."""

    returncode: int
    stderr_tail: str = ""
    cpu_s: float | None = None
    peak_memory_bytes: int | None = None
    peak_open_files: int | None = None
    temp_disk_bytes: int | None = None
    largest_file_bytes: int | None = None


@dataclass(frozen=True)
class LimitCrossed:
    """The limit a run crossed: its name (`memory`, `cpu_time`, `temp_disk`, `file_size`,
    `open_files`), its setting, the limit and the measured value (same unit: bytes, seconds or
    descriptors; measured None when nothing could be measured), and the sentence for `reason`."""

    limit: str
    setting: str
    allowed: float
    measured: float | None
    message: str


SETTINGS = {"memory": "ffmpeg_memory_bytes", "cpu_time": "ffmpeg_cpu_s", "temp_disk": "ffmpeg_temp_disk_bytes",
            "file_size": "ffmpeg_file_bytes", "open_files": "ffmpeg_open_files"}
"""Each limit's own setting (unset: derived from the source, `attempt_limits`)."""


def temp_disk_crossed(total_bytes: int | None, limits: FfmpegLimits) -> bool:
    """Whether a measured temp-directory total (bytes; None: not measured) is past the temp-disk
    limit: the adapter stops ffmpeg on it, `crossed_limit` names it."""
    return limits.temp_disk_bytes is not None and total_bytes is not None and total_bytes > limits.temp_disk_bytes


def crossed_limit(run: FfmpegMeasures, limits: FfmpegLimits) -> LimitCrossed | None:
    """Which limit the run crossed, or None. Pure. In this order (the first that holds):

    1. temp disk: the largest measured total is above `temp_disk_bytes` (the adapter stops ffmpeg
       when it sees that; a run that ended cleanly between two measurements crossed it too);
    2. file size: killed by SIGXFSZ (a write past RLIMIT_FSIZE), measured the largest file;
    3. CPU time: ended non-zero (SIGXCPU makes ffmpeg stop with 255, a fourth signal 123, the hard
       limit SIGKILL) having used at least `cpu_s` CPU seconds (less `CPU_TOLERANCE_S`);
    4. memory: ended non-zero with an allocation failure on stderr (`MEMORY_MARKERS`), or crashed
       (`MEMORY_CRASH_SIGNALS`) with a sampled peak within `MEMORY_CRASH_SHARE` of the limit;
    5. open files: ended non-zero with "Too many open files" on stderr.
    A limit that was not set is never crossed.
    """
    code = run.returncode
    if temp_disk_crossed(run.temp_disk_bytes, limits):
        return _crossed(limits, "temp_disk", limits.temp_disk_bytes, run.temp_disk_bytes,
                        "the attempt's temp directory held {measured} bytes, more than its limit {allowed} bytes")
    if limits.file_bytes is not None and code == -signal.SIGXFSZ:
        return _crossed(limits, "file_size", limits.file_bytes, run.largest_file_bytes,
                        "ffmpeg wrote a file up to {measured} bytes and was stopped at the per-file limit "
                        "{allowed} bytes (SIGXFSZ)")
    if code == 0:
        return None
    if limits.cpu_s is not None and run.cpu_s is not None and run.cpu_s >= limits.cpu_s - CPU_TOLERANCE_S:
        return _crossed(limits, "cpu_time", limits.cpu_s, round(run.cpu_s, 2),
                        "ffmpeg used {measured} s of CPU time, its limit is {allowed} s")
    stderr = run.stderr_tail
    if limits.memory_bytes is not None:
        marker = next((line.strip() for line in stderr.splitlines() if any(m in line for m in MEMORY_MARKERS)), None)
        crashed = -code in MEMORY_CRASH_SIGNALS and run.peak_memory_bytes is not None \
            and run.peak_memory_bytes >= MEMORY_CRASH_SHARE * limits.memory_bytes
        if marker is not None or crashed:
            why = f"an allocation failed ({marker})" if marker else f"it crashed with signal {-code}"
            return _crossed(limits, "memory", limits.memory_bytes, run.peak_memory_bytes,
                            "ffmpeg needed more address space than its limit {allowed} bytes: " + why
                            + "; largest address space sampled: {measured}")
    if limits.open_files is not None and OPEN_FILES_MARKER in stderr:
        return _crossed(limits, "open_files", limits.open_files, run.peak_open_files,
                        "ffmpeg could not open another file (Too many open files): its limit is {allowed} "
                        "descriptors; most descriptors sampled: {measured}")
    return None


def _crossed(limits: FfmpegLimits, limit: str, allowed: float, measured: float | None, text: str) -> LimitCrossed:
    setting = SETTINGS[limit]
    how = setting if limit in limits.explicit else f"derived from the source: {setting} is unset"
    shown = "none (it ended before the first sample)" if measured is None else f"{measured:g}" if isinstance(measured, float) else str(measured)
    message = f"{limit} limit exceeded: " + text.format(measured=shown, allowed=allowed) + f" ({how})"
    return LimitCrossed(limit, setting, allowed, measured, message)

"""The limits of one ffmpeg run and which one it crossed (domain/policy/ffmpeg_limits.py), pure:
derived defaults that follow the source, explicit settings used as they are, the rlimit pairs, and
the decision from an exit status or signal and the measurements."""

import signal

import pytest

from domain.policy import ffmpeg_limits as fl
from domain.policy.ffmpeg_limits import FfmpegLimits, FfmpegMeasures, Rung, attempt_limits, crossed_limit, rlimits
from domain.policy.retry import Action, RetryPolicy, retry_decision
from domain.events import SourceMedia
from processors.media import FfmpegResult, ffmpeg_failure, ffmpeg_limits, plan_ladder
from tapeline.settings import Settings

MiB = 1024**2
SETTINGS = Settings()
LADDER_720 = [Rung(1280 * 720, 2800), Rung(854 * 480, 1400), Rung(640 * 360, 800), Rung(426 * 240, 400)]


def limits_720(settings=SETTINGS, **overrides):
    figures = dict(source_pixels=1280 * 720, frames=132, duration_s=5.28, rungs=LADDER_720, source_bytes=1_055_736,
                   audio_kbps=128, cpus=2)
    return attempt_limits(settings, **{**figures, **overrides})


def test_the_derived_limits_follow_the_formulas_and_cover_what_a_real_encode_used():
    limits = limits_720()
    pixels = 1280 * 720 + sum(r.pixels for r in LADDER_720)
    assert limits.memory_bytes == int(512 * MiB + 4 * (64 * MiB + 2 * 32 * MiB) + 96 * pixels)
    assert limits.cpu_s == 129  # 60 s + 200 ns x 132 frames x 2.58 Mpx = 128.1 s, rounded up
    expected_output = 5.28 * ((2800 + 1400 + 800 + 400) * 1.07 + 128) * 125 + 132 * 4 * 376
    assert limits.temp_disk_bytes == int(1_055_736 + 64 * MiB + 2.0 * expected_output)
    assert limits.file_bytes == limits.temp_disk_bytes
    assert limits.open_files == 64 + 8 * 4
    assert limits.explicit == frozenset()
    # measured here (docs/media.md): 884 MiB of address space, 5.6 s of CPU, 3.5 MB of output, 14 descriptors
    assert limits.memory_bytes > 884 * MiB and limits.cpu_s > 5.6 and limits.temp_disk_bytes > 1_055_736 + 3_500_000
    assert limits.open_files > 14


@pytest.mark.parametrize("change,grows", [
    (dict(source_pixels=3840 * 2160), ("memory_bytes", "cpu_s")),
    (dict(frames=132 * 50), ("cpu_s", "temp_disk_bytes")),  # more frames: more CPU, more MPEG-TS overhead
    (dict(rungs=LADDER_720 + [Rung(1920 * 1080, 5000)]), ("memory_bytes", "cpu_s", "temp_disk_bytes", "open_files")),
    (dict(cpus=32), ("memory_bytes",)),
    (dict(duration_s=600.0), ("temp_disk_bytes",)),
    (dict(source_bytes=10**9), ("temp_disk_bytes", "file_bytes")),
])
def test_each_derived_limit_grows_with_the_source_figure_it_follows(change, grows):
    base, bigger = limits_720(), limits_720(**change)
    for name in ("memory_bytes", "cpu_s", "temp_disk_bytes", "file_bytes", "open_files"):
        if name in grows or (name == "file_bytes" and "temp_disk_bytes" in grows):
            assert getattr(bigger, name) > getattr(base, name), name
        else:
            assert getattr(bigger, name) == getattr(base, name), name


def test_explicit_settings_are_used_as_they_are_and_named_explicit():
    settings = SETTINGS.model_copy(update=dict(ffmpeg_memory_bytes=300 * MiB, ffmpeg_cpu_s=2.5,
                                               ffmpeg_temp_disk_bytes=5_000_000, ffmpeg_file_bytes=1_000_000,
                                               ffmpeg_open_files=12))
    limits = limits_720(settings)
    assert (limits.memory_bytes, limits.cpu_s, limits.temp_disk_bytes, limits.file_bytes, limits.open_files) == \
        (300 * MiB, 3, 5_000_000, 1_000_000, 12)  # CPU seconds are whole: rounded up
    assert limits.explicit == {"memory", "cpu_time", "temp_disk", "file_size", "open_files"}


def test_the_settings_read_the_limits_from_the_environment(monkeypatch):
    monkeypatch.setenv("TAPELINE_FFMPEG_CPU_S", "30")
    monkeypatch.setenv("TAPELINE_FFMPEG_MEMORY_PER_PIXEL_BYTES", "50")
    settings = Settings()
    assert settings.ffmpeg_cpu_s == 30.0 and settings.ffmpeg_memory_per_pixel_bytes == 50.0
    assert settings.ffmpeg_memory_bytes is None and settings.ffmpeg_temp_disk_bytes is None


def test_rlimits_give_cpu_a_hard_limit_above_the_soft_one():
    pairs = rlimits(FfmpegLimits(memory_bytes=10, cpu_s=3, temp_disk_bytes=99, file_bytes=7, open_files=20))
    assert pairs == {"RLIMIT_AS": (10, 10), "RLIMIT_CPU": (3, 3 + fl.CPU_HARD_GRACE_S), "RLIMIT_FSIZE": (7, 7),
                     "RLIMIT_NOFILE": (20, 20)}
    assert rlimits(FfmpegLimits()) == {}


def test_the_transcode_limits_take_the_probe_and_the_planned_ladder():
    source = SourceMedia(format_name="mov", duration_s=5.28, width=1280, height=720, display_width=1280,
                         display_height=720, rotation=0, fps=25.0, frames=132, video_codec="h264")
    ladder = plan_ladder(source, (1080, 720, 480, 360, 240))
    assert ffmpeg_limits(source, ladder, 1_055_736, True, SETTINGS, cpus=2) == limits_720()
    # no frame count in the probe (MPEG-TS): duration x frame rate
    assert ffmpeg_limits(source.model_copy(update={"frames": None}), ladder, 1_055_736, True, SETTINGS, cpus=2) == \
        limits_720()


LIMITS = FfmpegLimits(memory_bytes=500_000_000, cpu_s=3, temp_disk_bytes=2_000_000, file_bytes=100_000, open_files=8,
                      explicit=frozenset({"cpu_time"}))


@pytest.mark.parametrize("measures,limit,measured,words", [
    (FfmpegMeasures(255, temp_disk_bytes=2_500_000, cpu_s=1.0), "temp_disk", 2_500_000,
     "temp directory held 2500000 bytes, more than its limit 2000000 bytes"),
    (FfmpegMeasures(0, temp_disk_bytes=2_000_001), "temp_disk", 2_000_001, "more than its limit"),
    (FfmpegMeasures(-signal.SIGXFSZ, largest_file_bytes=100_000), "file_size", 100_000,
     "wrote a file up to 100000 bytes and was stopped at the per-file limit 100000 bytes"),
    (FfmpegMeasures(255, cpu_s=3.42), "cpu_time", 3.42, "used 3.42 s of CPU time, its limit is 3 s (ffmpeg_cpu_s)"),
    (FfmpegMeasures(123, cpu_s=5.0), "cpu_time", 5.0, "used 5 s of CPU time"),  # a fourth SIGXCPU
    (FfmpegMeasures(255, cpu_s=2.98), "cpu_time", 2.98, "used 2.98 s"),  # clock ticks: a little under the limit
    (FfmpegMeasures(-signal.SIGKILL, cpu_s=8.0), "cpu_time", 8.0, "its limit is 3 s"),  # the hard limit
    (FfmpegMeasures(1, "x264 [error]: malloc of size 5371264 failed\nError initializing output stream 0:0",
                    peak_memory_bytes=458_452_992), "memory", 458_452_992,
     "more address space than its limit 500000000 bytes: an allocation failed (x264 [error]: malloc of size"),
    (FfmpegMeasures(1, "Error while opening decoder for input stream #0:0 : Resource temporarily unavailable"),
     "memory", None, "largest address space sampled: none (it ended before the first sample) "
                     "(derived from the source: ffmpeg_memory_bytes is unset)"),
    (FfmpegMeasures(-signal.SIGSEGV, peak_memory_bytes=480_000_000), "memory", 480_000_000, "crashed with signal 11"),
    (FfmpegMeasures(1, "Could not write header for output file #1: Too many open files", peak_open_files=6),
     "open_files", 6, "its limit is 8 descriptors; most descriptors sampled: 6"),
])
def test_the_crossed_limit_is_named_with_its_measured_value(measures, limit, measured, words):
    crossed = crossed_limit(measures, LIMITS)
    assert crossed is not None and (crossed.limit, crossed.measured) == (limit, measured)
    assert crossed.setting == fl.SETTINGS[limit] and crossed.message.startswith(f"{limit} limit exceeded: ")
    assert words in crossed.message, crossed.message


@pytest.mark.parametrize("measures", [
    FfmpegMeasures(0, cpu_s=10.0, peak_memory_bytes=499_999_999, temp_disk_bytes=2_000_000),  # a clean end, at the limits
    FfmpegMeasures(1, "Invalid data found when processing input", cpu_s=2.9),  # under the CPU limit
    FfmpegMeasures(-signal.SIGSEGV, peak_memory_bytes=100_000_000),  # a crash far from the memory limit
    FfmpegMeasures(-signal.SIGTERM, cpu_s=0.5),  # stopped by the worker (a yield, the wall clock)
])
def test_an_end_that_is_no_limits_is_not_classified_as_one(measures):
    assert crossed_limit(measures, LIMITS) is None


def test_a_limit_that_was_not_set_is_never_crossed():
    unset = FfmpegLimits()
    for measures in (FfmpegMeasures(-signal.SIGXFSZ), FfmpegMeasures(255, cpu_s=1e6, temp_disk_bytes=10**15),
                     FfmpegMeasures(1, "Cannot allocate memory\nToo many open files")):
        assert crossed_limit(measures, unset) is None


def test_ffmpeg_failure_checks_the_limits_first_and_their_class_is_not_retried():
    measures = FfmpegMeasures(255, cpu_s=3.5)
    result = FfmpegResult(255, "", None, 4.0, timed_out=True, limits=LIMITS, measured=measures)
    error = ffmpeg_failure(result, 600)
    assert error.error_class == "limits_exceeded" and "cpu_time limit exceeded" in str(error)
    assert retry_decision(error.error_class, 1, RetryPolicy()).action is Action.FAIL  # JobFailed at once
    # without limits (or with none crossed) the classification is the one before
    plain = FfmpegResult(-signal.SIGKILL, "", None, 1.0)
    assert ffmpeg_failure(plain).error_class == "out_of_memory"
    assert ffmpeg_failure(FfmpegResult(-signal.SIGKILL, "", None, 1.0, limits=LIMITS,
                                       measured=FfmpegMeasures(-signal.SIGKILL, cpu_s=0.1))).error_class == "out_of_memory"


def test_the_thumbnails_runs_take_the_same_rule_with_the_sprite_as_their_one_rung():
    from processors.thumbnails import Options, plan_storyboard, step_limits

    source = SourceMedia(format_name="mov", duration_s=5.28, width=1280, height=720, display_width=1280,
                         display_height=720, rotation=0, fps=25.0, frames=132, video_codec="h264")
    board = plan_storyboard(5.28, 1280, 720, Options.of(SETTINGS))
    width, height = board.sprite_size
    limits = step_limits(source, board, 1_055_736, SETTINGS, cpus=2)
    assert limits == attempt_limits(SETTINGS, source_pixels=1280 * 720, frames=132, duration_s=5.28,
                                    rungs=[Rung(width * height, 0)], source_bytes=1_055_736, cpus=2)
    # measured here: the sprite pass on this source peaked at 461 MB of address space, 0.4 s of CPU, 5 descriptors
    assert limits.memory_bytes > 461_000_000 and limits.cpu_s > 0.4 and limits.open_files > 5


def test_frames_are_the_probes_count_else_duration_times_frame_rate():
    assert fl.expected_frames(132, 5.28, 25.0) == 132
    assert fl.expected_frames(None, 5.28, 25.0) == 132
    assert fl.expected_frames(0, 2.0, None) == 50  # no count, no rate: 25 fps

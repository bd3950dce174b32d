"""ffmpeg within limits (issue 40 item 4) with hostile sources made by ffmpeg from the real sample
clips: a tiny file that decodes into thousands of frames (CPU time), a source whose encode outgrows
the attempt's temp directory (temp disk) and a 4K source whose five-rung encode needs more address
space than allowed (memory). Each limit is set small in the test's settings, so each test takes
seconds.

Two levels. `test_..._at_the_run_level`: the transcode's own segment command under
`media.run_ffmpeg` with the limits `media.ffmpeg_limits` gives: the classified error, the limit
named with its measured value, and this process's own limits untouched (also for the per-file
and open-file limits, crossed by the plain clip under tiny limits). `test_..._ends_the_job`:
a real transcode worker (`tapeline run --role transcode`, beside a projector and an intake) with
the limit in its environment: `AttemptFailed` and `JobFailed` of class `limits_exceeded` naming the
limit, no retry, and the worker process alive afterwards (same pid), still transcoding.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
from pathlib import Path

import pytest

from domain.errors import LimitsExceeded
from domain.policy.ffmpeg_limits import CPU_TOLERANCE_S
from processors import media, segments
from tapeline.samples import sample_video
from tests.conftest import wait_for
from tests.integration.helpers import committed_events, of_job
from tests.integration.roles import Roles, rows, submit_upload

pytestmark = pytest.mark.integration

CASES = {
    # name: (source fixture, the one explicit limit, the limit's name, words of the reason)
    "cpu_time": ("many_frames.mp4", {"ffmpeg_cpu_s": 2}, "cpu_time", "s of CPU time, its limit is 2 s (ffmpeg_cpu_s)"),
    "temp_disk": ("long_output.mp4", {"ffmpeg_temp_disk_bytes": 5_000_000}, "temp_disk",
                  "more than its limit 5000000 bytes (ffmpeg_temp_disk_bytes)"),
    "memory": ("uhd.mp4", {"ffmpeg_memory_bytes": 600 * 1024**2}, "memory",
               "more address space than its limit 629145600 bytes"),
}
"""Every other limit stays derived from the source (generous): only the named one can be crossed."""

RUN_CASES = {**CASES,
             # the two limits a hostile source does not need to cross: a plain clip, tiny limits
             "file_size": ("bigbuckbunny.mp4", {"ffmpeg_file_bytes": 100_000}, "file_size",
                           "wrote a file up to 100000 bytes and was stopped at the per-file limit 100000 bytes "
                           "(SIGXFSZ) (ffmpeg_file_bytes)"),
             "open_files": ("bigbuckbunny.mp4", {"ffmpeg_open_files": 8}, "open_files",
                            "(Too many open files): its limit is 8 descriptors")}


@pytest.fixture(scope="module")
def isolated(isolated):
    """The module's settings with the fastest x264 preset (what the limits are sized against)."""
    return isolated.model_copy(update={"x264_preset": "ultrafast"})


def ffmpeg(*args: str) -> None:
    subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-y", *args], check=True, timeout=120)


def probe_json(path: Path, *entries: str) -> dict:
    done = subprocess.run(["ffprobe", "-v", "error", "-of", "json", *entries, str(path)], capture_output=True,
                          text=True, timeout=60, check=True)
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """The hostile sources, made once from bigbuckbunny.mp4 (1280x720 H.264/AAC, 5.3 s):

    - `many_frames.mp4`: one picture of the clip at 640x360, 600 frames a second for 5 s: 3000
      frames in about 400 kB (one still encoded as 600 frames, the stream repeated five times and
      stamped at 600 fps without re-encoding), two rungs (about 6 s of CPU at ultrafast here);
    - `long_output.mp4`: the clip twice over (10.6 s, 2.1 MB): its four-rung encode writes about
      7 MB, above the test's 5 MB temp-disk limit (which holds the 2.1 MB source as well);
    - `uhd.mp4`: 1 s of the clip scaled to 3840x2160: five rungs, about 890 MiB of address space
      measured, above the test's 600 MiB.
    """
    d = tmp_path_factory.mktemp("hostile")
    bbb = str(sample_video("bigbuckbunny.mp4"))
    still, chunk = d / "still.png", d / "chunk.h264"
    ffmpeg("-ss", "2", "-i", bbb, "-frames:v", "1", "-vf", "scale=640:360", str(still))
    ffmpeg("-loop", "1", "-i", str(still), "-frames:v", "600", "-c:v", "libx264", "-preset", "veryfast", "-crf", "30",
           "-tune", "stillimage", "-pix_fmt", "yuv420p", "-f", "h264", str(chunk))
    (d / "many.h264").write_bytes(chunk.read_bytes() * 5)  # an Annex B stream: five chunks play one after another
    made = {name: d / name for name in ("many_frames.mp4", "long_output.mp4", "uhd.mp4")}
    ffmpeg("-r", "600", "-i", str(d / "many.h264"), "-c", "copy", str(made["many_frames.mp4"]))
    ffmpeg("-stream_loop", "1", "-i", bbb, "-c", "copy", str(made["long_output.mp4"]))
    ffmpeg("-i", bbb, "-t", "1", "-vf", "scale=3840:2160", "-c:v", "libx264", "-preset", "ultrafast", "-crf", "40",
           "-c:a", "copy", str(made["uhd.mp4"]))
    # The premises, checked, so a test below cannot pass for the wrong reason.
    many = probe_json(made["many_frames.mp4"], "-show_entries", "stream=nb_frames")["streams"][0]
    assert int(many["nb_frames"]) == 3000 and made["many_frames.mp4"].stat().st_size < 500_000
    assert made["long_output.mp4"].stat().st_size < 5_000_000 // 2  # the source alone is half the limit
    return made


def run_level(source: Path, settings, tmp_path: Path) -> tuple[media.FfmpegResult, Exception | None]:
    """The transcode's segment command for `source` (copied into `tmp_path`, the attempt's temp
    directory, as the worker downloads it), run under the limits of `settings`."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    local = tmp_path / "source"
    shutil.copy(source, local)
    probe = media.inspect_source(local)
    ladder = media.plan_ladder(probe.media, settings.ladder)
    limits = media.ffmpeg_limits(probe.media, ladder, local.stat().st_size, probe.audio_stream is not None, settings,
                                 cpus=len(os.sched_getaffinity(0)))
    command = segments.build_segment_command(local, tmp_path / "out", ladder, with_audio=probe.audio_stream is not None,
                                             segment_s=settings.segment_s, preset=settings.x264_preset,
                                             duration_s=probe.media.duration_s, video_stream=probe.video_stream,
                                             audio_stream=probe.audio_stream, frame_rate=probe.encoder_frame_rate)
    result = media.run_ffmpeg(command, timeout_s=120, limits=limits, temp_dir=tmp_path)
    return result, media.ffmpeg_failure(result, 120)


OWN_LIMITS = ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE")


@pytest.mark.parametrize("case", RUN_CASES)
def test_a_hostile_source_crosses_its_limit_at_the_run_level(case, sources, isolated, tmp_path):
    name, limit_setting, limit, words = RUN_CASES[case]
    own = {n: resource.getrlimit(getattr(resource, n)) for n in OWN_LIMITS}
    # Under the derived limits alone, each source runs (a control: the explicit limit is what stops it).
    source = sources[name] if name in sources else sample_video(name)
    if case in ("cpu_time", "memory"):  # (the long encode is the slow one; the plain clip passes everywhere)
        result, error = run_level(source, isolated, tmp_path / "derived")
        assert error is None and result.returncode == 0, (error, result.stderr_tail)
    result, error = run_level(source, isolated.model_copy(update=limit_setting), tmp_path / "limited")
    assert isinstance(error, LimitsExceeded) and error.error_class == "limits_exceeded", (error, result)
    assert str(error).startswith(f"{limit} limit exceeded: ") and words in str(error), str(error)
    measured = result.measured
    if limit == "cpu_time":
        # The kernel's SIGXCPU and /proc's tick count can differ by a tick: the rule's own tolerance.
        assert measured.cpu_s >= 2 - CPU_TOLERANCE_S and result.elapsed_s < 20
    elif limit == "temp_disk":
        assert measured.temp_disk_bytes > 5_000_000 and str(measured.temp_disk_bytes) in str(error)
        assert measured.temp_disk_bytes < 5_000_000 + 8_000_000  # stopped within a measurement interval
        assert result.returncode == -9  # killed at once, not asked to flush its outputs
    elif limit == "file_size":
        assert result.returncode == -25 and measured.largest_file_bytes == 100_000  # SIGXFSZ, a file at the limit
    else:
        assert result.returncode != 0 and result.elapsed_s < 10
    # The limits were the child's only: this process (the worker's place) keeps its own.
    assert {n: resource.getrlimit(getattr(resource, n)) for n in OWN_LIMITS} == own


# --- a real transcode worker ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def support(isolated, tmp_path_factory):
    """The projector and the intake, for the whole module (the limits are the transcode worker's)."""
    roles = Roles(isolated, tmp_path_factory.mktemp("support")).start("projector", "intake")
    yield roles
    roles.stop()


def job_state(settings, job_id: str) -> dict | None:
    found = rows(settings, "SELECT state, stage, attempt, error_class FROM job_state WHERE job_id = %s", job_id)
    return found[0] if found else None


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_source_ends_the_job_and_the_worker_lives_on(case, sources, isolated, support, tmp_path):
    name, limit_setting, limit, words = CASES[case]
    settings = isolated.model_copy(update=limit_setting)
    worker = Roles(settings, tmp_path).start("transcode")
    process = worker.processes["transcode"]
    try:
        job_id = submit_upload(settings, sources[name])
        ended = wait_for(lambda: (s := job_state(settings, job_id)) and s["state"] in ("failed", "dead_lettered",
                                                                                      "retry_scheduled") and s,
                         120, f"the {case} job to end")
        assert (ended["state"], ended["stage"], ended["attempt"], ended["error_class"]) == \
            ("failed", "transcode", 1, "limits_exceeded"), ended
        events = of_job(committed_events(settings), job_id)
        failed = [e for e in events if e.event_type == "AttemptFailed"]
        assert [(e.error_class, e.retryable) for e in failed] == [("limits_exceeded", False)]
        assert failed[0].reason.startswith(f"{limit} limit exceeded: ") and words in failed[0].reason, failed[0].reason
        job_failed = [e for e in events if e.event_type == "JobFailed"]
        assert [(e.error_class, e.reason) for e in job_failed] == [("limits_exceeded", failed[0].reason)]
        assert not [e for e in events if e.event_type in ("RetryScheduled", "JobDeadLettered")]
        # The worker survived: the same process, alive, and it takes the next job.
        assert process.poll() is None and worker.processes["transcode"].pid == process.pid
        if case == "cpu_time":
            control = submit_upload(settings, sample_video("carphone_pristine.mp4"))
            wait_for(lambda: any(e.event_type == "AttemptSucceeded" and e.stage == "transcode"
                                 for e in of_job(committed_events(settings), control)),
                     120, "the worker to transcode a normal clip after the hostile one")
            assert process.poll() is None
    finally:
        worker.stop()
        print(worker.log_text("transcode")[-3000:])

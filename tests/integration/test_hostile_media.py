"""Hostile and odd media (issue 5, items 6-8): real inputs built by ffmpeg from the real sample
clips, through the real pipeline (`tapeline run --role all` on real Kafka, PostgreSQL, S3).

Input errors end at intake with `JobRejected`, their class and a reason naming the problem, and no
attempt at all; rotated, audio-less and non-square-pixel sources complete with upright,
even-sized, aspect-keeping renditions. The first tests need only ffmpeg: they prove that neither
ffprobe nor ffmpeg opens a file a playlist names (an inotify watch on the named file, with a
positive control showing the watch fires when plain ffprobe follows the playlist), and that the
ffmpeg wall-clock limit stops a run.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import psycopg

import pytest

from processors import media
from producers.submit import publish, upload
from domain.events import Rendition
from domain.errors import InvalidInput
from tapeline.samples import sample_video
from tests.conftest import tapeline_cli, wait_for
from tests.integration.helpers import committed_events, of_job

pytestmark = pytest.mark.integration

LIMITS = dict(max_source_pixels=1280 * 720, max_source_duration_s=12.0, max_source_bitrate_kbps=3000,
              max_upload_bytes=1_500_000)
"""Limits for this module: every real sample clip passes them, the fixtures below each pass one."""


@pytest.fixture(scope="module")
def isolated(isolated):
    """The module's settings, with small pre-flight limits and the fastest x264 preset."""
    return isolated.model_copy(update={**LIMITS, "x264_preset": "ultrafast"})


# --- inputs, built from the real samples ---------------------------------------------------------

def ffmpeg(*args: str) -> None:
    subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-y", *args], check=True, timeout=120)


def probe_json(path_or_url: str, *entries: str) -> dict:
    done = subprocess.run(["ffprobe", "-v", "error", "-of", "json", *entries, path_or_url], capture_output=True,
                          text=True, timeout=60, check=True)
    return json.loads(done.stdout)


def gray_frame(path_or_url: str, width: int, height: int) -> list[list[int]]:
    """The first frame as shown by a player (ffmpeg autorotates), as rows of 8-bit luma."""
    raw = subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-i", path_or_url, "-frames:v", "1", "-f", "rawvideo",
                          "-pix_fmt", "gray", "-"], capture_output=True, timeout=60, check=True).stdout
    assert len(raw) == width * height, f"{path_or_url}: frame is not {width}x{height}"
    return [list(raw[r * width:(r + 1) * width]) for r in range(height)]


def band_means(rows: list[list[int]]) -> dict[str, float]:
    """Mean luma of the top, bottom, left and right tenth of a frame."""
    h, w = len(rows), len(rows[0])
    band_h, band_w = max(1, h // 10), max(1, w // 10)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return {"top": mean([v for row in rows[:band_h] for v in row]),
            "bottom": mean([v for row in rows[-band_h:] for v in row]),
            "left": mean([v for row in rows for v in row[:band_w]]),
            "right": mean([v for row in rows for v in row[-band_w:]])}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """Every test input, made once from bigbuckbunny.mp4 (1280x720 H.264/AAC, 5.3 s, moov at the end)
    and bikes.mp4 (640x272 H.264, no audio, 10 s)."""
    d = tmp_path_factory.mktemp("inputs")
    bbb, bikes = str(sample_video("bigbuckbunny.mp4")), str(sample_video("bikes.mp4"))
    made = {name: d / name for name in ("moov_missing.mp4", "cut_short.mp4", "audio_only.mp4", "too_big.mp4",
                                        "too_long.mp4", "too_many_pixels.mp4", "too_high_bitrate.mp4",
                                        "rotated.mp4", "anamorphic.mp4")}
    data = Path(bbb).read_bytes()
    made["moov_missing.mp4"].write_bytes(data[:len(data) * 6 // 10])  # the index is at the end: cut off
    faststart = d / "faststart.mp4"
    ffmpeg("-i", bbb, "-c", "copy", "-movflags", "+faststart", str(faststart))
    made["cut_short.mp4"].write_bytes(faststart.read_bytes()[:faststart.stat().st_size * 2 // 3])  # index intact
    ffmpeg("-i", bbb, "-vn", "-c", "copy", str(made["audio_only.mp4"]))
    ffmpeg("-stream_loop", "1", "-i", bbb, "-c", "copy", str(made["too_big.mp4"]))  # 10.6 s, 2.1 MB
    ffmpeg("-stream_loop", "1", "-i", bikes, "-c", "copy", str(made["too_long.mp4"]))  # 20 s, 1.0 MB
    ffmpeg("-i", bbb, "-t", "1", "-an", "-vf", "scale=1920:1080", "-c:v", "libx264", "-preset", "ultrafast",
           "-crf", "35", str(made["too_many_pixels.mp4"]))
    ffmpeg("-i", bbb, "-t", "1", "-an", "-vf", "scale=640:360", "-c:v", "libx264", "-preset", "ultrafast",
           "-qp", "16", str(made["too_high_bitrate.mp4"]))
    # Rotated: the upright picture is 270x480 portrait with a white bar across its top; it is stored
    # turned a quarter clockwise (480x270 landscape) with rotate=90 metadata that turns it back.
    stored = d / "stored_landscape.mp4"
    ffmpeg("-i", bbb, "-t", "2", "-vf", "scale=480:270,crop=152:270,scale=270:480,setsar=1,"
           "drawbox=x=0:y=0:w=iw:h=48:color=white:t=fill,transpose=clock", "-c:v", "libx264", "-preset", "ultrafast",
           "-c:a", "copy", str(stored))
    ffmpeg("-i", str(stored), "-c", "copy", "-metadata:s:v:0", "rotate=90", str(made["rotated.mp4"]))
    # Non-square pixels: 480x270 stored, sample aspect 4:3, so 640x270 displayed.
    ffmpeg("-i", bbb, "-t", "2", "-vf", "scale=480:270,setsar=4/3", "-c:v", "libx264", "-preset", "ultrafast",
           "-c:a", "copy", str(made["anamorphic.mp4"]))

    # The premises, checked, so a test below cannot pass for the wrong reason.
    sizes = {name: path.stat().st_size for name, path in made.items()}
    assert sizes["too_big.mp4"] > LIMITS["max_upload_bytes"] > max(v for k, v in sizes.items() if k != "too_big.mp4")
    fmt = probe_json(str(made["too_high_bitrate.mp4"]), "-show_entries", "format=bit_rate")["format"]
    assert int(fmt["bit_rate"]) > LIMITS["max_source_bitrate_kbps"] * 1000
    stream = probe_json(str(made["rotated.mp4"]), "-show_streams", "-select_streams", "v:0")["streams"][0]
    assert (stream["width"], stream["height"]) == (480, 270)
    assert [s.get("rotation") for s in stream.get("side_data_list", [])] == [90]
    shown = band_means(gray_frame(str(made["rotated.mp4"]), 270, 480))  # a player shows it portrait, bar on top
    assert shown["top"] > 230 and max(shown["bottom"], shown["left"], shown["right"]) < 200, shown
    return made


# --- playlists: nothing they name is opened ------------------------------------------------------

class OpenWatch:
    """An inotify watch on one file: counts the times any process opened or read it (Linux)."""

    IN_ACCESS, IN_OPEN = 0x1, 0x20

    def __init__(self, path: Path) -> None:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, str(path).encode(), self.IN_ACCESS | self.IN_OPEN) < 0:
            raise OSError(ctypes.get_errno(), f"inotify on {path}")

    def opened(self) -> int:
        """Events since the last call (16-byte headers; a watch on a file carries no names)."""
        count = 0
        while True:
            try:
                count += len(os.read(self.fd, 4096)) // 16
            except BlockingIOError:
                return count

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture()
def bait(tmp_path) -> tuple[Path, OpenWatch]:
    """A real video that only a playlist names, watched for opens."""
    path = tmp_path / "bait.mp4"
    shutil.copy(sample_video("carphone_pristine.mp4"), path)
    watch = OpenWatch(path)
    yield path, watch
    watch.close()


PLAYLISTS = {
    "hls": lambda bait: f"#EXTM3U\n#EXT-X-TARGETDURATION:4\n#EXTINF:4.0,\n{bait}\n#EXT-X-ENDLIST\n",
    "concat": lambda bait: f"ffconcat version 1.0\nfile '{bait.name}'\n",  # relative: allowed by concat's safe mode
}


@pytest.mark.parametrize("kind", PLAYLISTS)
def test_a_playlist_named_mp4_is_refused_and_what_it_names_is_never_opened(kind, bait, tmp_path):
    bait_path, watch = bait
    playlist = tmp_path / "upload.mp4"
    playlist.write_text(PLAYLISTS[kind](bait_path))
    # Positive control: plain ffprobe detects the playlist and opens the named file; the watch sees it.
    subprocess.run(["ffprobe", "-v", "quiet", str(playlist)], timeout=60, check=False)
    assert watch.opened() > 0, "the watch must see plain ffprobe follow the playlist"

    expected = {"hls": "an HLS playlist", "concat": "an ffconcat playlist"}[kind]
    with pytest.raises(InvalidInput, match=f"not a readable video: the upload is {expected}"):
        media.inspect_source(playlist)
    # ffmpeg's own command line, which does not sniff first, refuses it by the container allow-list.
    out = tmp_path / "out"
    ladder = [Rendition(name="240p", width=294, height=240, video_bitrate_kbps=400)]
    command = media.build_hls_command(playlist, out, ladder, video_stream=0, audio_stream=None, segment_s=4,
                                      preset="ultrafast")
    run = media.run_ffmpeg(command, timeout_s=60)
    assert run.returncode != 0 and "not on whitelist" in run.stderr_tail, run.stderr_tail
    assert not list(out.rglob("*.ts"))
    assert watch.opened() == 0, "ffprobe or ffmpeg opened the file the playlist names"


def test_ffmpeg_is_stopped_at_its_wall_clock_limit_and_classified_timeout():
    # A 60 s encode paced at real time (-re) cannot finish within the 1.5 s limit.
    args = ["ffmpeg", "-v", "error", "-nostdin", "-re", "-f", "lavfi", "-i", "testsrc=size=64x64:rate=10:duration=60",
            "-f", "null", "-", "-progress", "pipe:1"]
    result = media.run_ffmpeg(args, timeout_s=1.5)
    assert result.timed_out and 1.5 <= result.elapsed_s < 10
    assert result.last_progress is not None and result.last_progress.out_time_s < 5
    error = media.ffmpeg_failure(result, 1.5)
    assert error.error_class == "timeout" and "wall-clock limit (1.5 s)" in str(error)


# --- through the pipeline ------------------------------------------------------------------------

def submit_json(settings, path: Path, timeout_s: float = 180) -> dict:
    done = tapeline_cli(settings, "submit", str(path), "--wait", "--json", "--timeout", str(timeout_s))
    assert done.stdout.strip(), f"no JSON from submit: {done.stderr}"
    return json.loads(done.stdout)


def assert_rejected_without_attempts(settings, summary: dict, error_class: str, reason: str) -> None:
    """`JobRejected` with `error_class` and a reason containing `reason`, shown the same by the
    summary (submit --wait --json, status --json) and by `tapeline timeline`; no attempt ever started."""
    assert (summary["state"], summary["error_class"], summary["attempts"]) == ("rejected", error_class, 0), summary
    assert reason in summary["reason"], summary["reason"]
    job_id = summary["job_id"]
    timeline = tapeline_cli(settings, "timeline", job_id, "--json")
    assert timeline.returncode == 0, timeline.stderr
    rows = json.loads(timeline.stdout)
    assert [r["event_type"] for r in rows] == ["JobRejected"]
    assert (rows[0]["payload"]["error_class"], rows[0]["payload"]["reason"]) == (error_class, summary["reason"])
    table = tapeline_cli(settings, "timeline", job_id)
    assert "JobRejected" in table.stdout and f"error_class={error_class}" in table.stdout, table.stdout
    events = of_job(committed_events(settings), job_id)
    assert [e.event_type for e in events] == ["JobRejected"]  # no AttemptStarted: zero attempts, zero retries


@pytest.mark.parametrize("name,error_class,reason", [
    ("moov_missing.mp4", "invalid_input", "the mp4 index (moov atom) is missing"),
    ("cut_short.mp4", "invalid_input", "truncated: the index points past the end of the file"),
    ("audio_only.mp4", "unsupported_media", "audio only: uploads without a video stream are not processed"),
    ("too_big.mp4", "limits_exceeded", "bytes exceeds the limit max_upload_bytes = 1500000"),
    ("too_long.mp4", "limits_exceeded", "duration 20.0 s exceeds the limit max_source_duration_s = 12 s"),
    ("too_many_pixels.mp4", "limits_exceeded",
     "picture size 1920x1080 = 2073600 pixels exceeds the limit max_source_pixels = 921600"),
    ("too_high_bitrate.mp4", "limits_exceeded", "kbit/s exceeds the limit max_source_bitrate_kbps = 3000"),
])
def test_bad_input_is_rejected_at_intake_with_its_class_and_reason(isolated, pipeline, inputs, name, error_class,
                                                                   reason):
    summary = submit_json(isolated, inputs[name])
    assert_rejected_without_attempts(isolated, summary, error_class, reason)


@pytest.mark.parametrize("change,reason", [
    (lambda e: {"size_bytes": e.size_bytes + 1}, "truncated upload: the stored source is 588804 bytes, the upload "
                                                 "declared 588805"),
    (lambda e: {"sha256": "0" * 64}, "the stored source does not match the declared sha256"),
])
def test_an_upload_that_is_not_what_it_declares_is_invalid_input(isolated, pipeline, change, reason):
    submission = upload(isolated, sample_video("carphone_pristine.mp4"))
    publish(isolated, submission.event.model_copy(update=change(submission.event)))

    def decided():
        with psycopg.connect(isolated.database_url) as conn:
            row = conn.execute("SELECT state FROM job_state WHERE job_id = %s", (submission.job_id,)).fetchone()
        return row is not None and row[0] not in ("accepted", "queued", "running")

    wait_for(decided, 120, "intake to decide on the upload")
    status = tapeline_cli(isolated, "status", submission.job_id, "--json")
    assert status.returncode == 0, status.stderr
    assert_rejected_without_attempts(isolated, json.loads(status.stdout), "invalid_input", reason)


def test_a_playlist_upload_is_rejected_and_intake_never_opens_what_it_names(isolated, pipeline, bait, tmp_path):
    bait_path, watch = bait
    playlist = tmp_path / "holiday.mp4"
    playlist.write_text(PLAYLISTS["hls"](bait_path))
    summary = submit_json(isolated, playlist)
    assert_rejected_without_attempts(isolated, summary, "invalid_input", "the upload is an HLS playlist")
    assert watch.opened() == 0, "intake opened the file the playlist names"


# --- odd but valid sources complete --------------------------------------------------------------

def completed_once(settings, path: Path) -> dict:
    summary = submit_json(settings, path)
    assert (summary["state"], summary["attempts"]) == ("completed", 1), summary
    starts = of_job(committed_events(settings), summary["job_id"], "AttemptStarted")
    assert [(e.stage, e.attempt) for e in starts] == [("transcode", 1), ("thumbnails", 1), ("publish", 1)]
    return summary


def stored_video(url: str) -> dict:
    """Stored width, height, sample aspect ratio and rotation of an output's video, and its stream types."""
    info = probe_json(url, "-show_streams")
    video = next(s for s in info["streams"] if s["codec_type"] == "video")
    rotations = [s.get("rotation") for s in video.get("side_data_list", []) if "rotation" in s]
    return {"size": (video["width"], video["height"]), "sar": video.get("sample_aspect_ratio", "1:1"),
            "rotation": rotations, "types": sorted(s["codec_type"] for s in info["streams"])}


def test_a_rotated_source_gives_upright_portrait_renditions(isolated, pipeline, inputs):
    summary = completed_once(isolated, inputs["rotated.mp4"])
    sizes = [(o["name"], o["width"], o["height"]) for o in summary["outputs"]]
    assert sizes == [("480p", 270, 480), ("360p", 202, 360), ("240p", 136, 240)]
    for output in summary["outputs"]:
        stored = stored_video(output["url"])
        # the frames themselves are portrait, square-pixelled, with no rotation left for a player to apply
        assert stored["size"] == (output["width"], output["height"]) and stored["sar"] in ("1:1", "0:1")
        assert stored["rotation"] == []
        # and upright: the white bar is across the top, not down a side or at the bottom
        bands = band_means(gray_frame(output["url"], output["width"], output["height"]))
        assert bands["top"] > 230 and max(bands["bottom"], bands["left"], bands["right"]) < 200, (output, bands)


def test_a_source_without_audio_completes_with_video_only(isolated, pipeline):
    summary = completed_once(isolated, sample_video("bikes.mp4"))
    assert [(o["name"], o["width"], o["height"]) for o in summary["outputs"]] == [("240p", 564, 240)]
    with urllib.request.urlopen(summary["master_url"], timeout=30) as response:
        master = response.read().decode()
    assert "#EXT-X-STREAM-INF" in master and 'CODECS="avc1.640028"' in master and "TYPE=AUDIO" not in master
    assert stored_video(summary["outputs"][0]["url"])["types"] == ["video"]


def test_non_square_pixels_are_made_square_at_the_display_aspect(isolated, pipeline, inputs):
    summary = completed_once(isolated, inputs["anamorphic.mp4"])  # 480x270 stored, 640x270 displayed
    assert [(o["name"], o["width"], o["height"]) for o in summary["outputs"]] == [("240p", 568, 240)]
    stored = stored_video(summary["outputs"][0]["url"])
    assert stored["size"] == (568, 240) and stored["sar"] == "1:1"
    assert stored["types"] == ["video"]  # audio is its own rendition

"""Odd but valid media (issue 21, items 3-4): a corpus built with ffmpeg from the real sample clips,
every case through one shared pipeline (`tapeline run --role all` on real Kafka, PostgreSQL, S3).

Each source completes in one attempt, and its published HLS is checked against the source itself:
the rendition's picture size, each output stream's duration against the source stream it comes
from, audio/video sync within one frame (the offset between the streams' first timestamps is the
source's), and `ffmpeg -i master.m3u8 -f null -` plays it through with no error. What the transcode
did about the oddity is recorded in `JobAccepted.media.handling` (docs/media-corpus.md).

The first case is issue 21's bug: audio 3.008 s beside video 2.320 s was checked against one source
duration, failed as `unknown` three times and was dead-lettered.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import psycopg
import pytest

from producers.submit import publish, upload
from tapeline.samples import sample_video
from tests.conftest import tapeline_cli, wait_for
from tests.integration.helpers import committed_events, of_job

pytestmark = pytest.mark.integration

FRAME_S = 1 / 25
"""One frame of every corpus source (bigbuckbunny is 25 fps)."""
VIDEO_TOLERANCE_S = 1.5 * FRAME_S
"""A video rendition lasts as long as its source stream within 1.5 frames (the last frame's length
is the muxer's guess), as `processors/transcode.py` checks."""
AUDIO_TOLERANCE_S = 0.1
"""Audio: within 0.1 s (AAC frames of 1024 samples, 21 ms at 48 kHz, and one frame of encoder priming)."""


@pytest.fixture(scope="module")
def isolated(isolated):
    """The module's settings: the fastest x264 preset, and retries a second apart, so a job that
    fails as retryable (the bug) is dead-lettered within seconds instead of after 6 minutes."""
    return isolated.model_copy(update={"x264_preset": "ultrafast", "retry_backoff_s": (1.0,),
                                       "retry_backoff_by_class": {"worker_lost": (0.0,)}})


def ffmpeg(*args: str) -> None:
    subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-y", *args], check=True, timeout=120)


def probe(url_or_path: str, *args: str) -> dict:
    done = subprocess.run(["ffprobe", "-v", "error", "-of", "json", *args, url_or_path], capture_output=True,
                          text=True, timeout=60, check=True)
    return json.loads(done.stdout)


X264 = ("-c:v", "libx264", "-preset", "ultrafast")

CASES: dict[str, dict] = {
    # name: how it is made from base.mp4 (320x180 H.264 25 fps + 5.1 AAC 48 kHz, 3.2 s, cut from
    # bigbuckbunny.mp4), the rendition expected, and the `handling` note expected (a substring).
    "audio_longer.mp4": dict(make=lambda b, o: ffmpeg("-t", "2.32", "-i", b, "-t", "3.0", "-i", b, "-map", "0:v",
                                                      "-map", "1:a", "-c", "copy", o),
                             note="kept both as they are, the audio plays on alone"),
    "video_longer.mp4": dict(make=lambda b, o: ffmpeg("-t", "3.0", "-i", b, "-t", "2.0", "-i", b, "-map", "0:v",
                                                      "-map", "1:a", "-c", "copy", o),
                             note="kept both as they are, the video plays on alone"),
    # 25 frames 40 ms apart, then 55 frames 66 ms apart (timestamps off the 25 fps grid)
    "variable_frame_rate.mp4": dict(make=lambda b, o: ffmpeg(
        "-i", b, "-vf", "setpts='if(lt(N,25),N*0.04,1+(N-25)*0.066)/TB'", "-fps_mode", "passthrough", *X264,
        "-c:a", "copy", o), note="variable frame rate"),
    # stream copy from 0.6 s: every packet from the keyframe at 0 is kept, the edit list hides 0-0.6 s
    "edit_list.mp4": dict(make=lambda b, o: ffmpeg("-ss", "0.6", "-i", b, "-c", "copy", o)),
    "open_gop_bframes.mp4": dict(make=lambda b, o: ffmpeg(
        "-i", b, *X264, "-x264-params", "open-gop=1:keyint=25:bframes=3:b-pyramid=normal", "-c:a", "copy", o)),
    "keyframes_10s_apart.mp4": dict(make=lambda b, o: ffmpeg(
        "-stream_loop", "3", "-t", "11", "-i", b, "-vf", "scale=160:90", *X264, "-g", "250", "-keyint_min", "250",
        "-sc_threshold", "0", "-c:a", "aac", o), size=("90p", 160, 90)),
    "shorter_than_a_second.mp4": dict(make=lambda b, o: ffmpeg("-t", "0.6", "-i", b, *X264, "-c:a", "aac", o)),
    "ten_bit.mp4": dict(make=lambda b, o: ffmpeg("-i", b, *X264, "-pix_fmt", "yuv420p10le", "-c:a", "copy", o),
                        note="pixel format yuv420p10le: converted to 8-bit yuv420p"),
    # really interlaced: pairs of frames woven into the two fields of one (12.5 fps, combed where it moves)
    "interlaced.mp4": dict(make=lambda b, o: ffmpeg("-i", b, "-vf", "tinterlace=mode=interleave_top,setfield=tff",
                                                    *X264, "-flags", "+ilme+ildct", "-x264-params", "tff=1",
                                                    "-c:a", "copy", o),
                           note="interlaced (field order tt): deinterlaced with bwdif"),
    "mono.mp4": dict(make=lambda b, o: ffmpeg("-i", b, "-c:v", "copy", "-ac", "1", "-c:a", "aac", o)),
    "surround_5_1.mp4": dict(make=lambda b, o: ffmpeg("-i", b, "-c", "copy", o)),  # the sample's audio is 5.1
    "audio_96khz.mp4": dict(make=lambda b, o: ffmpeg("-i", b, "-c:v", "copy", "-ar", "96000", "-c:a", "aac", o),
                            note="audio sampled at 96000 Hz: resampled to 48000 Hz"),
    # a silent first track, then the real audio marked default: the default one must be encoded
    "two_audio_tracks.mp4": dict(make=lambda b, o: ffmpeg(
        "-i", b, "-f", "lavfi", "-t", "3.2", "-i", "anullsrc=r=48000:cl=mono", "-map", "0:v", "-map", "1:a",
        "-map", "0:a", "-c:v", "copy", "-c:a", "aac", "-disposition:a:0", "0", "-disposition:a:1", "default", o),
        note="2 audio tracks: encoded stream 2"),
    "timecode_track.mov": dict(make=lambda b, o: ffmpeg("-i", b, "-c", "copy", "-timecode", "01:00:00:00", o)),
    # MPEG-TS whose timestamps start at 11.4 s (10 s offset + the muxer's delay), audio 21 ms earlier
    "start_time_11s.ts": dict(make=lambda b, o: ffmpeg("-i", b, "-c", "copy", "-output_ts_offset", "10", "-f", "mpegts",
                                                       o), note="timestamps start at 11.379 s: shifted to start at 0"),
}


def stream_facts(url_or_path: str) -> dict[str, dict]:
    """Per stream type (the first video and the first audio): ffprobe's stream fields, with `start`
    and `length` (s): the stream's stated start time and duration (an MP4's edit list applied), else
    from its packets' own timestamps; and the list of codec types. Reads packets, no decoding."""
    info = probe(url_or_path, "-show_streams", "-show_format")
    facts: dict[str, dict] = {}
    for stream in info["streams"]:
        kind = stream["codec_type"]
        if kind not in ("video", "audio") or kind in facts:
            continue
        packets = probe(url_or_path, "-select_streams", str(stream["index"]), "-show_entries",
                        "packet=pts_time,duration_time")["packets"]
        stamps = [(float(p["pts_time"]), float(p.get("duration_time") or 0)) for p in packets if "pts_time" in p]
        start, end = min(t for t, _ in stamps), max(t + d for t, d in stamps)
        stated = [float(stream[k]) if stream.get(k) not in (None, "N/A") else None for k in ("start_time", "duration")]
        facts[kind] = {**stream, "start": stated[0] if stated[0] is not None else start,
                       "length": stated[1] if stated[1] is not None else end - start}
    facts["types"] = sorted(s["codec_type"] for s in info["streams"])
    return facts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """Every case, made once from the real bigbuckbunny.mp4 sample (1280x720 H.264/5.1 AAC)."""
    d = tmp_path_factory.mktemp("corpus")
    base = d / "base.mp4"
    ffmpeg("-t", "3.2", "-i", str(sample_video("bigbuckbunny.mp4")), "-vf", "scale=320:180", *X264, "-c:a", "aac",
           str(base))
    made = {}
    for name, case in CASES.items():
        case["make"](str(base), str(d / name))
        made[name] = d / name
    # The premises, so a case cannot pass for the wrong reason.
    facts = {name: stream_facts(str(path)) for name, path in made.items()}
    length = lambda f, kind: f[kind]["length"]  # noqa: E731
    assert length(facts["audio_longer.mp4"], "audio") - length(facts["audio_longer.mp4"], "video") > 0.6
    assert length(facts["video_longer.mp4"], "video") - length(facts["video_longer.mp4"], "audio") > 0.9
    vfr = probe(str(made["variable_frame_rate.mp4"]), "-show_streams", "-select_streams", "v:0")["streams"][0]
    assert vfr["r_frame_rate"] != vfr["avg_frame_rate"]
    cut = probe(str(made["edit_list.mp4"]), "-count_frames", "-show_streams", "-select_streams", "v:0")["streams"][0]
    assert (int(cut["nb_frames"]), int(cut["nb_read_frames"])) == (80, 65)  # 15 frames hidden by the edit list
    keys = probe(str(made["keyframes_10s_apart.mp4"]), "-select_streams", "v:0", "-skip_frame", "nokey",
                 "-show_entries", "frame=pts_time")["frames"]
    assert [round(float(k["pts_time"])) for k in keys] == [0, 10]
    bframes = probe(str(made["open_gop_bframes.mp4"]), "-select_streams", "v:0", "-show_entries",
                    "frame=pict_type")["frames"]
    assert any(f["pict_type"] == "B" for f in bframes)
    assert length(facts["shorter_than_a_second.mp4"], "video") < 1.0
    assert facts["ten_bit.mp4"]["video"]["pix_fmt"] == "yuv420p10le"
    assert facts["interlaced.mp4"]["video"]["field_order"] == "tt"
    assert [facts[n]["audio"]["channels"] for n in ("mono.mp4", "surround_5_1.mp4")] == [1, 6]
    assert facts["audio_96khz.mp4"]["audio"]["sample_rate"] == "96000"
    assert facts["two_audio_tracks.mp4"]["types"] == ["audio", "audio", "video"]
    assert "data" in facts["timecode_track.mov"]["types"]
    assert facts["start_time_11s.ts"]["video"]["start"] > 11
    return made


@pytest.fixture(scope="module")
def outcomes(isolated, pipeline, corpus) -> dict[str, dict]:
    """Submit every case at once, wait until each job ends, and return `tapeline status JOB --json`
    of each, with its `JobAccepted` media summary (`media`) and the seconds the corpus took."""
    started = time.monotonic()
    jobs = {}
    for name, path in corpus.items():
        submission = upload(isolated, path)
        publish(isolated, submission.event)
        jobs[name] = submission.job_id

    def ended():
        with psycopg.connect(isolated.database_url) as conn:
            rows = conn.execute("SELECT job_id::text, state FROM job_state WHERE job_id = ANY(%s)",
                                (list(jobs.values()),)).fetchall()
        final = {"completed", "failed", "dead_lettered", "rejected", "cancelled", "needs_review"}
        return len(rows) == len(jobs) and all(state in final for _, state in rows)

    wait_for(ended, 600, "every corpus job to end")
    events = committed_events(isolated)
    result = {}
    for name, job_id in jobs.items():
        status = tapeline_cli(isolated, "status", job_id, "--json")
        assert status.returncode == 0, status.stderr
        summary = json.loads(status.stdout)
        accepted = of_job(events, job_id, "JobAccepted")
        summary["media"] = accepted[0].media if accepted else None
        summary["failures"] = [(e.error_class, e.reason) for e in of_job(events, job_id, "AttemptFailed")]
        result[name] = summary
    print(f"odd media corpus: {len(jobs)} jobs ended in {time.monotonic() - started:.1f} s")
    return result


def audio_playlist_url(master_url: str) -> str | None:
    with urllib.request.urlopen(master_url, timeout=30) as response:
        master = response.read().decode()
    found = re.search(r'#EXT-X-MEDIA:TYPE=AUDIO[^\n]*URI="([^"]+)"', master)
    return urllib.parse.urljoin(master_url, found.group(1)) if found else None


@pytest.mark.parametrize("name", list(CASES))
def test_an_odd_but_valid_source_completes_with_correct_outputs(name, corpus, outcomes):
    case, summary = CASES[name], outcomes[name]
    assert (summary["state"], summary["attempts"]) == ("completed", 1), (summary, summary["failures"])
    source = stream_facts(str(corpus[name]))
    # what was done about the oddity is recorded in the job's probe summary
    if case.get("note"):
        assert case["note"] in (summary["media"].handling or ""), summary["media"].handling
    # dimensions
    rung, width, height = case.get("size", ("180p", 320, 180))
    assert [(o["name"], o["width"], o["height"]) for o in summary["outputs"]] == [(rung, width, height)]
    video_url = summary["outputs"][0]["url"]
    out = stream_facts(video_url)
    assert (out["video"]["width"], out["video"]["height"], out["video"]["pix_fmt"]) == (width, height, "yuv420p")
    assert out["types"] == ["video"]
    audio_url = audio_playlist_url(summary["master_url"])
    assert audio_url is not None
    heard = stream_facts(audio_url)
    assert heard["types"] == ["audio"]
    assert (heard["audio"]["channels"], heard["audio"]["sample_rate"]) == (2, "48000")
    # durations per stream: each output stream lasts as long as the source stream it comes from
    src_video, src_audio = source["video"]["length"], source["audio"]["length"]
    assert abs(out["video"]["length"] - src_video) <= VIDEO_TOLERANCE_S, (out["video"], src_video)
    assert abs(heard["audio"]["length"] - src_audio) <= AUDIO_TOLERANCE_S, (heard["audio"], src_audio)
    # A/V sync: the audio starts as far from the video as in the source, within one frame
    source_offset = source["video"]["start"] - source["audio"]["start"]
    output_offset = out["video"]["start"] - heard["audio"]["start"]
    assert abs(output_offset - source_offset) <= FRAME_S, (output_offset, source_offset)
    # the HLS plays through
    played = subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-i", summary["master_url"], "-f", "null", "-"],
                            capture_output=True, text=True, timeout=120)
    assert played.returncode == 0 and played.stderr.strip() == "", played.stderr


def test_of_two_audio_tracks_the_default_one_is_encoded(outcomes):
    # the first track is silence; the default (second) one is the sample's sound
    url = audio_playlist_url(outcomes["two_audio_tracks.mp4"]["master_url"])
    done = subprocess.run(["ffmpeg", "-nostdin", "-i", url, "-af", "volumedetect", "-f", "null", "-"],
                          capture_output=True, text=True, timeout=120)
    mean = float(re.search(r"mean_volume: (-?[\d.]+) dB", done.stderr).group(1))
    assert mean > -50, done.stderr[-2000:]


def idet(url: str) -> dict[str, int]:
    """ffmpeg's interlace detector over a whole file: frames judged TFF, BFF, Progressive, Undetermined."""
    done = subprocess.run(["ffmpeg", "-nostdin", "-i", url, "-an", "-vf", "idet", "-f", "null", "-"],
                          capture_output=True, text=True, timeout=120)
    line = re.search(r"Multi frame detection: (.*)", done.stderr).group(1)
    return {k: int(v) for k, v in re.findall(r"(\w+):\s+(\d+)", line)}


def test_interlaced_input_is_deinterlaced(corpus, outcomes):
    # the source: every frame combed (TFF); the output: bwdif (send_frame, one frame per frame) left
    # the same number of frames, most of them judged progressive (without it, all 40 stay TFF)
    before, after = idet(str(corpus["interlaced.mp4"])), idet(outcomes["interlaced.mp4"]["outputs"][0]["url"])
    assert before["TFF"] == 40 and before["Progressive"] == 0, before
    assert sum(after.values()) == 40 and after["Progressive"] > 2 * after["TFF"], after

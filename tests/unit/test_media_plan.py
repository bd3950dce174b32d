"""The media core, pure parts: ladder planning (never upscale, even sizes, aspect kept, rotation
honoured), the probe interpretation, pre-flight limits, the ffmpeg command and outcome classes."""

import pytest
from hypothesis import given, settings as hyp_settings, strategies as st

from domain.policy.intake_decision import preflight
from processors.media import ALLOWED_CONTAINERS as ALLOWED
from processors.media import (FfmpegResult, Progress, _parse_progress, build_hls_command, check_limits, ffmpeg_failure,
                              interpret_probe, plan_ladder, sniff_playlist, wall_clock_limit_s)
from domain import events as ev
from domain.events import SourceMedia
from domain.errors import InvalidInput, LimitsExceeded, UnsupportedMedia
from tapeline.settings import Settings
from tapeline.clock import system_clock

HEIGHTS = (1080, 720, 480, 360, 240)


def media(w, h, rotation=0):
    dw, dh = (h, w) if rotation in (90, 270) else (w, h)
    return SourceMedia(format_name="mov", duration_s=5.0, width=w, height=h, display_width=dw, display_height=dh,
                       rotation=rotation, fps=25.0, video_codec="h264")


def test_720p_source_gets_four_rungs_without_upscaling():
    ladder = plan_ladder(media(1280, 720), HEIGHTS)
    assert [(r.name, r.width, r.height) for r in ladder] == [
        ("720p", 1280, 720), ("480p", 854, 480), ("360p", 640, 360), ("240p", 426, 240)]


@pytest.mark.parametrize("w,h", [(640, 272), (1920, 1080), (1000, 1000), (176, 144), (3840, 2160)])
def test_every_rung_is_even_and_keeps_the_aspect_ratio(w, h):
    for rung in plan_ladder(media(w, h), HEIGHTS):
        assert rung.width % 2 == 0 and rung.height % 2 == 0
        assert rung.height <= h and rung.width <= w
        assert abs(rung.width / rung.height - w / h) < 0.02


def test_source_below_the_lowest_rung_gets_one_rendition_at_its_own_size():
    ladder = plan_ladder(media(176, 144), HEIGHTS)
    assert [(r.width, r.height) for r in ladder] == [(176, 144)]


def test_rotated_source_is_planned_upright():
    ladder = plan_ladder(media(1280, 720, rotation=90), HEIGHTS)  # a phone video: 720x1280 upright
    assert [(r.name, r.width, r.height) for r in ladder] == [
        ("1080p", 608, 1080), ("720p", 404, 720), ("480p", 270, 480), ("360p", 202, 360), ("240p", 136, 240)]


def test_progress_block_parsing_uses_microseconds():
    block = {"frame": "120", "out_time_us": "4842667", "out_time_ms": "4842667", "speed": "1.34x", "progress": "continue"}
    progress = _parse_progress(block)
    assert progress.frames == 120 and progress.out_time_s == pytest.approx(4.842667) and progress.speed == 1.34
    assert not progress.ended


# --- ladder properties ---------------------------------------------------------------------------

@hyp_settings(max_examples=300, deadline=None)
@given(w=st.integers(1, 8192), h=st.integers(1, 8192), sar=st.sampled_from([1.0, 128 / 117, 4 / 3, 0.75, 1.5]),
       rotation=st.sampled_from([0, 90, 180, 270]))
def test_ladder_is_even_never_above_the_source_and_keeps_the_display_aspect(w, h, sar, rotation):
    dw, dh = max(1, round(w * sar)), h
    if rotation in (90, 270):
        dw, dh = dh, dw
    source = SourceMedia(format_name="mov", duration_s=5.0, width=w, height=h, display_width=dw, display_height=dh,
                         rotation=rotation, fps=25.0, video_codec="h264")
    ladder = plan_ladder(source, HEIGHTS)
    assert ladder and [r.height for r in ladder] == sorted((r.height for r in ladder), reverse=True)
    for rung in ladder:
        assert rung.width % 2 == 0 and rung.height % 2 == 0
        # never above the source (2 px is the least an H.264 4:2:0 picture can have)
        assert rung.width <= max(2, dw) and rung.height <= max(2, dh)
        # the display aspect ratio is kept to within the rounding to even pixels: a rung's width is
        # the nearest even one (1 px off at most); a one-rendition source rounds both sides down
        # (1 px each); a sliver 2 px wide or high is the exception
        if rung.width > 2 and rung.height > 2:
            assert abs(rung.width - rung.height * dw / dh) <= (1 if dh >= min(HEIGHTS) else 1 + dw / dh)
    if dh >= min(HEIGHTS):
        assert [r.height for r in ladder] == [x for x in HEIGHTS if x <= dh]
    else:
        assert len(ladder) == 1 and ladder[0].height == max(2, dh // 2 * 2)


def test_an_odd_sized_small_source_is_rounded_down_not_up():
    ladder = plan_ladder(media(175, 143), HEIGHTS)
    assert [(r.width, r.height) for r in ladder] == [(174, 142)]


def test_a_rung_is_not_dropped_because_the_width_rounds_one_pixel_up():
    ladder = plan_ladder(media(855, 480), HEIGHTS)  # 480 * 855/480 = 855 -> 856 would pass the source by 1
    assert [(r.name, r.width, r.height) for r in ladder][0] == ("480p", 854, 480)


# --- probe interpretation (ffprobe JSON -> Probe) -----------------------------------------------

def video_stream(**extra):
    return {"index": 0, "codec_type": "video", "codec_name": "h264", "width": 1280, "height": 720,
            "sample_aspect_ratio": "1:1", "avg_frame_rate": "25/1", "duration": "5.28", "nb_frames": "132", **extra}


AUDIO = {"index": 1, "codec_type": "audio", "codec_name": "aac", "duration": "5.31"}
FORMAT = {"format_name": "mov,mp4,m4a,3gp,3g2,mj2", "duration": "5.312", "bit_rate": "1589963"}


def test_probe_of_a_normal_file_names_its_streams():
    probe = interpret_probe({"streams": [video_stream(), AUDIO], "format": FORMAT})
    assert (probe.video_stream, probe.audio_stream) == (0, 1)
    assert (probe.media.display_width, probe.media.display_height, probe.media.rotation) == (1280, 720, 0)
    assert probe.media.audio_codec == "aac" and probe.media.bit_rate_bps == 1589963 and probe.media.frames == 132


def test_probe_without_audio_has_no_audio_stream():
    probe = interpret_probe({"streams": [video_stream()], "format": FORMAT})
    assert probe.audio_stream is None and probe.media.audio_codec is None


def test_cover_art_is_not_the_video_stream():
    cover = {"index": 0, "codec_type": "video", "codec_name": "mjpeg", "width": 600, "height": 600,
             "disposition": {"attached_pic": 1}}
    probe = interpret_probe({"streams": [cover, {**AUDIO, "index": 1}, video_stream(index=2)], "format": FORMAT})
    assert (probe.video_stream, probe.audio_stream) == (2, 1)


@pytest.mark.parametrize("streams,message", [
    ([AUDIO], "audio only"),
    ([], "no video stream"),
    ([{"index": 0, "codec_type": "subtitle"}], "no video stream"),
])
def test_no_video_stream_is_unsupported_media(streams, message):
    with pytest.raises(UnsupportedMedia, match=message):
        interpret_probe({"streams": streams, "format": FORMAT})


@pytest.mark.parametrize("side_data,tags,expected", [
    ([{"side_data_type": "Display Matrix", "rotation": -90}], {}, 270),
    ([{"side_data_type": "Display Matrix", "rotation": 90}], {}, 90),
    ([{"side_data_type": "Display Matrix", "rotation": 180}], {}, 180),
    ([], {"rotate": "90"}, 90),
    ([], {"rotate": "abc"}, 0),        # a nonsense tag from the file is ignored, not a crash
    ([{"rotation": 45}], {}, 0),        # ffmpeg's autorotate ignores odd angles too
    ([{"rotation": 89.5}], {}, 90),
])
def test_rotation_swaps_the_display_size(side_data, tags, expected):
    probe = interpret_probe({"streams": [video_stream(side_data_list=side_data, tags=tags)], "format": FORMAT})
    assert probe.media.rotation == expected
    size = (720, 1280) if expected in (90, 270) else (1280, 720)
    assert (probe.media.display_width, probe.media.display_height) == size


def test_non_square_pixels_give_the_display_width():
    probe = interpret_probe({"streams": [video_stream(width=176, height=144, sample_aspect_ratio="128:117")],
                             "format": FORMAT})
    assert (probe.media.display_width, probe.media.display_height) == (193, 144)
    rotated = interpret_probe({"streams": [video_stream(width=176, height=144, sample_aspect_ratio="128:117",
                                                        tags={"rotate": "90"})], "format": FORMAT})
    assert (rotated.media.display_width, rotated.media.display_height) == (144, 193)


@pytest.mark.parametrize("read,truncated", [("132", False), ("131", False), ("130", True), ("76", True)])
def test_fewer_packets_than_the_index_lists_is_a_truncated_upload(read, truncated):
    # 132 frames listed: one frame of slack (an avi header may count one more than it holds) plus 1 %.
    info = {"streams": [video_stream(nb_read_packets=read)], "format": FORMAT}
    if truncated:
        with pytest.raises(InvalidInput, match=f"index lists 132 video frames but the file holds only {read}"):
            interpret_probe(info)
    else:
        assert interpret_probe(info).media.frames == 132


@pytest.mark.parametrize("stream", [video_stream(width=0), video_stream(height="N/A"), video_stream(width=70000),
                                    video_stream(width=-4)])
def test_a_video_stream_without_a_valid_picture_size_is_invalid_input(stream):
    with pytest.raises(InvalidInput, match="the video stream has no valid picture size"):
        interpret_probe({"streams": [stream], "format": FORMAT})


def test_duration_falls_back_to_the_container_and_none_at_all_is_invalid_input():
    assert interpret_probe({"streams": [video_stream(duration="N/A")], "format": FORMAT}).media.duration_s == 5.312
    with pytest.raises(InvalidInput, match="the source has no duration"):
        interpret_probe({"streams": [video_stream(duration="N/A")], "format": {"duration": "N/A"}})


@pytest.mark.parametrize("head,kind", [
    (b"#EXTM3U\n#EXT-X-TARGETDURATION:4\n", "an HLS playlist"),
    (b"\xef\xbb\xbf  #EXTM3U\n", "an HLS playlist"),
    (b"ffconcat version 1.0\nfile 'a.mp4'\n", "an ffconcat playlist"),
    (b"<MPD xmlns=", "a DASH manifest"),
    (b"\x00\x00\x00\x20ftypisom", None),
    (b"", None),
])
def test_playlists_are_recognised_by_their_first_bytes(head, kind):
    assert sniff_playlist(head) == kind


# --- pre-flight limits ---------------------------------------------------------------------------

LIMITS = Settings(max_source_pixels=1280 * 720, max_source_duration_s=60.0, max_source_bitrate_kbps=4000,
                  max_upload_bytes=10_000_000)


def limited(w=1280, h=720, duration=5.0, bit_rate=1_600_000):
    return SourceMedia(format_name="mov", duration_s=duration, width=w, height=h, display_width=w, display_height=h,
                       rotation=0, fps=25.0, video_codec="h264", bit_rate_bps=bit_rate)


def test_a_source_at_every_limit_passes():
    check_limits(limited(1280, 720, 60.0, 4_000_000), LIMITS)


@pytest.mark.parametrize("source,size,message", [
    (limited(1282, 720), None, r"picture size 1282x720 = 923040 pixels exceeds the limit max_source_pixels = 921600"),
    (limited(duration=60.5), None, r"duration 60.5 s exceeds the limit max_source_duration_s = 60 s"),
    (limited(bit_rate=4_001_000), None, r"bitrate 4001 kbit/s exceeds the limit max_source_bitrate_kbps = 4000"),
    (limited(bit_rate=None), 5 * 600_000, r"bitrate 4800 kbit/s exceeds the limit max_source_bitrate_kbps = 4000"),
])
def test_each_limit_is_named_when_passed(source, size, message):
    with pytest.raises(LimitsExceeded, match=message) as caught:
        check_limits(source, LIMITS, size_bytes=size)
    assert caught.value.error_class == "limits_exceeded"


def upload_event(**fields):
    base = dict(job_id=ev.job_id_for("u1"), stage="intake", attempt=0, recorded_by="test", correlation_id="u1",
                upload_id="u1", bucket="tapeline-media", object_key="uploads/u1/a.mp4", size_bytes=1000, sha256="0" * 64,
                filename="a.mp4", priority="standard")
    return ev.UploadCompleted.new(system_clock.stamp(), **{**base, **fields})


@pytest.mark.parametrize("fields,error,message", [
    ({}, None, None),
    ({"size_bytes": 10_000_000}, None, None),
    ({"size_bytes": 10_000_001}, LimitsExceeded,
     "file size 10000001 bytes exceeds the limit max_upload_bytes = 10000000"),
    ({"size_bytes": 0}, InvalidInput, "the upload declares 0 bytes; a source has at least one"),
    ({"priority": "urgent"}, InvalidInput, "unknown priority tier 'urgent'"),
    # Issue 44 item 5: an event's pointer is not trusted; only the upload's own prefix in our bucket.
    ({"object_key": "uploads/u1/1733500000000000/a.mp4"}, None, None),
    ({"bucket": "other-bucket"}, InvalidInput,
     "the upload names bucket 'other-bucket'; sources are taken only from 'tapeline-media'"),
    ({"object_key": "work/j9/transcode/1/720p/seg_00001.ts"}, InvalidInput,
     "source object 'work/j9/transcode/1/720p/seg_00001.ts' is not under the upload's own prefix 'uploads/u1/'"),
    ({"object_key": "published/j9/master.m3u8"}, InvalidInput,
     "source object 'published/j9/master.m3u8' is not under the upload's own prefix 'uploads/u1/'"),
    ({"object_key": "uploads/u2/a.mp4"}, InvalidInput,
     "source object 'uploads/u2/a.mp4' is not under the upload's own prefix 'uploads/u1/'"),
    ({"object_key": "uploads/u1/../../work/j9/x.ts"}, InvalidInput,
     "source object 'uploads/u1/../../work/j9/x.ts' is not under the upload's own prefix 'uploads/u1/'"),
    ({"object_key": "uploads/u1//a.mp4"}, InvalidInput,
     "source object 'uploads/u1//a.mp4' is not under the upload's own prefix 'uploads/u1/'"),
    ({"object_key": "uploads/u1/"}, InvalidInput,
     "source object 'uploads/u1/' is not under the upload's own prefix 'uploads/u1/'"),
    ({"object_key": "uploads/u1a.mp4"}, InvalidInput,
     "source object 'uploads/u1a.mp4' is not under the upload's own prefix 'uploads/u1/'"),
])
def test_preflight_judges_the_upload_event_before_any_download(fields, error, message):
    problem = preflight(upload_event(**fields), LIMITS)
    if error is None:
        assert problem is None
    else:
        assert type(problem) is error and str(problem) == message


# --- ffmpeg command and outcome ------------------------------------------------------------------

def test_command_follows_the_streams_that_exist(tmp_path):
    ladder = plan_ladder(media(640, 272), HEIGHTS)
    without = build_hls_command(tmp_path / "src", tmp_path / "out", ladder, video_stream=2, audio_stream=None,
                                segment_s=4, preset="ultrafast")
    assert without[:6] == ["ffmpeg", "-format_whitelist", ALLOWED, "-protocol_whitelist", "file", "-i"]
    assert "[0:2]split=1[s0]" in without[without.index("-filter_complex") + 1]
    assert [a for a in without if a.startswith("0:")] == [] and not (tmp_path / "out" / "audio").exists()
    with_audio = build_hls_command(tmp_path / "src", tmp_path / "out", ladder, video_stream=0, audio_stream=1,
                                   segment_s=4, preset="ultrafast")
    maps = [with_audio[i + 1] for i, a in enumerate(with_audio) if a == "-map"]
    assert maps == ["[s2]", "0:1"] and with_audio.count("-protocol_whitelist") == 3  # input + both outputs


def result(returncode=0, timed_out=False, tail="", out_time=0.0):
    return FfmpegResult(returncode, tail, Progress(10, out_time, 1.0, False), 1.0, timed_out)


@pytest.mark.parametrize("outcome,error_class,message", [
    (result(0), None, None),
    (result(-15, timed_out=True, out_time=2.5), "timeout",
     "ffmpeg ran longer than the wall-clock limit (30 s); stopped at 2.5 s of media"),
    (result(-9, tail="x"), "out_of_memory", "ffmpeg exited with -9: x"),
    (result(137, tail="x"), "out_of_memory", "ffmpeg exited with 137: x"),
    (result(1, tail="first\nInvalid data found"), "unknown", "ffmpeg exited with 1: Invalid data found"),
    (result(1, tail="[h264 @ 0x55] Multiple slice types per frame is not implemented. Update your FFmpeg\nConversion "
            "failed!"), "unsupported_media",
     "ffmpeg cannot process this source: Multiple slice types per frame is not implemented. Update your FFmpeg"),
    (result(1, tail="Decoder (codec none) not found for input stream #0:0"), "unsupported_media",
     "ffmpeg cannot process this source: Decoder (codec none) not found for input stream #0:0"),
])
def test_ffmpeg_outcomes_are_classified(outcome, error_class, message):
    error = ffmpeg_failure(outcome, 30.0)
    if error_class is None:
        assert error is None
    else:
        assert (error.error_class, str(error)) == (error_class, message)


def test_wall_clock_limit_grows_with_the_media():
    s = Settings(ffmpeg_timeout_s=600, ffmpeg_timeout_factor=10)
    assert (wall_clock_limit_s(0.0, s), wall_clock_limit_s(5.0, s), wall_clock_limit_s(3600.0, s)) == (600, 650, 36600)


# --- odd but valid sources (issue 21): what the probe decides ------------------------------------

def test_each_stream_keeps_its_own_duration_and_different_lengths_are_recorded():
    probe = interpret_probe({"streams": [video_stream(duration="2.32", nb_frames="58"), {**AUDIO, "duration": "3.008"}],
                             "format": {**FORMAT, "duration": "3.008"}})
    assert (probe.media.duration_s, probe.audio_duration_s, probe.media.audio_duration_s) == (2.32, 3.008, 3.008)
    assert probe.media.handling == ("streams differ in length (video 2.320 s, audio 3.008 s): kept both as they are, "
                                    "the audio plays on alone")
    same = interpret_probe({"streams": [video_stream(), AUDIO], "format": FORMAT})  # 5.28 s and 5.31 s: normal
    assert same.media.handling is None


def test_a_matroska_stream_duration_comes_from_its_tag():
    video = video_stream(duration=None, tags={"DURATION": "00:00:02.320000000"})
    audio = {**AUDIO, "duration": None, "tags": {"DURATION": "00:00:03.008000000"}}
    probe = interpret_probe({"streams": [video, audio], "format": {**FORMAT, "duration": "3.008"}})
    assert (probe.media.duration_s, probe.audio_duration_s) == (2.32, 3.008)


def test_the_default_audio_track_is_chosen_else_the_first():
    first = {**AUDIO, "index": 1, "disposition": {"default": 0}}
    second = {**AUDIO, "index": 2, "disposition": {"default": 1}}
    probe = interpret_probe({"streams": [video_stream(), first, second], "format": FORMAT})
    assert probe.audio_stream == 2 and probe.media.handling.startswith("2 audio tracks: encoded stream 2")
    neither = {**second, "disposition": {"default": 0}}
    assert interpret_probe({"streams": [video_stream(), first, neither], "format": FORMAT}).audio_stream == 1


@pytest.mark.parametrize("field_order,deinterlace", [("tt", True), ("bb", True), ("tb", True), ("bt", True),
                                                     ("progressive", False), ("unknown", False), (None, False)])
def test_interlaced_video_is_deinterlaced(field_order, deinterlace):
    probe = interpret_probe({"streams": [video_stream(field_order=field_order), AUDIO], "format": FORMAT})
    assert probe.deinterlace is deinterlace
    assert ("deinterlaced with bwdif" in (probe.media.handling or "")) is deinterlace


def test_ten_bit_and_fast_sampled_audio_are_noted():
    probe = interpret_probe({"streams": [video_stream(pix_fmt="yuv420p10le"), {**AUDIO, "sample_rate": "96000"}],
                             "format": FORMAT})
    assert probe.audio_sample_rate == 96000
    assert probe.media.handling == ("pixel format yuv420p10le: converted to 8-bit yuv420p; "
                                    "audio sampled at 96000 Hz: resampled to 48000 Hz")


def test_stream_starts_are_relative_to_the_file_start():
    streams = [video_stream(start_time="11.4"), {**AUDIO, "start_time": "11.378667"}]
    probe = interpret_probe({"streams": streams, "format": {**FORMAT, "start_time": "11.378667"}})
    assert (round(probe.video_start_s, 6), probe.audio_start_s) == (0.021333, 0.0)
    assert probe.media.handling == "timestamps start at 11.379 s: shifted to start at 0"


def test_frames_an_edit_list_cuts_are_not_expected_in_the_output():
    # 80 packets in the index, 2.6 s at 25 fps shown: the edit list skips the first 15 frames
    probe = interpret_probe({"streams": [video_stream(duration="2.6", nb_frames="80"), AUDIO], "format": FORMAT})
    assert probe.media.frames == 65


def test_a_variable_frame_rate_is_recognised():
    vfr = interpret_probe({"streams": [video_stream(r_frame_rate="25/1", avg_frame_rate="400/23"), AUDIO],
                           "format": FORMAT})
    cfr = interpret_probe({"streams": [video_stream(r_frame_rate="25/1"), AUDIO], "format": FORMAT})
    assert (vfr.variable_frame_rate, cfr.variable_frame_rate) == (True, False)


def test_the_segment_command_deinterlaces_and_resamples_only_when_asked(tmp_path):
    from processors.segments import build_segment_command

    ladder = plan_ladder(media(640, 360), (240,))
    plain = build_segment_command(tmp_path / "src", tmp_path / "out", ladder, with_audio=True, segment_s=4,
                                  preset="ultrafast", duration_s=3.0, video_stream=0, audio_stream=1,
                                  audio_rate_hz=48000)
    odd = build_segment_command(tmp_path / "src", tmp_path / "out", ladder, with_audio=True, segment_s=4,
                                preset="ultrafast", duration_s=3.0, video_stream=0, audio_stream=1,
                                deinterlace=True, audio_rate_hz=96000)
    graph = lambda args: args[args.index("-filter_complex") + 1]  # noqa: E731
    assert "bwdif" not in graph(plain) and "-ar" not in plain
    assert "bwdif=deint=all:mode=send_frame:parity=auto" in graph(odd)
    assert odd[odd.index("-ar") + 1] == "48000"

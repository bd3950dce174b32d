"""The pure parts of checkpointed segment transcoding: boundaries, the resume plan, rendition checks,
playlists, the timeline's reuse summary, and the projection's fencing of a zombie's checkpoint."""

from __future__ import annotations

import pytest

from processors import ts_scan
from domain.policy import segment_plan
from domain.policy.segment_plan import AUDIO, Checkpoint, LocalSegment, plan_resume
from domain.policy.retry import Action, RetryPolicy, retry_decision
from domain.lifecycle import evolve
from domain import events as ev
from projections.presenter import reused_segments
from domain.errors import TranscodeFailed
from tests.unit.test_fold import T0, fold_all, happy_path, new

FRAME = 0.04
NAMES = ["720p", "360p"]


def cp(rendition, index, attempt=1, start=None, duration=4.0, frames=100, sha="ab"):
    start = index * 4.0 if start is None else start
    return Checkpoint(attempt, rendition, index, f"work/j/transcode/{attempt}/{rendition}/seg_{index:05d}.ts", sha,
                      frames, start, duration)


def ladder_of(count, attempt=1, names=NAMES):
    return [cp(name, i, attempt) for name in names for i in range(count)]


def test_boundaries_sit_just_before_each_multiple_of_the_segment_length():
    assert [segment_plan.boundary_s(i, 4.0) for i in range(3)] == [0.0, 3.999, 7.999]
    assert segment_plan.expected_segments(31.7, 4.0) == 8
    assert segment_plan.expected_segments(8.0, 4.0) == 2
    assert segment_plan.expected_segments(0.5, 4.0) == 1


def test_nothing_recorded_means_start_from_zero():
    plan = plan_resume([], NAMES, 4.0, FRAME)
    assert (plan.start_index, plan.reused, plan.start_s) == (0, [], 0.0)


def test_the_longest_prefix_every_rendition_has_is_reused():
    recorded = ladder_of(3) + [cp("720p", 3)]  # 720p got one segment further than 360p
    plan = plan_resume(recorded, NAMES, 4.0, FRAME)
    assert plan.start_index == 3 and plan.start_s == 12.0
    assert {name: [c.index for c in plan.video[name]] for name in NAMES} == {"720p": [0, 1, 2], "360p": [0, 1, 2]}


def test_a_missing_segment_ends_the_prefix_even_when_later_ones_exist():
    recorded = [c for c in ladder_of(4) if (c.rendition, c.index) != ("360p", 1)]
    assert plan_resume(recorded, NAMES, 4.0, FRAME).start_index == 1


def test_the_newest_attempt_wins_for_a_segment_recorded_twice():
    recorded = ladder_of(2, attempt=1) + [cp("720p", 1, attempt=2, sha="cd")]
    plan = plan_resume(recorded, NAMES, 4.0, FRAME)
    assert plan.video["720p"][1].attempt == 2 and plan.video["720p"][1].sha256 == "cd"
    again = plan_resume(recorded + [cp("720p", 1, attempt=2, sha="ef")], NAMES, 4.0, FRAME)
    assert again.video["720p"][1].sha256 == "ef"  # recorded later by the same attempt


@pytest.mark.parametrize("bad", [
    cp("360p", 1, start=4.1),                # not aligned with 720p's segment 1
    cp("360p", 1, start=4.2, duration=3.8),  # nor continuous with its own segment 0
])
def test_misaligned_segments_are_not_reused(bad):
    recorded = [c for c in ladder_of(3) if (c.rendition, c.index) != ("360p", 1)] + [bad]
    assert plan_resume(recorded, NAMES, 4.0, FRAME).start_index == 1


def test_checkpoints_of_another_segment_length_are_not_reused():
    recorded = [cp(name, i, start=i * 6.0, duration=6.0) for name in NAMES for i in range(3)]
    assert plan_resume(recorded, NAMES, 4.0, FRAME).start_index == 0


def test_the_last_segment_of_the_source_may_be_short_and_then_the_video_is_complete():
    recorded = ladder_of(2) + [cp(name, 2, duration=3.88) for name in NAMES]
    assert plan_resume(recorded, NAMES, 4.0, FRAME).start_index == 2  # a short segment that is not the last
    plan = plan_resume(recorded, NAMES, 4.0, FRAME, duration_s=11.861)
    assert plan.start_index == 3 and plan.video_complete(11.861, FRAME)
    assert not plan_resume(ladder_of(2), NAMES, 4.0, FRAME, duration_s=11.861).video_complete(11.861, FRAME)


def test_a_segment_that_ends_short_of_its_boundary_ends_the_prefix():
    recorded = ladder_of(1) + [cp(name, 1, start=4.0, duration=3.0) for name in NAMES] + \
        [cp(name, 2, start=8.0) for name in NAMES]
    assert plan_resume(recorded, NAMES, 4.0, FRAME).start_index == 1


def test_audio_is_reused_only_as_a_complete_set_of_one_attempt():
    audio1 = [cp(AUDIO, i, attempt=1) for i in range(3)]
    audio2 = [cp(AUDIO, i, attempt=2) for i in (0, 2)]  # attempt 2's set lost segment 1 (failed sha256)
    plan = plan_resume(ladder_of(1) + audio1 + audio2, NAMES, 4.0, FRAME)
    assert [(c.attempt, c.index) for c in plan.audio] == [(1, 0), (1, 1), (1, 2)]
    assert plan_resume(ladder_of(1) + audio2, NAMES, 4.0, FRAME).audio == []


def seg(name, index, start, duration=4.0, frames=100):
    return LocalSegment(name, index, None, "ab", 10, frames, start, duration)


def test_a_whole_rendition_passes_its_checks():
    parts = [seg("720p", 0, 0.0), seg("720p", 1, 4.0), seg("720p", 2, 8.0, 3.88, 97)]
    segment_plan.check_rendition("720p", parts, FRAME, 297, 11.861, 0.06)


@pytest.mark.parametrize("parts,expected_frames,duration,message", [
    ([seg("720p", 0, 0.0), seg("720p", 2, 4.0)], 200, 8.0, "not numbered"),
    ([seg("720p", 0, 0.0), seg("720p", 1, 4.08)], 200, 8.08, "gap or overlap before segment 1"),
    ([seg("720p", 0, 0.0), seg("720p", 1, 3.96)], 200, 7.96, "gap or overlap before segment 1"),
    ([seg("720p", 0, 0.5), seg("720p", 1, 4.5)], 200, 8.5, "starts at 0.500 s, its source stream at 0.000 s"),
    ([seg("720p", 0, 0.0), seg("720p", 1, 4.0)], 200, 31.7, "8.000 s long, its source stream 31.700 s"),
    ([seg("720p", 0, 0.0), seg("720p", 1, 4.0)], 203, 8.0, "200 frames, the source has 203"),
    ([], 0, 1.0, "no segments"),
])
def test_a_rendition_that_does_not_match_the_probe_fails_the_attempt(parts, expected_frames, duration, message):
    with pytest.raises(TranscodeFailed, match=message) as failed:
        segment_plan.check_rendition("720p", parts, FRAME, expected_frames, duration, 0.06)
    # deterministic: the same source encodes the same, so the job fails at once instead of 3 x unknown
    assert failed.value.error_class == "unsupported_media"
    assert retry_decision(failed.value.error_class, 1, RetryPolicy()).action is Action.FAIL


def test_each_rendition_is_checked_against_its_own_stream():
    # issue 21: audio 3.008 s beside video 2.320 s. Each passes against its own stream's duration...
    video = [seg("720p", 0, 0.0, 2.32, 58)]
    audio = [seg(AUDIO, 0, -0.021, 3.029, 142)]
    segment_plan.check_rendition("720p", video, FRAME, 58, 2.32, 0.06)
    segment_plan.check_rendition(AUDIO, audio, FRAME, None, 3.008, 0.16)
    # ...and the audio fails against the video's, as it did when one source duration was used for all
    with pytest.raises(TranscodeFailed, match="rendition audio: 3.008 s long, its source stream 2.320 s"):
        segment_plan.check_rendition(AUDIO, audio, FRAME, None, 2.32, 0.16)


def test_a_stream_that_starts_after_the_file_is_checked_from_its_own_start():
    late = [seg("720p", 0, 0.5, 3.5, 88), seg("720p", 1, 4.0, 4.0, 100)]
    segment_plan.check_rendition("720p", late, FRAME, 188, 7.5, 0.06, start_s=0.5)
    with pytest.raises(TranscodeFailed, match="starts at 0.500 s, its source stream at 0.000 s"):
        segment_plan.check_rendition("720p", late, FRAME, 188, 7.5, 0.06)


def test_a_variable_frame_rate_source_may_leave_a_hole_at_a_join_but_never_an_overlap():
    holed = [seg("720p", 0, 0.0, 4.0, 100), seg("720p", 1, 4.08, 3.92, 60)]
    with pytest.raises(TranscodeFailed, match="gap or overlap before segment 1"):
        segment_plan.check_rendition("720p", holed, FRAME, 160, 8.0, 0.06)
    segment_plan.check_rendition("720p", holed, FRAME, 160, 8.0, 0.06, max_gap_s=1.0)
    segment_plan.check_join(holed[0], holed[1], FRAME, max_gap_s=1.0)
    overlap = [seg("720p", 0, 0.0, 4.0, 100), seg("720p", 1, 3.92, 4.08, 100)]
    with pytest.raises(TranscodeFailed, match="gap or overlap before segment 1"):
        segment_plan.check_rendition("720p", overlap, FRAME, 200, 8.0, 0.06, max_gap_s=1.0)
    with pytest.raises(TranscodeFailed, match="starts at 3.920 s"):
        segment_plan.check_join(overlap[0], overlap[1], FRAME, max_gap_s=1.0)


def test_a_resumed_segment_must_start_where_the_reused_one_ended():
    segment_plan.check_join(cp("720p", 1), seg("720p", 2, 8.0), FRAME)
    with pytest.raises(TranscodeFailed, match="720p segment 2 starts at 10.600 s, the previous one ends at 8.000 s"):
        segment_plan.check_join(cp("720p", 1), seg("720p", 2, 10.6), FRAME)


def test_media_playlist_lists_every_segment_with_its_duration():
    assert segment_plan.media_playlist([4.0, 4.0, 3.88]).splitlines() == [
        "#EXTM3U", "#EXT-X-VERSION:3", "#EXT-X-TARGETDURATION:4", "#EXT-X-MEDIA-SEQUENCE:0",
        "#EXT-X-PLAYLIST-TYPE:VOD", "#EXT-X-INDEPENDENT-SEGMENTS",
        "#EXTINF:4.000000,", "seg_00000.ts", "#EXTINF:4.000000,", "seg_00001.ts", "#EXTINF:3.880000,", "seg_00002.ts",
        "#EXT-X-ENDLIST"]
    assert "#EXT-X-TARGETDURATION:5" in segment_plan.media_playlist([4.0, 4.04])


def test_scan_refuses_bytes_that_are_not_mpeg_ts():
    with pytest.raises(TranscodeFailed, match="not MPEG-TS"):
        ts_scan.scan_ts(b"\x00" * 376)


def test_timeline_names_the_segments_a_success_reused_per_attempt():
    outputs = [{"key": f"work/j/transcode/{a}/{r}/seg_{i:05d}.ts"} for a, r, i in
               [(1, "720p", 0), (1, "720p", 1), (2, "720p", 2), (1, "360p", 0), (2, "audio", 0)]]
    outputs.append({"key": "work/j/transcode/2/720p/index.m3u8"})
    assert reused_segments({"outputs": outputs}, 2) == "360p 0 (attempt 1); 720p 0-1 (attempt 1)"
    assert reused_segments({"outputs": outputs[2:3]}, 2) == ""


def test_a_zombie_checkpoint_after_the_next_attempt_started_is_superseded():
    events = happy_path()[:3]  # accepted, queued, attempt 1 started with token tok-t
    retry = [new(ev.StageQueued, attempt=2, token="tok-t", tier="standard", work_topic="w"),
             new(ev.AttemptStarted, attempt=2, token="tok-2", lease_s=30.0, worker="w2", work_topic="w",
                 work_partition=0, work_offset=1)]
    row, outcomes = fold_all(events + retry)
    checkpoint = dict(sequence=1, segment_index=3, rendition="720p", object_key="work/j/transcode/1/720p/seg_00003.ts",
                      sha256="ab", frames=100, media_start_s=12.0, media_duration_s=4.0)
    late = evolve(row, new(ev.CheckpointRecorded, attempt=1, token="tok-t", **checkpoint), T0)
    assert (late.applied, late.superseded) == (False, True)
    current = evolve(row, new(ev.CheckpointRecorded, attempt=2, token="tok-2", **checkpoint), T0)
    assert (current.applied, current.superseded) == (True, False)


def test_a_resume_seeks_half_a_frame_before_the_boundary_on_the_encoder_grid():
    from fractions import Fraction

    # 25 fps: boundary 11.999 s rounds to frame 300 (12 s); frames from 11.98 s round onto it.
    assert segment_plan.resume_seek_s(3, 4.0, Fraction(25)) == pytest.approx(11.98)
    # NTSC 30000/1001: boundary 3.999 s is frame 119.88 -> 120; the cut is at 119.5 frames.
    assert segment_plan.resume_seek_s(1, 4.0, Fraction(30000, 1001)) == pytest.approx(119.5 * 1001 / 30000)
    # No rate known, or the first segment: the boundary itself.
    assert segment_plan.resume_seek_s(3, 4.0, None) == segment_plan.boundary_s(3, 4.0)
    assert segment_plan.resume_seek_s(0, 4.0, Fraction(25)) == 0.0


def test_the_encoder_frame_rate_follows_ffmpegs_guess():
    from fractions import Fraction

    from processors.media import encoder_frame_rate_of

    assert encoder_frame_rate_of({"r_frame_rate": "25/1", "avg_frame_rate": "50688/2031"}) == Fraction(25)
    assert encoder_frame_rate_of({"r_frame_rate": "90000/1", "avg_frame_rate": "30000/1001"}) == Fraction(30000, 1001)
    assert encoder_frame_rate_of({"r_frame_rate": "0/0", "avg_frame_rate": "24/1"}) == Fraction(24)
    assert encoder_frame_rate_of({"r_frame_rate": "N/A"}) is None

"""Checkpointed segment encoding against a single pass, with real ffmpeg and ffprobe (issue 4, item 3).

A run is stopped after k segments of every rendition are complete (a crash after k checkpoints),
a second run resumes from the recorded segments, and the assembled renditions are compared packet
by packet with a single-pass encode of the same source: same frames, same timestamps, no gap or
overlap at the joins, audio once and in sync, playlists that decode cleanly.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from processors import media, segments
from domain.policy import segment_plan
from domain.policy.segment_plan import AUDIO, Checkpoint
from processors.transcode import reuse_verified
from tapeline.objectstore import ObjectStore

pytestmark = pytest.mark.integration

SEGMENT_S = 4.0
PRESET = "ultrafast"


@pytest.fixture(scope="module", params=["looped", "one-keyframe"])
def source(request, tmp_path_factory) -> Path:
    """The real bigbuckbunny sample looped three times: about 15.9 s of 1280x720 H.264/AAC, 25 fps.

    `looped`: keyframes only at each loop start (5.3 s GOPs, so every resume seeks into a GOP and no
    source keyframe sits where the split wants one). `one-keyframe`: the video re-encoded with a
    single keyframe at 0 (one 15.9 s GOP, the "very long GOP" of issue 4's bad input): a resume
    decodes from the very start, and the split must still be exact since the output's keyframes are
    forced at the boundaries, not taken from the source."""
    from tapeline.samples import sample_video

    folder = tmp_path_factory.mktemp("media")
    path = folder / "bigbuckbunny-x3.mp4"
    subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-stream_loop", "2", "-i", str(sample_video()),
                    "-c", "copy", "-y", str(path)], check=True, timeout=120)
    if request.param == "one-keyframe":
        reencoded = folder / "bigbuckbunny-x3-one-keyframe.mp4"
        subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-i", str(path), "-map", "0", "-c:a", "copy",
                        "-fps_mode", "passthrough", "-c:v", "libx264", "-preset", "ultrafast", "-g", "100000", "-keyint_min", "100000",
                        "-sc_threshold", "0", "-y", str(reencoded)], check=True, timeout=300)
        path = reencoded
    keyframes = [p for p in packets([path], "v:0") if p["key"]]
    assert len(keyframes) == (3 if request.param == "looped" else 1)
    # Where a resume at 12 s starts decoding (the no-progress grace of a resumed attempt).
    assert media.keyframe_before(path, 12.0) == (10.581406 if request.param == "looped" else 0.0)
    return path


@pytest.fixture(scope="module")
def inspected(source):
    return media.inspect_source(source)


@pytest.fixture(scope="module")
def probe(inspected):
    return inspected.media


@pytest.fixture(scope="module")
def ladder(probe):
    return media.plan_ladder(probe, (720, 360))


def encode(source, probe, ladder, out_dir: Path, start_index: int = 0, with_audio: bool = True,
           stop_after: int | None = None) -> dict[str, list[segment_plan.LocalSegment]]:
    """Run the segment encoder; with `stop_after`, stop ffmpeg once that many segments of every video
    rendition are complete (as a crash would) and keep only the completed ones."""
    names = [r.name for r in ladder]
    command = segments.build_segment_command(source, out_dir, ladder, with_audio=with_audio, segment_s=SEGMENT_S,
                                             preset=PRESET, duration_s=probe.duration_s, start_index=start_index,
                                             frame_rate=media.inspect_source(source).encoder_frame_rate)
    watcher = segments.SegmentWatcher(out_dir, names, start_index)
    done: dict[str, list[segment_plan.LocalSegment]] = {name: [] for name in names + [AUDIO]}
    stop = [False]

    def tick():
        for segment in watcher.poll():
            done[segment.rendition].append(segment)
        if stop_after is not None and all(len(done[n]) >= stop_after for n in names):
            stop[0] = True

    result = media.run_ffmpeg(command, on_tick=tick, should_stop=lambda: stop[0], tick_s=0.05)
    if stop_after is not None:
        assert stop[0], "the encode finished before it could be stopped"
        tick()
        return done
    assert result.returncode == 0, result.stderr_tail
    for segment in watcher.poll(ended=True):
        done[segment.rendition].append(segment)
    if with_audio:
        done[AUDIO] = segments.SegmentWatcher(out_dir, [AUDIO]).poll(ended=True)
    return done


def as_checkpoint(segment: segment_plan.LocalSegment, attempt: int = 1) -> Checkpoint:
    return Checkpoint(attempt, segment.rendition, segment.index, str(segment.path), segment.sha256, segment.frames,
                      segment.start_s, segment.duration_s)


def packets(paths: list[Path], stream: str) -> list[dict]:
    """Every packet of the files, in order: pts and dts in 90 kHz ticks and the keyframe flag."""
    found = []
    for path in paths:
        done = subprocess.run(["ffprobe", "-v", "error", "-select_streams", stream, "-show_entries",
                               "packet=pts,dts,flags", "-of", "json", str(path)],
                              capture_output=True, text=True, check=True, timeout=60)
        found += [{"pts": int(p["pts"]), "dts": int(p["dts"]), "key": "K" in p["flags"], "file": path.name}
                  for p in json.loads(done.stdout)["packets"]]
    return found


@pytest.fixture(scope="module")
def single_pass(source, probe, ladder, tmp_path_factory):
    return encode(source, probe, ladder, tmp_path_factory.mktemp("single") / "out")


@pytest.fixture(scope="module")
def crashed(source, probe, ladder, tmp_path_factory):
    """The completed segments of a run stopped once two segments of every rendition were complete."""
    return encode(source, probe, ladder, tmp_path_factory.mktemp("crashed") / "out", stop_after=2)


@pytest.fixture(scope="module")
def resumed(source, probe, ladder, crashed, tmp_path_factory):
    """Segments 0..k-1 from a run stopped after k segments, the rest from a resumed run."""
    names = [r.name for r in ladder]
    recorded = [as_checkpoint(s) for name in names for s in crashed[name]]
    plan = segment_plan.plan_resume(recorded, names, SEGMENT_S, 1 / probe.fps)
    assert plan.start_index >= 2 and plan.audio == []
    rest = encode(source, probe, ladder, tmp_path_factory.mktemp("resumed") / "out", start_index=plan.start_index)
    return plan, rest


def test_resume_starts_after_the_recorded_segments_and_encodes_only_the_rest(resumed, single_pass, ladder):
    plan, rest = resumed
    total = len(single_pass[ladder[0].name])
    assert total == segment_plan.expected_segments(15.88, SEGMENT_S) == 4
    for rung in ladder:
        assert [c.index for c in plan.video[rung.name]] == list(range(plan.start_index))
        assert [s.index for s in rest[rung.name]] == list(range(plan.start_index, total))


def test_a_resume_at_any_boundary_starts_with_the_frames_of_the_single_pass(source, probe, ladder, single_pass,
                                                                             tmp_path):
    """The looped source's third loop has frames 0.54 of a frame off the 40 ms grid (11.981 s,
    12.021 s): the encoder rounds 11.981 s onto the 12 s boundary, so a resume at segment 3 must
    keep that frame (it seeks half a frame before the rounded boundary, not to the boundary)."""
    total = len(single_pass[ladder[0].name])
    for start in range(1, total):
        rest = encode(source, probe, ladder[-1:], tmp_path / str(start), start_index=start, with_audio=False)
        first, expected = rest[ladder[-1].name][0], single_pass[ladder[-1].name][start]
        assert (first.index, first.start_s, first.frames) == (start, expected.start_s, expected.frames), start
        assert [(s.start_s, s.frames) for s in rest[ladder[-1].name]] == \
            [(s.start_s, s.frames) for s in single_pass[ladder[-1].name][start:]]


def test_assembled_renditions_match_a_single_pass_packet_for_packet(resumed, single_pass, ladder, probe):
    plan, rest = resumed
    for rung in ladder:
        assembled = [Path(c.key) for c in plan.video[rung.name]] + [s.path for s in rest[rung.name]]
        joined, single = packets(assembled, "v:0"), packets([s.path for s in single_pass[rung.name]], "v:0")
        # Same frames with the same timestamps and keyframes: frame-exact against the single pass.
        assert [(p["pts"], p["dts"], p["key"]) for p in joined] == [(p["pts"], p["dts"], p["key"]) for p in single]
        assert len(joined) == probe.frames == 396
        stamps = sorted(p["pts"] for p in single)
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        frame_ticks = max(set(gaps), key=gaps.count)
        assert frame_ticks == 3600  # 25 fps in 90 kHz ticks
        # One keyframe per segment, first in its file; no gap or overlap at any join.
        files = [p["file"] for p in joined]
        assert [p["key"] for p in joined] == [i == 0 or files[i] != files[i - 1] for i in range(len(joined))]
        for a, b in zip(assembled, assembled[1:]):
            last = max(p["pts"] for p in packets([a], "v:0"))
            first = min(p["pts"] for p in packets([b], "v:0"))
            assert first - last == frame_ticks, (a.name, b.name)
        # Duration within one frame of the source's video stream.
        parts = plan.video[rung.name] + rest[rung.name]
        segment_plan.check_rendition(rung.name, parts, 1 / probe.fps, probe.frames, probe.duration_s, 1 / probe.fps)


def test_audio_is_encoded_once_and_in_sync(resumed, single_pass, probe, ladder):
    _, rest = resumed
    audio_joined = packets([s.path for s in rest[AUDIO]], "a:0")
    audio_single = packets([s.path for s in single_pass[AUDIO]], "a:0")
    assert [p["pts"] for p in audio_joined] == [p["pts"] for p in audio_single]
    # Continuous: every audio segment starts where the previous ended (no per-segment priming).
    aac_frame_s = 1024 / 48000
    for a, b in zip(rest[AUDIO], rest[AUDIO][1:]):
        assert abs(a.start_s + a.duration_s - b.start_s) < 2 / 90000
    # Audio and video start and end within one AAC frame (1024 samples) of each other.
    video = single_pass[ladder[0].name]
    assert abs(rest[AUDIO][0].start_s - video[0].start_s) <= aac_frame_s + 1e-6
    audio_end = rest[AUDIO][-1].start_s + rest[AUDIO][-1].duration_s
    assert abs(audio_end - (video[-1].start_s + video[-1].duration_s)) <= aac_frame_s


def test_playlists_of_the_assembled_rendition_decode_cleanly(resumed, tmp_path, ladder):
    plan, rest = resumed
    for name in (ladder[0].name, AUDIO):
        parts = plan.video.get(name, []) + rest[name] if name != AUDIO else rest[name]
        folder = tmp_path / name
        folder.mkdir()
        for part in parts:
            src = Path(part.key) if isinstance(part, Checkpoint) else part.path
            (folder / segment_plan.segment_name(part.index)).write_bytes(src.read_bytes())
        (folder / "index.m3u8").write_text(segment_plan.media_playlist([p.duration_s for p in parts]))
        done = subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-i", str(folder / "index.m3u8"), "-f", "null", "-"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert media.probe_duration(folder / "index.m3u8") == pytest.approx(sum(p.duration_s for p in parts), abs=0.05)


def test_a_corrupted_or_missing_checkpoint_object_is_redone_not_reused(base_settings, crashed, ladder, probe, tmp_path):
    store = ObjectStore(base_settings)
    prefix = f"work/{uuid.uuid4()}/transcode/1/"
    recorded = []
    for rung in ladder:
        for segment in crashed[rung.name][:2]:
            key = f"{prefix}{rung.name}/{segment.path.name}"
            store.upload_file(segment.path, key, "video/mp2t")
            recorded.append(Checkpoint(1, rung.name, segment.index, key, segment.sha256, segment.frames,
                                       segment.start_s, segment.duration_s))
    frame_s, names = 1 / probe.fps, [r.name for r in ladder]
    plan, sizes = reuse_verified(store, recorded, names, tmp_path, SEGMENT_S, frame_s, probe.duration_s)
    assert plan.start_index == 2 and set(sizes) == {c.key for c in recorded}

    # Someone overwrote 360p segment 1 in S3: it is redone (and so is every later one), never trusted.
    store.s3.put_object(Bucket=store.bucket, Key=f"{prefix}360p/seg_00001.ts", Body=b"\x47" + b"\x00" * 187)
    plan, sizes = reuse_verified(store, recorded, names, tmp_path, SEGMENT_S, frame_s, probe.duration_s)
    assert plan.start_index == 1 and set(sizes) == {f"{prefix}{n}/seg_00000.ts" for n in names}
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.ts")) == [
        f"{n}/seg_00000.ts" for n in sorted(names)]

    # A recorded object that is gone is not reused either.
    store.s3.delete_object(Bucket=store.bucket, Key=f"{prefix}720p/seg_00000.ts")
    plan, sizes = reuse_verified(store, recorded, names, tmp_path, SEGMENT_S, frame_s, probe.duration_s)
    assert (plan.start_index, sizes) == (0, {}) and list(tmp_path.rglob("*.ts")) == []


def test_when_every_video_segment_is_reused_only_the_audio_is_encoded(source, probe, single_pass, tmp_path):
    command = segments.build_segment_command(source, tmp_path / "out", [], with_audio=True, segment_s=SEGMENT_S,
                                             preset=PRESET, duration_s=probe.duration_s, start_index=4)
    assert "-ss" not in command and "libx264" not in command
    result = media.run_ffmpeg(command)
    assert result.returncode == 0, result.stderr_tail
    audio = segments.SegmentWatcher(tmp_path / "out", [AUDIO]).poll(ended=True)
    assert [p["pts"] for p in packets([s.path for s in audio], "a:0")] == \
        [p["pts"] for p in packets([s.path for s in single_pass[AUDIO]], "a:0")]

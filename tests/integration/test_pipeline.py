"""One real video through upload -> transcode -> thumbnails -> publish (the `default` profile) on real Kafka, PostgreSQL, S3 and ffmpeg,
with every processor running as a real child process (`tapeline run --role all`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
import subprocess
from pathlib import Path

import httpx

import psycopg
import pytest

from domain.errors import OutputConflict
from producers.submit import publish, upload
from tapeline.objectstore import ObjectStore
from tests.conftest import tapeline_cli, wait_for
from tests.integration.helpers import committed_events, decodes, ffprobe_duration, keys_under, of_job
from tapeline.samples import sample_video

pytestmark = pytest.mark.integration


def submit_json(settings, path: Path, timeout_s: float = 300) -> dict:
    done = tapeline_cli(settings, "submit", str(path), "--wait", "--json", "--timeout", str(timeout_s))
    assert done.stdout.strip(), f"no JSON from submit: {done.stderr}"
    return json.loads(done.stdout)


def db_row(settings, sql: str, *params):
    with psycopg.connect(settings.database_url, row_factory=psycopg.rows.dict_row) as conn:
        return conn.execute(sql, params).fetchone()


def test_real_video_is_transcoded_and_published(isolated, pipeline):
    source = sample_video("bigbuckbunny.mp4")
    result = submit_json(isolated, source)
    assert result["state"] == "completed", result
    assert result["attempts"] == 1
    job_id = result["job_id"]
    source_video_s = ffprobe_duration(str(source), "v:0")
    assert result["source_duration_s"] == pytest.approx(source_video_s, abs=0.05)

    # At least three renditions, never upscaled, even sizes, 16:9 kept.
    names = [o["name"] for o in result["outputs"]]
    assert names == ["720p", "480p", "360p", "240p"]
    for output in result["outputs"]:
        assert output["height"] <= 720 and output["width"] % 2 == 0 and output["height"] % 2 == 0
        assert output["width"] / output["height"] == pytest.approx(16 / 9, rel=0.01)

    # Everything decodes over plain HTTP from the S3 endpoint; durations match the source.
    assert result["master_url"].startswith(isolated.s3_endpoint)
    master = decodes(result["master_url"])
    assert master.returncode == 0 and master.stderr == "", master.stderr
    for output in result["outputs"]:
        assert abs(ffprobe_duration(output["url"]) - source_video_s) <= 0.1, output
        clean = decodes(output["url"])
        assert clean.returncode == 0 and clean.stderr == "", clean.stderr

    # Exactly one committed JobCompleted; the lifecycle is complete and in order.
    events = of_job(committed_events(isolated), job_id)
    # The `default` profile: transcode -> thumbnails -> publish, recorded in JobAccepted.
    assert [(e.event_type, e.stage) for e in events if e.event_type not in ("CheckpointRecorded", "Heartbeat")] == [
        ("JobAccepted", "intake"), ("StageQueued", "transcode"), ("AttemptStarted", "transcode"),
        ("AttemptSucceeded", "transcode"), ("StageQueued", "thumbnails"), ("AttemptStarted", "thumbnails"),
        ("AttemptSucceeded", "thumbnails"), ("StageQueued", "publish"), ("AttemptStarted", "publish"),
        ("PublishIntended", "publish"), ("AttemptSucceeded", "publish"), ("Published", "publish"),
        ("JobCompleted", "publish")]
    accepted = of_job(events, job_id, "JobAccepted")[0]
    assert (accepted.pipeline, accepted.pipeline_stages) == ("default", ["transcode", "thumbnails", "publish"])
    # Every segment of every rendition was checkpointed between the claim and the success, and the
    # transcode outputs are exactly those segments plus one playlist per rendition.
    checkpoints = of_job(events, job_id, "CheckpointRecorded")
    types = [e.event_type for e in events]
    assert types.index("AttemptStarted") < types.index("CheckpointRecorded")
    assert types.index("AttemptSucceeded") > len(types) - 1 - types[::-1].index("CheckpointRecorded")
    assert {c.rendition for c in checkpoints} == {"720p", "480p", "360p", "240p", "audio"}
    assert [c.segment_index for c in checkpoints if c.rendition == "720p"] == [0, 1]  # 5.3 s at 4 s a segment
    segment_outputs = {o.key: o.sha256 for o in of_job(events, job_id, "AttemptSucceeded")[0].outputs
                       if o.key.endswith(".ts")}
    assert segment_outputs == {c.object_key: c.sha256 for c in checkpoints}
    completed = of_job(events, job_id, "JobCompleted")
    assert len(completed) == 1 and completed[0].master_url == result["master_url"]

    # job_state agrees with the log, and the published objects are exactly the named set.
    row = db_row(isolated, "SELECT * FROM job_state WHERE job_id = %s", job_id)
    assert row["state"] == "completed" and row["master_url"] == result["master_url"]
    assert [(r["name"], r["url"]) for r in row["renditions"]] == [(o["name"], o["url"]) for o in result["outputs"]]
    published = of_job(events, job_id, "AttemptSucceeded")[-1]
    assert keys_under(isolated, f"published/{job_id}/") == {o.key for o in published.outputs}
    transcoded = of_job(events, job_id, "AttemptSucceeded")[0]
    assert all(o.key.startswith(f"work/{job_id}/transcode/1/") for o in transcoded.outputs)
    check_thumbnails(isolated, result, events, source_video_s)

    # The timeline shows every event with its attempt and broker timestamp.
    timeline = tapeline_cli(isolated, "timeline", job_id, "--json")
    assert timeline.returncode == 0, timeline.stderr
    rows = json.loads(timeline.stdout)
    assert [r["event_type"] for r in rows] == [e.event_type for e in events]
    assert all(r["broker_ts"] and r["attempt"] is not None for r in rows)


def check_thumbnails(settings, result: dict, events: list, duration_s: float) -> None:
    """The thumbnails stage's outputs, as a player reads them: published beside the master playlist,
    listed by `submit --json`; the WebVTT track's cues run back to back over the whole duration and
    each `#xywh` tile lies inside the storyboard sprite; the poster is a JPEG that is not blank."""
    job_id = result["job_id"]
    made = of_job(events, job_id, "AttemptSucceeded")[1]
    assert made.stage == "thumbnails" and {o.key.rsplit("/", 1)[1] for o in made.outputs} == {
        "poster.jpg", "storyboard.jpg", "storyboard.vtt"}
    assert all(o.key.startswith(f"work/{job_id}/thumbnails/1/thumbnails/") for o in made.outputs)
    base = result["master_url"].rsplit("/", 1)[0]
    artifacts = {a["name"]: a for a in result["artifacts"]}
    assert set(artifacts) == {"thumbnails/poster.jpg", "thumbnails/storyboard.jpg", "thumbnails/storyboard.vtt"}
    for name, artifact in artifacts.items():
        assert artifact["url"] == f"{base}/{name}" and artifact["stage"] == "thumbnails"
        body = httpx.get(artifact["url"], timeout=30).raise_for_status().content
        assert hashlib.sha256(body).hexdigest() == artifact["sha256"]
    track = httpx.get(artifacts["thumbnails/storyboard.vtt"]["url"], timeout=30).text
    sprite_w, sprite_h = image_size(artifacts["thumbnails/storyboard.jpg"]["url"])
    cues = re.findall(r"(\d\d):(\d\d):(\d\d\.\d{3}) --> (\d\d):(\d\d):(\d\d\.\d{3})\n(\S+)#xywh=(\d+),(\d+),(\d+),(\d+)",
                      track)
    assert track.startswith("WEBVTT\n") and len(cues) == 3  # 5.3 s, a tile every 2 s
    times = [(int(a) * 3600 + int(b) * 60 + float(c), int(d) * 3600 + int(e) * 60 + float(f))
             for a, b, c, d, e, f, *_ in cues]
    assert times[0][0] == 0.0 and times[-1][1] == pytest.approx(duration_s, abs=0.05)
    assert all(end == start for (_, end), (start, _) in zip(times, times[1:]))
    for *_, sprite, x, y, w, h in cues:
        assert sprite == "storyboard.jpg"  # beside the track: published/<job>/thumbnails/
        assert int(x) + int(w) <= sprite_w and int(y) + int(h) <= sprite_h and int(w) > 0 and int(h) > 0
    poster_w, poster_h = image_size(artifacts["thumbnails/poster.jpg"]["url"])
    assert (poster_w, poster_h) == (1280, 720)
    # the published set is exactly what publish named: the renditions, the master and the thumbnails
    assert {f"published/{job_id}/{name}" for name in artifacts} <= keys_under(settings, f"published/{job_id}/")


def image_size(url: str) -> tuple[int, int]:
    done = subprocess.run(["ffprobe", "-v", "error", "-show_entries", "stream=width,height", "-of", "csv=p=0", url],
                          capture_output=True, text=True, timeout=60, check=True)
    width, height = done.stdout.strip().split(",")
    return int(width), int(height)


def test_same_upload_event_three_times_yields_one_job(isolated, pipeline):
    submission = upload(isolated, sample_video("carphone_pristine.mp4"))
    publish(isolated, submission.event, copies=3)
    job_id = submission.job_id

    def finished():
        row = db_row(isolated, "SELECT state FROM job_state WHERE job_id = %s", job_id)
        return row and row["state"] == "completed"

    wait_for(finished, 180, "the duplicated upload's job to complete")
    publish(isolated, submission.event)  # a fourth copy, after the job completed
    wait_for(lambda: (db_row(isolated, "SELECT copies FROM uploads WHERE upload_id = %s", submission.upload_id)
                      or {}).get("copies") == 4, 60, "the projector to see all four copies")
    # Intake reads each copy only after the projector caught up, so the fourth has been decided on
    # once the next stage of the log is quiet; read the committed log.
    events = of_job(committed_events(isolated), job_id)
    assert len(of_job(events, job_id, "JobAccepted")) == 1
    assert len(of_job(events, job_id, "JobCompleted")) == 1
    assert [e.stage for e in of_job(events, job_id, "AttemptStarted")] == ["transcode", "thumbnails", "publish"]
    published = of_job(events, job_id, "AttemptSucceeded")[-1]
    assert keys_under(isolated, f"published/{job_id}/") == {o.key for o in published.outputs}
    assert keys_under(isolated, f"work/{job_id}/transcode/") == {
        o.key for o in of_job(events, job_id, "AttemptSucceeded")[0].outputs}
    # The small source (176x144 coded, sample aspect 128:117, so 192x144 displayed) gets one
    # rendition at its own display size, with square pixels.
    row = db_row(isolated, "SELECT renditions FROM job_state WHERE job_id = %s", job_id)
    assert [(r["width"], r["height"]) for r in row["renditions"]] == [(192, 144)]


@pytest.mark.parametrize("make_file,message", [
    (lambda d: d / "missing.mp4", "no such file"),
    (lambda d: d, "is a directory"),
    (lambda d: (d / "empty.mp4").write_bytes(b"") or d / "empty.mp4", "empty"),
])
def test_submit_refuses_unusable_paths_with_a_clear_message(isolated, tmp_path, make_file, message):
    done = tapeline_cli(isolated, "submit", str(make_file(tmp_path)))
    assert done.returncode == 1
    assert message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("name,content,error_class,reason", [
    ("notes.mp4", b"this is a text file, not a video\n" * 20, "invalid_input", "not a readable video"),
    ("playlist.mp4", b"#EXTM3U\n#EXT-X-TARGETDURATION:4\n#EXTINF:4,\nfile:///etc/passwd\n#EXT-X-ENDLIST\n",
     "invalid_input", "not a readable video"),
])
def test_bad_uploads_are_rejected_with_a_reason_and_crash_nothing(isolated, pipeline, tmp_path, name, content,
                                                                  error_class, reason):
    path = tmp_path / name
    path.write_bytes(content)
    result = submit_json(isolated, path, timeout_s=120)
    assert result["state"] == "rejected" and result["error_class"] == error_class
    assert reason in result["reason"] and result["attempts"] == 0
    timeline = json.loads(tapeline_cli(isolated, "timeline", result["job_id"], "--json").stdout)
    assert [r["event_type"] for r in timeline] == ["JobRejected"]
    assert reason in timeline[0]["payload"]["reason"]
    assert "child exited" not in pipeline.log_text()


def test_no_work_item_was_skipped_for_a_job_the_projection_had_not_caught_up_with(pipeline):
    """Regression: an idle worker read a new work item before the lifecycle log's commit markers were
    written, found no job row, and skipped the job as unknown (it then waited for the handoff timeout)."""
    assert '"work item received"' in pipeline.log_text()
    assert '"reason": "unknown job"' not in pipeline.log_text()


def test_a_published_key_holding_other_bytes_dead_letters_at_once_without_a_retry(isolated, pipeline, tmp_path):
    """Another deployment's object at the job's published key (a shared bucket): a retry would meet it
    again, so the publish ends the job as `output_conflict` after one attempt, reopenable by an operator."""
    import subprocess
    import uuid

    from tapeline.objectstore import ObjectStore

    source = tmp_path / "tagged.mp4"  # bytes of its own, so a job id of its own: no other test shares the key
    subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-i", str(sample_video("carphone_pristine.mp4")), "-c", "copy",
                    "-metadata", f"comment={uuid.uuid4()}", "-y", str(source)], check=True, timeout=60)
    submission = upload(isolated, source)
    job_id, store = submission.job_id, ObjectStore(isolated)
    squatter = f"published/{job_id}/master.m3u8"
    store.put_if_absent(squatter, b"#EXTM3U\n# written by another deployment\n", "application/vnd.apple.mpegurl")
    try:
        publish(isolated, submission.event)
        wait_for(lambda: (db_row(isolated, "SELECT state FROM job_state WHERE job_id = %s", job_id) or {}).get("state")
                 == "dead_lettered", 180, "the conflicting job to be dead-lettered")
        row = db_row(isolated, "SELECT stage, attempt, error_class, reason FROM job_state WHERE job_id = %s", job_id)
        assert (row["stage"], row["attempt"], row["error_class"]) == ("publish", 1, "output_conflict"), row
        assert squatter in row["reason"] and "different content" in row["reason"]
        events = of_job(committed_events(isolated), job_id)
        assert [e.attempt for e in of_job(events, job_id, "AttemptStarted") if e.stage == "publish"] == [1]
        assert [e.error_class for e in of_job(events, job_id, "JobDeadLettered")] == ["output_conflict"]
        assert not [e for e in of_job(events, job_id, "RetryScheduled") if e.stage == "publish"]
        assert store.get_bytes(squatter) == b"#EXTM3U\n# written by another deployment\n"  # never overwritten
        # Issue 45: one word everywhere. The event is not retryable (the error table's), the message says
        # what a retry would do in the table's words, and the object in the way is recorded and named.
        squatter_bytes = b"#EXTM3U\n# written by another deployment\n"
        squatter_sha = hashlib.sha256(squatter_bytes).hexdigest()
        failed = [e for e in of_job(events, job_id, "AttemptFailed") if e.stage == "publish"]
        assert [e.retryable for e in failed] == [False]
        assert "a retry would meet the same object again until it is removed" in failed[0].reason
        blocking = of_job(events, job_id, "JobDeadLettered")[0].in_the_way
        assert (blocking.key, blocking.size_bytes, blocking.sha256) == (squatter, len(squatter_bytes), squatter_sha)
        assert blocking.written_at is not None and blocking.written_at.tzinfo is not None
        status = json.loads(tapeline_cli(isolated, "status", job_id, "--json").stdout)
        diagnosis = status["diagnosis"]
        assert (diagnosis["permanent"], diagnosis["verdict"]) == (True, "Permanent")
        assert diagnosis["why"] == "output_conflict: a retry would meet the same object again until it is removed"
        assert f"`{squatter}` ({len(squatter_bytes)} bytes, sha256 {squatter_sha}, written " in diagnosis["summary"]
        assert f"tapeline dlq replay {job_id}/1" in diagnosis["action"]
        assert f"tapeline dlq fail {job_id}/1 --refund" in diagnosis["action"]
    finally:
        store.delete(squatter)


def test_an_archive_tier_job_preserves_its_source_first_and_never_publishes_it(isolated, pipeline):
    """The `archive` profile (archive -> transcode -> thumbnails -> publish): the archived copy and its
    manifest carry the source's sha256, read back from the real S3 endpoint; publish leaves them out."""
    source = sample_video("carphone_pristine.mp4")
    done = tapeline_cli(isolated, "submit", str(source), "--priority", "archive", "--wait", "--json",
                        "--timeout", "300")
    result = json.loads(done.stdout)
    assert result["state"] == "completed", result
    job_id = result["job_id"]
    events = of_job(committed_events(isolated), job_id)
    accepted = of_job(events, job_id, "JobAccepted")[0]
    assert (accepted.pipeline, accepted.pipeline_stages) == ("archive", ["archive", "transcode", "thumbnails", "publish"])
    assert [e.stage for e in of_job(events, job_id, "AttemptStarted")] == ["archive", "transcode", "thumbnails",
                                                                         "publish"]
    archived = [e for e in of_job(events, job_id, "AttemptSucceeded") if e.stage == "archive"][0]
    copy_key, manifest_key = f"archive/{job_id}/carphone_pristine.mp4", f"archive/{job_id}/manifest.json"
    assert [o.key for o in archived.outputs] == [copy_key, manifest_key]

    store = ObjectStore(isolated)
    source_sha = hashlib.sha256(source.read_bytes()).hexdigest()
    assert hashlib.sha256(store.get_bytes(copy_key)).hexdigest() == source_sha == archived.outputs[0].sha256
    manifest = json.loads(store.get_bytes(manifest_key))
    assert manifest == {"job_id": job_id, "source_key": accepted.source_key, "archive_key": copy_key,
                        "size_bytes": source.stat().st_size, "sha256": source_sha, "algorithm": "sha256",
                        "written_by": "tapeline archive stage"}
    assert keys_under(isolated, f"archive/{job_id}/") == {copy_key, manifest_key}
    published = keys_under(isolated, f"published/{job_id}/")
    assert published and not any(k.endswith(".mp4") for k in published), published
    assert result["archived"] == [{"key": o.key, "content_type": o.content_type, "sha256": o.sha256,
                                   "size_bytes": o.size_bytes} for o in archived.outputs]
    assert [a["name"] for a in result["artifacts"]] == ["thumbnails/poster.jpg", "thumbnails/storyboard.jpg",
                                                        "thumbnails/storyboard.vtt"]
    shown = tapeline_cli(isolated, "status", job_id, env={"COLUMNS": "300"}).stdout  # what an operator reads
    assert f"archived: {copy_key}  sha256 {source_sha}" in shown, shown
    assert f"thumbnails: thumbnails/poster.jpg  {result['artifacts'][0]['url']}" in shown, shown


def test_an_archived_copy_is_written_once_and_never_overwritten(isolated, tmp_path):
    """`put_file_if_absent` against the real S3 endpoint, both ways it writes: one PUT, and a multipart
    upload (above `multipart_chunk_bytes`) whose completion carries `If-None-Match: *`."""
    store = ObjectStore(isolated.model_copy(update={"multipart_chunk_bytes": 5 * 1024 * 1024}))
    for size in (1000, 11 * 1024 * 1024 + 7):
        first, other = tmp_path / f"a{size}", tmp_path / f"b{size}"
        first.write_bytes(os.urandom(size))
        other.write_bytes(os.urandom(size))
        key = f"archive/test-{uuid.uuid4()}/source.bin"
        sha = hashlib.sha256(first.read_bytes()).hexdigest()
        assert store.put_file_if_absent(first, key, "application/octet-stream", sha) is True
        assert store.put_file_if_absent(first, key, "application/octet-stream", sha) is False  # a retry goes on
        with pytest.raises(OutputConflict, match="never overwritten"):
            store.put_file_if_absent(other, key, "application/octet-stream",
                                     hashlib.sha256(other.read_bytes()).hexdigest())
        assert store.stored_mismatch(key, size, sha) is None
    assert not [u for u in store.list_multipart(1000) if u.key.startswith("archive/test-")]

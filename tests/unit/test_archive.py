"""The archive stage's pure parts (processors/archive.py) and the rules around it: its profile, its
crash points, reuse, cleanup and publish never touching `archive/`."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from domain import events as ev
from domain import pipeline
from domain.policy.cleanup import Disposition, MultipartUpload, StoredObject, plan_cleanup
from processors.archive import (ARCHIVE_MIN_BYTES_PER_S, PASSES, archive_keys, manifest, progress_grace_s)
from processors.intake import decide
from processors.providers import promotable
from processors.reuse import Reusable, full_profile
from tapeline.crashpoints import PIPELINE_CRASH_POINTS
from tapeline.settings import Settings
from tests.fakeclock import FixedClock
from tests.unit.test_reuse import LADDER, MEDIA, SETTINGS, upload

JOB = "22222222-2222-5222-8222-222222222222"


def test_the_archive_keys_are_the_jobs_own_and_the_same_on_every_attempt():
    assert archive_keys(JOB, "uploads/u1/clip.mp4") == (f"archive/{JOB}/clip.mp4", f"archive/{JOB}/manifest.json")
    assert archive_keys(JOB, "uploads/u1/manifest.json")[0] == f"archive/{JOB}/source-manifest.json"
    assert archive_keys(JOB, "uploads/u1/")[0] == f"archive/{JOB}/source"


def test_the_manifest_is_canonical_so_a_retry_writes_the_same_bytes():
    one = manifest(JOB, "uploads/u1/clip.mp4", f"archive/{JOB}/clip.mp4", 1234, "ab" * 32)
    assert one == manifest(JOB, "uploads/u1/clip.mp4", f"archive/{JOB}/clip.mp4", 1234, "ab" * 32)
    body = json.loads(one)
    assert (body["sha256"], body["size_bytes"], body["archive_key"]) == ("ab" * 32, 1234, f"archive/{JOB}/clip.mp4")
    assert one != manifest(JOB, "uploads/u1/clip.mp4", f"archive/{JOB}/clip.mp4", 1234, "cd" * 32)


def test_the_no_progress_grace_covers_three_passes_at_the_slowest_rate():
    assert progress_grace_s(0) == 0
    assert progress_grace_s(ARCHIVE_MIN_BYTES_PER_S) == PASSES
    assert progress_grace_s(20 * 1024**3) == PASSES * 2048  # the largest source: 20 GiB at 10 MiB/s, three times


def test_the_archive_tier_runs_the_archive_profile_first_and_archive_points_are_listed():
    assert pipeline.profile_for_tier("archive") == "archive"
    assert pipeline.profile_stages("archive") == ("archive", "transcode", "thumbnails", "publish")
    assert pipeline.next_stage(pipeline.profile_stages("archive"), "intake") == "archive"
    assert pipeline.following_stage(pipeline.profile_stages("archive"), "archive", degraded=True) == ("transcode", [])
    assert not pipeline.spec("archive").optional  # a degraded archive job still preserves its source
    points = [p for p in PIPELINE_CRASH_POINTS if p.startswith("archive.")]
    assert points == ["archive.claim.after_produce", "archive.claim.after_send_offsets", "archive.claim.after_commit",
                      "archive.before_put", "archive.after_put", "archive.after_manifest",
                      "archive.AttemptSucceeded.before_produce", "archive.AttemptSucceeded.after_produce",
                      "archive.AttemptSucceeded.after_commit"]
    assert PIPELINE_CRASH_POINTS.index("archive.AttemptSucceeded.after_commit") < \
        PIPELINE_CRASH_POINTS.index("transcode.claim.after_produce")
    assert pipeline.profiled_stages() == ("archive", "transcode", "thumbnails", "publish")
    assert pipeline.profile_running("archive") == "archive" and pipeline.profile_running("publish") == "default"


def test_an_archive_job_is_queued_to_archive_and_never_completed_from_another_jobs_result():
    origin = "11111111-1111-5111-8111-111111111111"
    profile = full_profile("default", LADDER, SETTINGS)
    published = [ev.OutputFile(key=f"published/{origin}/master.m3u8", sha256="cd" * 32, size_bytes=300,
                               content_type="application/vnd.apple.mpegurl")]
    reusable = Reusable(origin_job_id=origin, fingerprint=profile.fingerprint, master_key=published[0].key,
                        master_url=f"http://s3/{published[0].key}", renditions=list(LADDER), outputs=published,
                        media_duration_s=5.28)
    out = decide(None, upload(priority="archive"), MEDIA, SETTINGS, "intake@t", profile, reusable,
                 clock=FixedClock())
    assert [e.event_type for _, e in out] == ["JobAccepted", "StageQueued", "WorkItem"]
    accepted, queued, item = (e for _, e in out)
    assert (accepted.pipeline, accepted.pipeline_stages) == ("archive", ["archive", "transcode", "thumbnails", "publish"])
    assert queued.stage == item.stage == "archive" and out[2][0] == SETTINGS.work_topic("archive", "archive")
    assert item.pipeline_stages == accepted.pipeline_stages and item.renditions == list(LADDER)


def test_publish_promotes_attempt_scoped_outputs_only():
    work = ev.OutputFile(key=f"work/{JOB}/transcode/1/720p/seg_00000.ts", sha256="ab" * 32, size_bytes=1,
                         content_type="video/mp2t")
    copy = ev.OutputFile(key=f"archive/{JOB}/clip.mp4", sha256="cd" * 32, size_bytes=1,
                         content_type="application/octet-stream")
    assert promotable([copy, work, copy.model_copy(update={"key": f"archive/{JOB}/manifest.json"})]) == [work]


def test_cleanup_never_removes_an_archived_source_whatever_the_rows_say():
    now = datetime(2026, 12, 5, tzinfo=timezone.utc)
    old = now - timedelta(days=10_000)
    keys = [f"archive/{JOB}/clip.mp4", f"archive/{JOB}/manifest.json", "archive/ghost/clip.mp4"]
    rows = {JOB: {"job_id": JOB, "state": "failed", "completed_at": old, "master_url": None}}
    for retention in (3600.0, 0.0):
        settings = Settings(cleanup_retention_s=retention, cleanup_orphans=True)
        plan = plan_cleanup([StoredObject(k, old) for k in keys], rows, set(), now, settings)
        assert plan.delete == [] and plan.counts[Disposition.KEEP_ARCHIVED.value] == len(keys)
        assert plan_cleanup([], {}, set(), now, settings,
                            [MultipartUpload(f"archive/{JOB}/clip.mp4", "m1", old)]).abort == []


def test_an_attempt_scoped_key_is_told_apart_from_every_other_key():
    from tapeline.objects import attempt_path, attempt_prefix

    assert attempt_prefix(JOB, "thumbnails", 2) == f"work/{JOB}/thumbnails/2/"
    assert attempt_path(attempt_prefix(JOB, "thumbnails", 2) + "thumbnails/poster.jpg") == ("thumbnails",
                                                                                          "thumbnails/poster.jpg")
    for other in (f"archive/{JOB}/clip.mp4", f"published/{JOB}/master.m3u8", f"work/{JOB}/transcode/1/", "work/x"):
        assert attempt_path(other) is None

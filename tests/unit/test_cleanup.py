"""The cleanup planner: `plan_cleanup` over job rows and key listings (exact key sets in and out)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from domain.policy.cleanup import Disposition, MultipartUpload, StoredObject, job_ids_of, plan_cleanup
from domain.events import job_id_for
from tapeline.settings import Settings

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
HOUR = timedelta(hours=1)
SETTINGS = Settings(topic_prefix="unit", cleanup_retention_s=3600.0, intake_timeout_s=120.0,
                    cleanup_max_deletes=100, multipart_stale_s=86400.0)


def job(job_id, state, ended_ago=None, master_url="http://s3/b/published/x/master.m3u8"):
    return {"job_id": job_id, "upload_id": f"u-{job_id}", "state": state, "master_url": master_url,
            "completed_at": NOW - ended_ago if ended_ago is not None else None}


def objects(*keys, age=2 * HOUR):
    return [StoredObject(k, NOW - age) for k in keys]


def job_keys(job_id, attempts=(1,)):
    keys = [f"markers/{job_id}/webhook.json"]
    for a in attempts:
        keys += [f"work/{job_id}/transcode/{a}/720p/seg_00000.ts", f"work/{job_id}/transcode/{a}/720p/index.m3u8"]
    return keys


def published(job_id):
    return [f"published/{job_id}/master.m3u8", f"published/{job_id}/720p/seg_00000.ts"]


def plan(listing, jobs, referenced=frozenset(), settings=SETTINGS, multipart=()):
    return plan_cleanup(listing, {j["job_id"]: j for j in jobs}, set(referenced), NOW, settings, multipart)


def test_completed_job_loses_every_attempt_prefix_and_marker_after_retention_and_keeps_published():
    keys = job_keys("done", attempts=(1, 2)) + published("done")
    result = plan(objects(*keys), [job("done", "completed", ended_ago=2 * HOUR)])
    assert set(result.delete) == set(job_keys("done", attempts=(1, 2)))  # both attempts' prefixes (reused segments)
    assert result.counts["keep_published"] == 2 and result.deferred == 0


def test_retention_is_counted_from_completion_on_the_log_clock_not_object_age():
    keys = job_keys("recent") + published("recent")
    result = plan(objects(*keys, age=10 * HOUR), [job("recent", "completed", ended_ago=timedelta(minutes=59))])
    assert result.delete == [] and result.counts["keep_retention"] == 3
    zero = SETTINGS.model_copy(update={"cleanup_retention_s": 0.0})
    result = plan(objects(*keys, age=timedelta(0)), [job("recent", "completed", ended_ago=timedelta(0))], settings=zero)
    assert set(result.delete) == set(job_keys("recent"))


def test_completed_without_published_outputs_is_kept():
    result = plan(objects(*job_keys("odd")), [job("odd", "completed", ended_ago=5 * HOUR, master_url=None)])
    assert result.delete == []


def test_failed_rejected_and_cancelled_jobs_are_cleaned_like_completed_ones():
    jobs = [job("f", "failed", ended_ago=2 * HOUR), job("r", "rejected", ended_ago=2 * HOUR),
            job("c", "cancelled", ended_ago=2 * HOUR)]
    listing = objects(*job_keys("f"), *job_keys("r"), *job_keys("c"))
    assert set(plan(listing, jobs).delete) == set(job_keys("f") + job_keys("r") + job_keys("c"))


def test_live_jobs_are_never_touched_however_old():
    jobs = [job(f"live-{s}", s) for s in ("accepted", "queued", "running", "retry_scheduled")]
    listing = [o for j in jobs for o in objects(*job_keys(j["job_id"], attempts=(1, 2, 3)), age=1000 * HOUR)]
    result = plan(listing, jobs)
    assert result.delete == [] and result.counts["keep_live"] == len(listing)


def test_replayable_job_keeps_marker_and_referenced_keys_and_loses_old_unreferenced_ones():
    keys = job_keys("dl", attempts=(1, 2))
    referenced = {"work/dl/transcode/1/720p/seg_00000.ts", "work/dl/transcode/2/720p/index.m3u8"}
    young = objects("work/dl/transcode/3/720p/seg_00000.ts", age=timedelta(minutes=5))  # a zombie's, maybe
    for state in ("dead_lettered", "needs_review"):
        result = plan(objects(*keys) + young, [job("dl", state, ended_ago=3 * HOUR)], referenced)
        assert set(result.delete) == {"work/dl/transcode/2/720p/seg_00000.ts", "work/dl/transcode/1/720p/index.m3u8"}
        assert result.counts["keep_referenced"] == 2 and result.counts["keep_live"] == 1  # the marker
        assert result.counts["keep_retention"] == 1


def test_orphans_of_unknown_jobs_go_once_old_and_only_with_cleanup_orphans():
    listing = objects("work/ghost/transcode/1/720p/seg_00000.ts", "markers/ghost/webhook.json") + \
        objects("work/newghost/transcode/1/720p/seg_00000.ts", age=timedelta(minutes=10))
    result = plan(listing, [])
    assert set(result.delete) == {"work/ghost/transcode/1/720p/seg_00000.ts", "markers/ghost/webhook.json"}
    shared = SETTINGS.model_copy(update={"cleanup_orphans": False})
    assert plan(listing, [], settings=shared).delete == []


def test_published_is_never_removed_whatever_the_rows_say():
    keys = published("done") + published("ghost") + ["published/x"]
    for settings in (SETTINGS, SETTINGS.model_copy(update={"cleanup_retention_s": 0.0})):
        result = plan(objects(*keys, age=10_000 * HOUR), [job("done", "completed", ended_ago=10_000 * HOUR)],
                      settings=settings)
        assert result.delete == [] and result.counts["keep_published"] == len(keys)
    multipart = [MultipartUpload("published/done/big.ts", "m1", NOW - 100 * 24 * HOUR)]
    assert plan([], [], multipart=multipart).abort == []


def test_sources_kept_for_known_jobs_and_removed_when_no_job_appeared_after_intake_timeout_and_retention():
    kept_upload, orphan_upload, young_upload = "up-kept", "up-orphan", "up-young"
    listing = objects(f"uploads/{kept_upload}/a.mp4", f"uploads/{orphan_upload}/a.mp4") + \
        objects(f"uploads/{young_upload}/a.mp4", age=HOUR + timedelta(seconds=60))  # < retention + intake timeout
    jobs = [job(job_id_for(kept_upload), "completed", ended_ago=10 * HOUR)]
    result = plan(listing, jobs)
    assert result.delete == [f"uploads/{orphan_upload}/a.mp4"]
    assert result.counts["keep_source"] == 1 and result.counts["keep_retention"] == 1
    assert job_ids_of(o.key for o in listing) == {job_id_for(u) for u in (kept_upload, orphan_upload, young_upload)}


def test_unknown_prefixes_are_kept():
    result = plan(objects("other/thing", "work/", "README"), [])
    assert result.delete == [] and result.counts["keep_unknown"] == 3


def test_stale_multipart_uploads_are_aborted_and_fresh_ones_kept():
    multipart = [MultipartUpload("uploads/u1/big.mp4", "stale", NOW - 25 * HOUR),
                 MultipartUpload("uploads/u2/big.mp4", "fresh", NOW - 2 * HOUR)]
    assert [u.upload_id for u in plan([], [], multipart=multipart).abort] == ["stale"]


def test_removals_are_capped_per_tick_and_the_rest_deferred():
    capped = SETTINGS.model_copy(update={"cleanup_max_deletes": 3})
    keys = job_keys("done", attempts=(1, 2))  # 5 keys
    multipart = [MultipartUpload("uploads/u1/big.mp4", "stale", NOW - 25 * HOUR)]
    result = plan(objects(*keys), [job("done", "completed", ended_ago=2 * HOUR)], settings=capped,
                  multipart=multipart)
    assert len(result.abort) == 1 and result.delete == keys[:2] and result.deferred == 3
    off = SETTINGS.model_copy(update={"cleanup_max_deletes": 0})
    result = plan(objects(*keys), [job("done", "completed", ended_ago=2 * HOUR)], settings=off)
    assert result.delete == [] and result.deferred == 5


def test_every_disposition_is_counted_once_per_key():
    listing = objects(*job_keys("done"), *published("done"), "work/ghost/a/b")
    result = plan(listing, [job("done", "completed", ended_ago=2 * HOUR)])
    assert sum(result.counts.values()) == len(listing)
    assert {d for d in Disposition if d.deletes} == {Disposition.DELETE_ENDED, Disposition.DELETE_UNREFERENCED,
                                                     Disposition.DELETE_ORPHAN, Disposition.DELETE_UPLOAD}

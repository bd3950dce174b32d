"""The watchdog's cleanup with the real pipeline (issue 4, item 5): after a job completes, its attempt
objects and claim marker go, its published outputs stay and still play; an orphan of an unknown job
and a stale multipart upload go too.

The endpoint is a private moto_server of this module: the orphan sweep judges a whole bucket, and
the shared one holds every other test's objects.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterator

import pytest

from devstack.chaos import keys_under
from tapeline.objectstore import ObjectStore
from tapeline.samples import sample_video
from tapeline.settings import Settings
from tests.conftest import Pipeline, private_moto_server, wait_for
from tests.faults.conftest import FAULT_TIMING
from tests.faults.test_worker_faults import submit, wait_state
from tests.integration.helpers import decodes

pytestmark = pytest.mark.integration


@pytest.fixture()
def private_s3(isolated: Settings, tmp_path: Path) -> Iterator[Settings]:
    """A moto_server of this test's own; cleanup with no retention and the orphan sweep on (the
    bucket is ours alone)."""
    with private_moto_server(isolated, tmp_path, **FAULT_TIMING, cleanup_retention_s=0.0, cleanup_orphans=True,
                             multipart_stale_s=0.0, cleanup_page_keys=50, cleanup_interval_s=0.0) as (settings, _):
        yield settings


def test_completed_job_objects_and_orphans_are_removed_and_published_outputs_stay(private_s3, tmp_path):
    settings = private_s3
    store = ObjectStore(settings)
    ghost = f"work/{uuid.uuid4()}/transcode/1/720p/seg_00000.ts"  # a job this deployment never knew
    store.s3.put_object(Bucket=store.bucket, Key=ghost, Body=b"orphan")
    multipart = store.s3.create_multipart_upload(Bucket=store.bucket, Key="uploads/abandoned/big.mp4")["UploadId"]
    pipeline = Pipeline(settings, tmp_path / "run.log").start()
    try:
        job_id = submit(settings, sample_video("carphone_pristine.mp4"))
        row = wait_state(settings, job_id, timeout_s=120)
        store.s3.put_object(Bucket=store.bucket, Key=f"markers/{job_id}/webhook.json", Body=b"{}")  # as a webhook run leaves
        published = keys_under(settings, f"published/{job_id}/")
        assert published and row["master_url"]
        wait_for(lambda: not keys_under(settings, f"work/{job_id}/") and not keys_under(settings, f"markers/{job_id}/")
                 and not keys_under(settings, ghost), 30, "the job's work objects, marker and the orphan to go")
        wait_for(lambda: multipart not in {u["UploadId"] for u in
                                           store.s3.list_multipart_uploads(Bucket=store.bucket).get("Uploads", [])}, 30,
                 "the stale multipart upload to be aborted")
        assert keys_under(settings, f"published/{job_id}/") == published  # nothing published is removed
        assert keys_under(settings, "uploads/"), "the completed job's source is kept"
        played = decodes(row["master_url"])
        assert played.returncode == 0 and not played.stderr.strip(), played.stderr[-2000:]
        assert "cleanup removed objects" in pipeline.log_text()
    finally:
        pipeline.stop()
        print(pipeline.log_text()[-4000:])


def test_storage_past_its_limit_shortens_the_retention_of_ended_jobs_objects(isolated, tmp_path):
    """Retention is an hour, but storage is past its limit (1 byte): the watchdog keeps an ended job's
    work objects only `storage_pressure_retention_s` (0 s here), so they go right after it completes."""
    with private_moto_server(isolated, tmp_path, **FAULT_TIMING, cleanup_retention_s=3600.0, cleanup_interval_s=0.0,
                             storage_limit_bytes=1, storage_usage_cache_s=1.0,
                             storage_pressure_retention_s=0.0) as (settings, _):
        pipeline = Pipeline(settings, tmp_path / "run.log").start()
        try:
            job_id = submit(settings, sample_video("carphone_pristine.mp4"))
            row = wait_state(settings, job_id, timeout_s=120)
            assert row["state"] == "completed"
            wait_for(lambda: not keys_under(settings, f"work/{job_id}/"), 30,
                     "the ended job's work objects to go under storage pressure")
            assert keys_under(settings, f"published/{job_id}/")  # published outputs are never removed
            assert "cleanup removed objects" in pipeline.log_text()  # there were work objects, and cleanup took them
        finally:
            pipeline.stop()

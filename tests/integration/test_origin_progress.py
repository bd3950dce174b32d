"""The origin reports its promotion progress object by object (the publish attempt heartbeats there)."""

from __future__ import annotations

import hashlib
import uuid

import pytest

from processors.providers import OriginProvider, PublishRequest
from domain import events as ev
from tapeline.objectstore import ObjectStore

pytestmark = pytest.mark.integration


def test_promotion_reports_each_object_before_it_is_copied(base_settings):
    store, job_id = ObjectStore(base_settings), str(uuid.uuid4())
    outputs = []
    for i in range(3):
        body = f"segment {i}".encode()
        key = f"work/{job_id}/transcode/1/240p/seg_{i:05d}.ts"
        store.s3.put_object(Bucket=store.bucket, Key=key, Body=body)
        outputs.append(ev.OutputFile(key=key, sha256=hashlib.sha256(body).hexdigest(), size_bytes=len(body),
                                     content_type="video/mp2t"))
    seen: list[tuple[int, int, int]] = []

    def progress(done: int, total: int) -> None:
        published = store.s3.list_objects_v2(Bucket=store.bucket, Prefix=f"published/{job_id}/").get("KeyCount", 0)
        seen.append((done, total, published))

    rendition = ev.Rendition(name="240p", width=426, height=240, video_bitrate_kbps=400)
    post = OriginProvider(store).publish(PublishRequest(job_id, outputs, [rendition], None, 12.0),
                                         f"{job_id}:publish", on_progress=progress)
    assert seen == [(0, 3, 0), (1, 3, 1), (2, 3, 2), (3, 3, 3)]  # and once before the master playlist (a cancel stops it)
    assert len(post.outputs) == 4  # three segments and the master playlist

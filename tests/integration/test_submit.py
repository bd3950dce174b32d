"""`tapeline submit`'s upload path against the real S3 endpoint: multipart, sha256 while streaming."""

from __future__ import annotations

import hashlib
import os

import pytest

from producers.submit import upload
from tapeline.objectstore import ObjectStore

pytestmark = pytest.mark.integration


def test_large_file_is_uploaded_in_parts_with_its_sha256(base_settings, tmp_path):
    path = tmp_path / "big.bin"
    data = os.urandom(3 * base_settings.multipart_chunk_bytes + 12345)  # four parts
    path.write_bytes(data)
    seen = []
    submission = upload(base_settings, path, on_bytes=seen.append)
    assert submission.sha256 == hashlib.sha256(data).hexdigest()
    assert submission.size_bytes == len(data) == sum(seen)
    head = ObjectStore(base_settings).s3.head_object(Bucket=base_settings.s3_bucket, Key=submission.object_key)
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"').endswith("-4")  # a multipart object's ETag counts its parts
    assert submission.event.job_id == submission.job_id and submission.event.sha256 == submission.sha256

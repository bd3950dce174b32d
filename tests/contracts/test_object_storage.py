"""The `ObjectStorage` port's contract (tapeline/ports.py), run against the in-memory fake
(`tests/memory_storage.py`, what unit tests use) and the real S3 adapter (`tapeline/objectstore.py`
over the shared S3 endpoint, keys under a prefix of this test's own): both give the same answers to
the same calls, so a unit test on the fake tells the truth about the adapter."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import pytest

from domain.errors import ObjectMissing, OutputConflict, StorageError
from tapeline.objectstore import ObjectStore
from tapeline.ports import ObjectStorage
from tests.memory_storage import InMemoryObjectStorage


@pytest.fixture(params=["memory", "s3"])
def storage(request) -> ObjectStorage:
    if request.param == "memory":
        return InMemoryObjectStorage()
    return ObjectStore(request.getfixturevalue("base_settings"))


@pytest.fixture
def prefix() -> str:
    return f"work/contract-{uuid.uuid4().hex[:10]}/"


def sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def test_both_implement_the_port(storage):
    assert isinstance(storage, ObjectStorage)


def test_a_conditional_put_creates_once_and_refuses_different_bytes(storage, prefix):
    key = prefix + "a.json"
    assert storage.put_if_absent(key, b"one", "application/json") is True
    assert storage.put_if_absent(key, b"one", "application/json") is False  # the same bytes: nothing to do
    with pytest.raises(OutputConflict):
        storage.put_if_absent(key, b"two", "application/json")
    assert storage.get_bytes(key) == b"one"
    assert storage.head(key) == (3, {"sha256": sha(b"one")})


def test_create_exclusive_answers_the_holder(storage, prefix):
    key = prefix + "claim.json"
    assert storage.create_exclusive(key, b'{"token": "a"}') is None
    assert storage.create_exclusive(key, b'{"token": "b"}') == b'{"token": "a"}'


def test_a_file_is_put_once_with_its_sha256_and_never_overwritten(storage, prefix, tmp_path: Path):
    path, other = tmp_path / "seg.ts", tmp_path / "other.ts"
    path.write_bytes(b"x" * 1000)
    other.write_bytes(b"y" * 1000)
    key = prefix + "seg_00000.ts"
    sent: list[int] = []
    assert storage.put_file_if_absent(path, key, "video/mp2t", sha(path.read_bytes()), {"attempt": "1"},
                                      on_bytes=sent.append) is True
    assert sum(sent) == 1000
    assert storage.head_metadata(key) == {"sha256": sha(path.read_bytes()), "attempt": "1"}
    assert storage.put_file_if_absent(path, key, "video/mp2t", sha(path.read_bytes())) is False
    with pytest.raises(OutputConflict):
        storage.put_file_if_absent(other, key, "video/mp2t", sha(other.read_bytes()))
    assert storage.stored_mismatch(key, 1000, sha(path.read_bytes())) is None
    assert "bytes" in storage.stored_mismatch(key, 999, sha(path.read_bytes()))
    assert "sha256" in storage.stored_mismatch(key, 1000, sha(b"nope"))
    assert "not in the bucket" in storage.stored_mismatch(prefix + "missing", 1, sha(b""))


def test_upload_download_and_missing_objects(storage, prefix, tmp_path: Path):
    source = tmp_path / "in.mp4"
    source.write_bytes(b"video bytes")
    key = prefix + "in.mp4"
    assert storage.upload_file(source, key, "video/mp4") == (sha(b"video bytes"), 11)
    assert storage.head_metadata(key) == {"sha256": sha(b"video bytes")}
    storage.download(key, tmp_path / "out.mp4")
    assert (tmp_path / "out.mp4").read_bytes() == b"video bytes"
    assert storage.head(prefix + "missing") is None and storage.head_metadata(prefix + "missing") is None
    with pytest.raises(ObjectMissing):
        storage.download(prefix + "missing", tmp_path / "none")
    with pytest.raises(StorageError):
        storage.get_bytes(prefix + "missing")
    assert storage.public_url(key).endswith("/" + key)
    assert storage.total_bytes() >= 11


def test_listing_pages_in_key_order_and_deleting(storage, prefix):
    keys = [f"{prefix}{name}" for name in ("c", "a", "e", "b", "d")]
    for key in keys:
        storage.put_if_absent(key, key.encode(), "text/plain")
    seen, token = [], None
    while True:
        page, token = storage.list_page(prefix, token, 2)
        assert len(page) <= 2
        seen += [found.key for found in page]
        if token is None:
            break
    assert seen == sorted(keys)
    storage.delete(keys[0])
    storage.delete(keys[0])  # absent: no error
    storage.delete_many(keys[1:3])
    storage.delete_many([])
    remaining, _ = storage.list_page(prefix, None, 100)
    assert [found.key for found in remaining] == sorted(keys[3:])
    with pytest.raises(StorageError):
        storage.delete_many(["published/someone/master.m3u8"])


def test_published_objects_are_withdrawn_only_through_withdraw_published(storage, prefix):
    job = f"contract-{uuid.uuid4().hex[:10]}"
    published = [f"published/{job}/master.m3u8", f"published/{job}/240p/index.m3u8"]
    for key in published:
        storage.put_if_absent(key, b"#EXTM3U\n", "application/vnd.apple.mpegurl")
    storage.put_if_absent(prefix + "kept", b"kept", "text/plain")
    with pytest.raises(StorageError):
        storage.withdraw_published([published[0], prefix + "kept"])  # a key outside published/: nothing removed
    assert storage.head(published[0]) is not None and storage.head(prefix + "kept") is not None
    storage.withdraw_published(published)
    storage.withdraw_published([])
    assert storage.list_page(f"published/{job}/", None, 10)[0] == []
    assert storage.head(prefix + "kept") is not None


def test_aborting_an_unknown_multipart_upload_is_no_error(storage, prefix):
    storage.abort_multipart(prefix + "never", "no-such-upload")
    assert isinstance(storage.list_multipart(5), list)

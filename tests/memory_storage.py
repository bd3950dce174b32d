"""An in-memory `ObjectStorage` (tapeline/ports.py) for unit tests: the same answers as the S3
adapter (`tapeline/objectstore.py` `ObjectStore`) for the same calls, checked by the contract suite
`tests/contracts/test_object_storage.py`, which runs against both."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from domain.errors import ObjectMissing, OutputConflict, StorageError
from domain.policy.cleanup import MultipartUpload, StoredObject
from tapeline.objects import PUBLISHED_PREFIX


@dataclass
class _Stored:
    body: bytes
    content_type: str
    metadata: dict[str, str]
    last_modified: datetime


class InMemoryObjectStorage:
    """A bucket in a dict. Conditional writes are atomic here as S3 makes them (`If-None-Match: *`);
    user metadata keys are lower-cased as S3 returns them; listings are in key order, a page's token
    is the last key it returned."""

    def __init__(self, endpoint: str = "http://memory.invalid", bucket: str = "memory") -> None:
        self.endpoint, self.bucket = endpoint, bucket
        self.objects: dict[str, _Stored] = {}
        self.uploads: list[MultipartUpload] = []

    def _store(self, key: str, body: bytes, content_type: str, metadata: dict[str, str] | None) -> None:
        self.objects[key] = _Stored(body, content_type, {k.lower(): v for k, v in (metadata or {}).items()},
                                    datetime.now(timezone.utc))

    def public_url(self, key: str) -> str:
        return f"{self.endpoint.rstrip('/')}/{self.bucket}/{key}"

    def upload_file(self, path: Path, key: str, content_type: str) -> tuple[str, int]:
        body = path.read_bytes()
        sha = hashlib.sha256(body).hexdigest()
        self._store(key, body, content_type, {"sha256": sha})
        return sha, len(body)

    def get_bytes(self, key: str) -> bytes:
        if key not in self.objects:
            raise ObjectMissing(f"{key} is not in the bucket")
        return self.objects[key].body

    def put_if_absent(self, key: str, body: bytes, content_type: str, metadata: dict[str, str] | None = None) -> bool:
        sha = hashlib.sha256(body).hexdigest()
        if key not in self.objects:
            self._store(key, body, content_type, {"sha256": sha, **(metadata or {})})
            return True
        existing = hashlib.sha256(self.objects[key].body).hexdigest()
        if existing != sha:
            raise OutputConflict.found(key, f"sha256 {existing[:12]} != {sha[:12]}", self.object_found(key))
        return False

    def put_file_if_absent(self, path: Path, key: str, content_type: str, sha256: str,
                           metadata: dict[str, str] | None = None,
                           on_bytes: Callable[[int], None] | None = None) -> bool:
        body = path.read_bytes()
        if key not in self.objects:
            self._store(key, body, content_type, {"sha256": sha256, **(metadata or {})})
            if on_bytes is not None:
                on_bytes(len(body))
            return True
        differs = self.stored_mismatch(key, len(body), sha256)
        if differs is not None:
            raise OutputConflict.found(key, differs, self.object_found(key))
        return False

    def object_found(self, key: str) -> dict | None:
        found = self.objects.get(key)
        if found is None:
            return None
        return {"key": key, "sha256": hashlib.sha256(found.body).hexdigest(), "size_bytes": len(found.body),
                "written_at": found.last_modified}

    def stored_mismatch(self, key: str, size: int, sha256: str) -> str | None:
        found = self.objects.get(key)
        if found is None:
            return f"{key} is not in the bucket after its upload"
        if len(found.body) != size:
            return f"object storage kept {len(found.body)} bytes of the {size} sent"
        digest = hashlib.sha256(found.body).hexdigest()
        if digest != sha256:
            return f"the stored object's sha256 {digest[:12]}... differs from the sent {sha256[:12]}..."
        return None

    def create_exclusive(self, key: str, body: bytes, content_type: str = "application/json") -> bytes | None:
        if key in self.objects:
            return self.objects[key].body
        self._store(key, body, content_type, None)
        return None

    def head_metadata(self, key: str) -> dict[str, str] | None:
        found = self.head(key)
        return None if found is None else found[1]

    def head(self, key: str) -> tuple[int, dict[str, str]] | None:
        found = self.objects.get(key)
        return None if found is None else (len(found.body), dict(found.metadata))

    def download(self, key: str, path: Path) -> None:
        if key not in self.objects:
            raise ObjectMissing(f"{key} is not in the bucket")
        path.write_bytes(self.objects[key].body)

    def delete(self, key: str) -> None:
        self.objects.pop(key, None)

    def list_page(self, prefix: str, token: str | None, max_keys: int) -> tuple[list[StoredObject], str | None]:
        keys = sorted(k for k in self.objects if k.startswith(prefix) and (token is None or k > token))
        page = keys[:max_keys]
        found = [StoredObject(k, self.objects[k].last_modified) for k in page]
        return found, (page[-1] if len(keys) > max_keys else None)

    def list_multipart(self, max_uploads: int) -> list[MultipartUpload]:
        return self.uploads[:max_uploads]

    def abort_multipart(self, key: str, upload_id: str) -> None:
        self.uploads = [u for u in self.uploads if (u.key, u.upload_id) != (key, upload_id)]

    def delete_many(self, keys: list[str]) -> None:
        if any(k.startswith(PUBLISHED_PREFIX) for k in keys):
            raise StorageError("refusing to delete published objects")
        for key in keys:
            self.objects.pop(key, None)

    def withdraw_published(self, keys: list[str]) -> None:
        if any(not k.startswith(PUBLISHED_PREFIX) for k in keys):
            raise StorageError("withdraw_published removes published objects only")
        for key in keys:
            self.objects.pop(key, None)

    def total_bytes(self) -> int:
        return sum(len(o.body) for o in self.objects.values())



"""What the processors need to know about stored objects without an S3 client: the published
prefix, the attempt-scoped key layout, a file's sha256, and `StorageGauge` (the bucket's cached size, over any `ObjectStorage`).
`tapeline.objectstore` (the boto3 adapter) re-exports all three.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tapeline.settings import Settings

if TYPE_CHECKING:
    from tapeline.ports import ObjectStorage

PUBLISHED_PREFIX = "published/"
"""Where published outputs live (`published/{job_id}/...`); the only publicly readable prefix."""
WORK_PREFIX = "work/"
"""Where attempts write (`work/{job_id}/{stage}/{attempt}/...`): each attempt its own prefix."""


def attempt_prefix(job_id: str, stage: str, attempt: int) -> str:
    """Object key prefix of one attempt's outputs: `work/{job_id}/{stage}/{attempt}/`."""
    return f"{WORK_PREFIX}{job_id}/{stage}/{attempt}/"


def attempt_path(key: str) -> tuple[str, str] | None:
    """(stage, path after the attempt number) of an attempt-scoped key: `work/{job}/transcode/2/720p/
    seg_00000.ts` -> (`transcode`, `720p/seg_00000.ts`); None for any other key (an archived source
    under `archive/`, a published object). Pure."""
    parts = key.split("/", 4)
    if len(parts) != 5 or parts[0] + "/" != WORK_PREFIX or not parts[4]:
        return None
    return parts[2], parts[4]


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()



class StorageGauge:
    """The bucket's total bytes, measured by listing it at most once per `storage_usage_cache_s`
    (thread-safe). `bytes()` raises `StorageError` when the listing fails."""

    def __init__(self, settings: Settings, store: "ObjectStorage") -> None:
        """`store`: any `ObjectStorage` (its `total_bytes` is what is measured)."""
        self.settings = settings
        self.store = store
        self._lock = threading.Lock()
        self._value: int | None = None
        self._at = 0.0

    def measure(self) -> int:
        """List the whole bucket now; its total size in bytes."""
        return self.store.total_bytes()

    def bytes(self) -> int:
        with self._lock:
            if self._value is None or time.monotonic() - self._at >= self.settings.storage_usage_cache_s:
                self._value, self._at = self.measure(), time.monotonic()
            return self._value

    def over_limit(self) -> bool:
        """True when a limit is set and the (cached) measurement is at or past it."""
        limit = self.settings.storage_limit_bytes
        return limit is not None and self.bytes() >= limit

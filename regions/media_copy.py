"""One object copied from region A's store to region B's, verified on the way (docs/regions.md
"Media replication"). The adapter under `regions/replicator.py`; what to copy and what to do after
a failure are decided in `domain/replication.py`.

The copy streams the object from A into a temporary file in 1 MiB blocks, computing its sha256 as
the bytes arrive, and compares it with the sha256 the log recorded (or, when the naming event
records none, the one A's store keeps in the object's metadata) *before* anything is written to B:
bytes that do not match are never stored in B. Then the file goes to B with a conditional put
(`ObjectStore.put_file_if_absent`, `If-None-Match: *`, multipart above the chunk size): an object
already in B with the same bytes (a copy made just before a crash) is read back, compared and left
as it is; other bytes under the key are never overwritten.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from domain.errors import OutputConflict, StorageError
from domain.replication import CopyFailure, NamedObject
from tapeline.objectstore import SOURCE_CONTENT_TYPE, ObjectStore, no_such_object

BLOCK_BYTES = 1 << 20


class CopyFailed(Exception):
    """An object was not copied; `kind` says why (`domain.replication.CopyFailure`)."""

    def __init__(self, kind: CopyFailure, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Copied:
    """A verified copy: the hex `sha256` and `size_bytes` of the bytes now in B, and whether this
    call created the key in B (`written` False: B already held the same bytes)."""

    sha256: str
    size_bytes: int
    written: bool


def copy_object(source: ObjectStore, target: ObjectStore, named: NamedObject, workdir: Path) -> Copied:
    """Copy `named.key` from `source` (region A) to `target` (region B), verified (module docstring).
    The temporary file lives in `workdir` and is removed before returning. A's user metadata (the
    origin's `idempotency-key` on a master playlist) and content type go with the copy.

    Raises CopyFailed: MISSING_IN_A (A answers no such key), SHA256_MISMATCH (A's bytes do not have
    the expected sha256; nothing is written to B), CONFLICT_IN_B (B holds other bytes under the
    key), STORE_UNAVAILABLE (either store failed the call or did not answer).
    """
    try:
        got = source.s3.get_object(Bucket=source.bucket, Key=named.key)
    except ClientError as exc:
        if no_such_object(exc):
            raise CopyFailed(CopyFailure.MISSING_IN_A, f"{named.key} is not in region A's store (yet)") from exc
        raise CopyFailed(CopyFailure.STORE_UNAVAILABLE, f"region A's store failed reading {named.key}: {exc}") from exc
    except BotoCoreError as exc:
        raise CopyFailed(CopyFailure.STORE_UNAVAILABLE, f"region A's store did not answer for {named.key}: {exc}") from exc
    metadata = dict(got.get("Metadata") or {})
    expected = named.sha256 or metadata.get("sha256")
    content_type = got.get("ContentType") or SOURCE_CONTENT_TYPE
    workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=workdir, prefix="copy-", delete=True) as spool:
        digest, size = hashlib.sha256(), 0
        try:
            body = got["Body"]
            while block := body.read(BLOCK_BYTES):
                digest.update(block)
                size += len(block)
                spool.write(block)
        except (BotoCoreError, ClientError, OSError) as exc:
            raise CopyFailed(CopyFailure.STORE_UNAVAILABLE, f"reading {named.key} from region A failed: {exc}") from exc
        spool.flush()
        sha256 = digest.hexdigest()
        if expected is not None and sha256 != expected:
            raise CopyFailed(CopyFailure.SHA256_MISMATCH,
                             f"{named.key} in region A has sha256 {sha256[:12]}... ({size} bytes), the "
                             f"{'log' if named.sha256 else 'object metadata'} records {expected[:12]}...: not copied")
        metadata.pop("sha256", None)
        try:
            written = target.put_file_if_absent(Path(spool.name), named.key, content_type, sha256, metadata=metadata)
        except OutputConflict as exc:
            raise CopyFailed(CopyFailure.CONFLICT_IN_B, str(exc)) from exc
        except StorageError as exc:
            raise CopyFailed(CopyFailure.STORE_UNAVAILABLE, f"writing {named.key} to region B failed: {exc}") from exc
    return Copied(sha256, size, written)

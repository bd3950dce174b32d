"""Object storage adapter (boto3 against any S3 endpoint: moto locally, MinIO or AWS elsewhere).

Keys: sources at `uploads/{upload_id}/{filename}` (the HTTP intake's at
`uploads/{upload_id}/{claim}/{filename}`), attempt outputs at
`work/{job_id}/{stage}/{attempt}/...`, published outputs at `published/{job_id}/...` (the only
publicly readable prefix).
"""

from __future__ import annotations

import hashlib
import re
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from boto3.exceptions import Boto3Error
from botocore.exceptions import BotoCoreError, ClientError, FlexibleChecksumError, NoCredentialsError
from botocore.exceptions import SSLError as BotoSSLError

from domain.errors import ObjectMissing, OutputConflict, StorageAccessRefused, StorageError
from tapeline.objects import PUBLISHED_PREFIX, StorageGauge, sha256_file  # noqa: F401 (client-free home)
from tapeline.settings import Settings

TRANSFER_ERRORS = (BotoCoreError, ClientError, Boto3Error)
"""What boto3's managed transfers (`upload_file`, `upload_fileobj`, `download_file`) raise when S3 fails:
botocore's errors, and boto3's own when s3transfer gives up on a body (`RetriesExceededError`: an
endpoint that stops answering mid-download, seen as error class `unknown` when S3 was paused during
a transcode's download; `S3UploadFailedError`). Every one is a `StorageError` (storage_transient)."""

if TYPE_CHECKING:  # the cleanup planner's row types (imported lazily at run time: no import cycle)
    from domain.policy.cleanup import MultipartUpload, StoredObject

SOURCE_CONTENT_TYPE = "application/octet-stream"
"""What a stored source's Content-Type is when the client's is not a plain audio/video type."""
_MEDIA_TYPE = re.compile(r"(?:video|audio)/[a-z0-9][a-z0-9.+-]{0,62}")


def normalised_content_type(header: str | None) -> str:
    """The Content-Type a source is stored with: the client's `video/...` or `audio/...` type
    (lower case, parameters dropped) when it is one, else `application/octet-stream`. Pure.

    The client's header is never passed on as it is: moto's server parses an
    `application/x-www-form-urlencoded` or `multipart/form-data` PutObject body as a form and stores
    0 bytes (what `curl --data-binary` sends; issue 20), and a stored type is served to players."""
    media_type = (header or "").split(";", 1)[0].strip().lower()
    return media_type if _MEDIA_TYPE.fullmatch(media_type) else SOURCE_CONTENT_TYPE


def client(settings: Settings):
    """A boto3 S3 client for the configured endpoint: `s3_addressing_style` addressing (path by
    default), `s3_max_attempts` tries per call (botocore "standard" retry mode: exponential backoff on
    throttling, 5xx and connection errors) and the configured connect/read timeouts, so an endpoint that
    stops answering fails the call as `StorageError` (storage_transient) within about attempts x read
    timeout seconds.

    TLS: an `https://` endpoint's certificate is verified against `s3_ca_bundle` when set (botocore's
    `verify=`), else botocore's own CA bundle (or `AWS_CA_BUNDLE`). Credentials: the static
    `s3_access_key`/`s3_secret_key` when set; when both are unset none are passed, so botocore's default
    credential chain finds them (AWS_* environment variables, the shared credentials and config
    files, web identity (EKS IRSA), the container or the EC2 instance profile)."""
    keys = ({} if settings.s3_access_key is None
            else {"aws_access_key_id": settings.s3_access_key, "aws_secret_access_key": settings.s3_secret_key})
    return boto3.client(
        "s3", endpoint_url=settings.s3_endpoint, region_name=settings.s3_region, **keys,
        verify=str(settings.s3_ca_bundle) if settings.s3_ca_bundle is not None else None,
        config=Config(s3={"addressing_style": settings.s3_addressing_style},
                      retries={"max_attempts": settings.s3_max_attempts, "mode": "standard"},
                      connect_timeout=settings.s3_connect_timeout_s, read_timeout=settings.s3_read_timeout_s))


def encryption_args(settings: Settings) -> dict[str, str]:
    """The server-side encryption parameters of every write (PutObject, CreateMultipartUpload,
    CopyObject; boto3's upload_file/upload_fileobj `ExtraArgs`): `{}` when `s3_sse` is unset,
    `{"ServerSideEncryption": "AES256"}` for SSE-S3, and for SSE-KMS also `SSEKMSKeyId` when
    `s3_sse_kms_key_id` is set (without it S3 uses the account's `aws/s3` key). Names from the S3 API
    reference (PutObject, "x-amz-server-side-encryption"). Pure."""
    if settings.s3_sse is None:
        return {}
    args = {"ServerSideEncryption": settings.s3_sse}
    if settings.s3_sse_kms_key_id is not None:
        args["SSEKMSKeyId"] = settings.s3_sse_kms_key_id
    return args


def object_url(endpoint: str, bucket: str, key: str, addressing_style: str) -> str:
    """The URL of `key` in `bucket` at `endpoint`: `https://host/bucket/key` (path style, and `auto`)
    or `https://bucket.host/key` (virtual-hosted style, AWS S3's recommended form). The key is not
    escaped (Tapeline's keys are URL-safe). Pure."""
    from urllib.parse import urlsplit, urlunsplit

    if addressing_style != "virtual":
        return f"{endpoint.rstrip('/')}/{bucket}/{key}"
    parts = urlsplit(endpoint)
    return urlunsplit(parts._replace(netloc=f"{bucket}.{parts.netloc}", path=f"{parts.path.rstrip('/')}/{key}"))


def published_url(public_base_url: str, endpoint: str, bucket: str, key: str, addressing_style: str) -> str:
    """The URL Tapeline hands out for the published object `key` (events, webhooks, the API, `tapeline
    status`): `public_base_url` + "/" + `key` when a public base URL is set (one address in front of
    every region's bucket, so a URL stays valid after a failover), else the S3 endpoint's
    `object_url`. The key is not escaped. Pure."""
    if public_base_url:
        return f"{public_base_url.rstrip('/')}/{key}"
    return object_url(endpoint, bucket, key, addressing_style)


def tls_context(settings: Settings):
    """An `ssl.SSLContext` for a plain HTTP client (urllib) reaching the S3 endpoint: it trusts
    `s3_ca_bundle` when set, else the system's CAs; it verifies the certificate and the host name."""
    return ssl.create_default_context(cafile=str(settings.s3_ca_bundle) if settings.s3_ca_bundle else None)


class _HashingReader:
    """Wraps a binary file: counts bytes and updates a sha256 as boto3 reads it."""

    def __init__(self, raw: BinaryIO, on_bytes: Callable[[int], None] | None = None) -> None:
        self.raw, self.on_bytes = raw, on_bytes
        self.digest = hashlib.sha256()
        self.size = 0

    def read(self, size: int = -1) -> bytes:
        block = self.raw.read(size)
        self.digest.update(block)
        self.size += len(block)
        if self.on_bytes and block:
            self.on_bytes(len(block))
        return block


def no_such_object(exc: ClientError) -> bool:
    """Whether S3 answered that the key does not exist: `NoSuchKey` for a GET, a bare 404 (`404`
    or `NotFound`) for a HEAD, which has no body to name the error in."""
    return exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")


def _created_unless_present(key: str, put: Callable[[], object]) -> bool:
    """Run `put`, a conditional write of `key` (`If-None-Match: *`): True when it created the key,
    False when S3 refused it because an object is there (`PreconditionFailed`, 412). Raises
    `StorageError` for any other failure."""
    try:
        put()
        return True
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("PreconditionFailed", "412"):
            raise StorageError(f"conditional put of {key} failed: {exc}") from exc
    except BotoCoreError as exc:
        raise StorageError(f"conditional put of {key} failed: {exc}") from exc
    return False


class ObjectStore:
    """The bucket Tapeline writes to. Every method raises `StorageError` on S3 failures."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.bucket = settings.s3_bucket
        self.s3 = client(settings)

    def public_url(self, key: str) -> str:
        """URL of a published object (readable anonymously): under `public_base_url` when it is set,
        else the S3 endpoint's, in `s3_addressing_style` (`published_url`)."""
        return published_url(self.settings.public_base_url, self.settings.s3_endpoint, self.bucket, key,
                             self.settings.s3_addressing_style)

    @property
    def sse(self) -> dict[str, str]:
        """`encryption_args` of these settings: added to every write."""
        return encryption_args(self.settings)

    def upload_stream(self, fileobj: BinaryIO, key: str, content_type: str = "application/octet-stream",
                      on_bytes: Callable[[int], None] | None = None) -> tuple[str, int]:
        """Stream `fileobj` to `key` (multipart above the chunk size); returns (hex sha256, bytes).

        The sha256 is computed while streaming: the file is read once.
        """
        reader = _HashingReader(fileobj, on_bytes)
        chunk = self.settings.multipart_chunk_bytes
        config = TransferConfig(multipart_threshold=chunk, multipart_chunksize=chunk, use_threads=False)
        try:
            self.s3.upload_fileobj(reader, self.bucket, key, ExtraArgs={"ContentType": content_type, **self.sse},
                                Config=config)
        except TRANSFER_ERRORS as exc:
            raise StorageError(f"upload of {key} failed: {exc}") from exc
        return reader.digest.hexdigest(), reader.size

    def put_bytes(self, key: str, body: bytes, content_type: str) -> None:
        """Store `body` as `key` in one PutObject (overwrites). Raises `StorageError`."""
        try:
            self.s3.put_object(Bucket=self.bucket, Key=key, Body=body, ContentType=content_type)
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"upload of {key} failed: {exc}") from exc

    def start_multipart(self, key: str, content_type: str) -> str:
        """Begin a multipart upload of `key`; its upload id. Raises `StorageError`. End it with
        `complete_multipart` or `abort_multipart` (a stale one is aborted by the watchdog's cleanup)."""
        try:
            return self.s3.create_multipart_upload(Bucket=self.bucket, Key=key, ContentType=content_type)["UploadId"]
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"upload of {key} failed: {exc}") from exc

    def put_part(self, key: str, upload_id: str, number: int, body: bytes) -> dict[str, Any]:
        """Send part `number` (1-10,000; every part but the last at least 5 MiB, S3's rule) of a
        multipart upload; `{"PartNumber", "ETag"}` for `complete_multipart`. Raises `StorageError`."""
        try:
            etag = self.s3.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                       Body=body)["ETag"]
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"upload of {key} (part {number}) failed: {exc}") from exc
        return {"PartNumber": number, "ETag": etag}

    def complete_multipart(self, key: str, upload_id: str, parts: list[dict[str, Any]]) -> None:
        """Join the `parts` (`put_part`'s answers, in order) into `key`. Raises `StorageError`."""
        try:
            self.s3.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                              MultipartUpload={"Parts": parts})
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"upload of {key} failed: {exc}") from exc

    def stored_mismatch(self, key: str, size: int, sha256: str) -> str | None:
        """Read `key` back and compare it with what was sent: None when the stored object has `size`
        bytes and hex `sha256`, else what differs (for a person). Reads the object once, streaming
        (1 MiB blocks). A stored body that fails the checksum the endpoint keeps for it
        (`FlexibleChecksumError`) is a mismatch. Raises `StorageError` when S3 cannot answer."""
        found = self.head(key)
        if found is None:
            return f"{key} is not in the bucket after its upload"
        if found[0] != size:
            return f"object storage kept {found[0]} bytes of the {size} sent"
        digest = hashlib.sha256()
        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"]
            while block := body.read(1 << 20):
                digest.update(block)
        except FlexibleChecksumError as exc:
            return f"the stored object fails its checksum ({exc})"
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"read-back of {key} failed: {exc}") from exc
        if digest.hexdigest() != sha256:
            return f"the stored object's sha256 {digest.hexdigest()[:12]}... differs from the sent {sha256[:12]}..."
        return None

    def upload_file(self, path: Path, key: str, content_type: str) -> tuple[str, int]:
        """Upload a local file; returns (hex sha256, bytes). The sha256 is kept as object metadata."""
        sha = sha256_file(path)
        try:
            self.s3.upload_file(str(path), self.bucket, key,
                                ExtraArgs={"ContentType": content_type, "Metadata": {"sha256": sha}, **self.sse})
        except TRANSFER_ERRORS as exc:
            raise StorageError(f"upload of {key} failed: {exc}") from exc
        return sha, path.stat().st_size

    def download(self, key: str, path: Path) -> None:
        try:
            self.s3.download_file(self.bucket, key, str(path))
        except ClientError as exc:
            if no_such_object(exc):
                raise ObjectMissing(f"download of {key} failed: no such object") from exc
            raise StorageError(f"download of {key} failed: {exc}") from exc
        except TRANSFER_ERRORS as exc:
            raise StorageError(f"download of {key} failed: {exc}") from exc

    def get_bytes(self, key: str) -> bytes:
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"read of {key} failed: {exc}") from exc

    def put_if_absent(self, key: str, body: bytes, content_type: str, metadata: dict[str, str] | None = None) -> bool:
        """Create `key` only if it does not exist (`If-None-Match: *`).

        Returns True when this call created it, False when an identical object (same sha256) was
        already there. Raises `StorageError` when a different object exists: published bytes are
        never overwritten.
        """
        sha = hashlib.sha256(body).hexdigest()
        if _created_unless_present(key, lambda: self.s3.put_object(
                Bucket=self.bucket, Key=key, Body=body, ContentType=content_type,
                Metadata={"sha256": sha, **(metadata or {})}, IfNoneMatch="*", **self.sse)):
            return True
        existing = hashlib.sha256(self.get_bytes(key)).hexdigest()
        if existing != sha:
            raise OutputConflict.found(key, f"sha256 {existing[:12]} != {sha[:12]}", self.object_found(key))
        return False

    def put_file_if_absent(self, path: Path, key: str, content_type: str, sha256: str,
                           metadata: dict[str, str] | None = None,
                           on_bytes: Callable[[int], None] | None = None) -> bool:
        """Store the local file `path` (hex `sha256`, computed by the caller) as `key` only if no object
        is there (`If-None-Match: *`), streaming: one `PutObject` up to `multipart_chunk_bytes`, else a
        multipart upload whose completion carries the condition (S3 evaluates it when the parts are
        joined, so two writers cannot both create the key; a refused or failed multipart upload is
        aborted). `on_bytes(n)` runs as bytes are sent. The sha256 is kept as object metadata.

        Returns True when this call created `key`, False when an object with the same sha256 (read back,
        not trusted from metadata) was already there. Raises `OutputConflict` when a different object
        is there (it is never overwritten), `StorageError` for any other failure."""
        size = path.stat().st_size
        chunk = self.settings.multipart_chunk_bytes
        meta = {"sha256": sha256, **(metadata or {})}

        def put() -> None:
            if size <= chunk:
                with path.open("rb") as f:
                    self.s3.put_object(Bucket=self.bucket, Key=key, Body=_HashingReader(f, on_bytes).read(),
                                       ContentType=content_type, Metadata=meta, IfNoneMatch="*", **self.sse)
            else:
                self._multipart_if_absent(path, key, content_type, meta, max(chunk, -(-size // 10_000)), on_bytes)

        if _created_unless_present(key, put):
            return True
        differs = self.stored_mismatch(key, size, sha256)
        if differs is not None:
            raise OutputConflict.found(key, differs, self.object_found(key))
        return False

    def object_found(self, key: str) -> dict[str, Any] | None:
        """What the store holds at `key`, for an `OutputConflict` to name: `{"key", "sha256" (hex, of
        the bytes read back, streaming), "size_bytes", "written_at" (its Last-Modified, a UTC
        datetime)}`, or None when it is gone or cannot be read (the conflict is reported without it)."""
        try:
            found = self.s3.head_object(Bucket=self.bucket, Key=key)
            digest, body = hashlib.sha256(), self.s3.get_object(Bucket=self.bucket, Key=key)["Body"]
            while block := body.read(1 << 20):
                digest.update(block)
        except (BotoCoreError, ClientError):
            return None
        return {"key": key, "sha256": digest.hexdigest(), "size_bytes": int(found.get("ContentLength", 0)),
                "written_at": found.get("LastModified")}

    def _multipart_if_absent(self, path: Path, key: str, content_type: str, metadata: dict[str, str],
                             part_bytes: int, on_bytes: Callable[[int], None] | None) -> None:
        """A multipart upload of `path` completed with `If-None-Match: *` (S3 allows 10,000 parts, so
        `part_bytes` grows with the file). Aborted when anything fails; botocore errors go on."""
        upload_id = self.s3.create_multipart_upload(Bucket=self.bucket, Key=key, ContentType=content_type,
                                                    Metadata=metadata, **self.sse)["UploadId"]
        try:
            parts = []
            with path.open("rb") as f:
                reader = _HashingReader(f, on_bytes)
                while block := reader.read(part_bytes):
                    number = len(parts) + 1
                    etag = self.s3.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                               PartNumber=number, Body=block)["ETag"]
                    parts.append({"PartNumber": number, "ETag": etag})
            self.s3.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id, IfNoneMatch="*",
                                              MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self.s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except (BotoCoreError, ClientError):
                pass  # a stale multipart upload is aborted by the watchdog's cleanup later
            raise

    def create_exclusive(self, key: str, body: bytes, content_type: str = "application/json") -> bytes | None:
        """Create `key` only if no object is there (`If-None-Match: *`): None when this call created
        it, else the bytes of the object that was already there (a claim marker someone else holds).
        Raises `StorageError` for any other failure."""
        if _created_unless_present(key, lambda: self.s3.put_object(
                Bucket=self.bucket, Key=key, Body=body, ContentType=content_type, IfNoneMatch="*", **self.sse)):
            return None
        return self.get_bytes(key)

    def copy(self, source_key: str, target_key: str) -> None:
        """Copy `source_key` to `target_key` in the bucket (CopyObject: metadata kept, `encryption_args`
        applied: a copy does not inherit the source's encryption). Raises `StorageError`."""
        try:
            self.s3.copy_object(Bucket=self.bucket, Key=target_key, CopySource={"Bucket": self.bucket, "Key": source_key},
                                **self.sse)
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"copy of {source_key} to {target_key} failed: {exc}") from exc

    def head(self, key: str) -> tuple[int, dict[str, str]] | None:
        """(size in bytes, user metadata) of `key`, or None when it does not exist."""
        try:
            found = self.s3.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if no_such_object(exc):
                return None
            raise StorageError(f"head of {key} failed: {exc}") from exc
        except BotoCoreError as exc:
            raise StorageError(f"head of {key} failed: {exc}") from exc
        return int(found.get("ContentLength", 0)), found.get("Metadata", {})

    def head_metadata(self, key: str) -> dict[str, str] | None:
        """The user metadata of `key`, or None when it does not exist. Raises `StorageError`."""
        found = self.head(key)
        return None if found is None else found[1]

    def delete(self, key: str) -> None:
        """Remove `key` (no error when it is already gone)."""
        try:
            self.s3.delete_object(Bucket=self.bucket, Key=key)
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"delete of {key} failed: {exc}") from exc

    def list_page(self, prefix: str, token: str | None, max_keys: int) -> tuple[list["StoredObject"], str | None]:
        """One page of keys under `prefix` (key order) and the token of the next page (None: the last)."""
        from domain.policy.cleanup import StoredObject

        args = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": max_keys}
        if token:
            args["ContinuationToken"] = token
        try:
            page = self.s3.list_objects_v2(**args)
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"listing of {prefix} failed: {exc}") from exc
        objects = [StoredObject(o["Key"], o["LastModified"]) for o in page.get("Contents", [])]
        return objects, page.get("NextContinuationToken") if page.get("IsTruncated") else None

    def list_multipart(self, max_uploads: int) -> list["MultipartUpload"]:
        """Unfinished multipart uploads (the first `max_uploads`)."""
        from domain.policy.cleanup import MultipartUpload

        try:
            page = self.s3.list_multipart_uploads(Bucket=self.bucket, MaxUploads=max_uploads)
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"listing of multipart uploads failed: {exc}") from exc
        return [MultipartUpload(u["Key"], u["UploadId"], u["Initiated"]) for u in page.get("Uploads", [])]

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Abort one multipart upload (no error when it is already gone)."""
        try:
            self.s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "NoSuchUpload":
                raise StorageError(f"abort of multipart upload {key} failed: {exc}") from exc
        except BotoCoreError as exc:
            raise StorageError(f"abort of multipart upload {key} failed: {exc}") from exc

    def delete_many(self, keys: list[str]) -> None:
        """Remove `keys` (at most 1000, one DeleteObjects call). Refuses any key under `published/`."""
        if any(k.startswith(PUBLISHED_PREFIX) for k in keys):
            raise StorageError("refusing to delete published objects")
        self._delete_objects(keys)

    def withdraw_published(self, keys: list[str]) -> None:
        """Remove published `keys` (at most 1000, one DeleteObjects call; every key under
        `published/`): a job that ended otherwise than completed (domain/policy/withdrawal.py).
        Raises `StorageError` for any other key or a failed delete."""
        if any(not k.startswith(PUBLISHED_PREFIX) for k in keys):
            raise StorageError("withdraw_published removes published objects only")
        self._delete_objects(keys)

    def _delete_objects(self, keys: list[str]) -> None:
        if not keys:
            return
        try:
            result = self.s3.delete_objects(Bucket=self.bucket,
                                            Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"delete of {len(keys)} objects failed: {exc}") from exc
        if result.get("Errors"):
            first = result["Errors"][0]
            raise StorageError(f"delete of {len(result['Errors'])} objects failed, first {first.get('Key')}: "
                               f"{first.get('Code')} {first.get('Message')}")


    def total_bytes(self) -> int:
        """List the whole bucket now; its total size in bytes."""
        total = 0
        try:
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
                total += sum(o["Size"] for o in page.get("Contents", []))
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"measuring bucket {self.bucket} failed: {exc}") from exc
        return total


def endpoint_answers(settings: Settings, timeout_s: float = 3.0) -> tuple[bool, str | None]:
    """(True, None) if an HTTP server answers at the S3 endpoint (any HTTP status counts as an answer),
    else (False, why). An `https://` endpoint must present a certificate `tls_context` trusts (the
    `s3_ca_bundle`): one it does not is no answer, and `why` says so."""
    try:
        with urllib.request.urlopen(settings.s3_endpoint, timeout=timeout_s, context=tls_context(settings)):
            return True, None
    except urllib.error.HTTPError:
        return True, None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ssl.SSLError):
            return False, (f"TLS: {reason} (the endpoint's certificate must be signed by a CA of "
                           f"TAPELINE_S3_CA_BUNDLE={settings.s3_ca_bundle or '(unset: the system CAs)'})")
        return False, str(reason)


REFUSED_CREDENTIALS: dict[str, str] = {
    "InvalidAccessKeyId": "the access key id is not known to the endpoint",
    "SignatureDoesNotMatch": "the secret key does not match the access key id",
    "ExpiredToken": "the session token has expired",
    "InvalidToken": "the session token is malformed or not valid",
    "TokenRefreshRequired": "the session token must be refreshed",
}
"""S3 error codes that refuse the credentials themselves, and what each means (Amazon S3 API
Reference, "Error responses": all 400/403). AccessDenied is not among them on purpose."""


def access_refusal(exc: BaseException) -> StorageAccessRefused | None:
    """`StorageAccessRefused` when `exc` (a botocore error) is a refusal of this client's credentials
    (`REFUSED_CREDENTIALS`, or none found by the default chain) or of its TLS (botocore's
    `SSLError`: an untrusted certificate, or an endpoint that does not speak TLS); else None. Pure."""
    if isinstance(exc, BotoSSLError):
        return StorageAccessRefused("tls", f"S3 refused over TLS: {exc} (an https:// endpoint's certificate must be "
                                           "signed by a CA of TAPELINE_S3_CA_BUNDLE, or the system's)")
    if isinstance(exc, NoCredentialsError):
        return StorageAccessRefused("authentication", "S3: no credentials (neither TAPELINE_S3_ACCESS_KEY/"
                                                      "TAPELINE_S3_SECRET_KEY nor botocore's default chain gave any)")
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        if code in REFUSED_CREDENTIALS:
            return StorageAccessRefused("authentication", f"S3 refused the credentials ({code}): "
                                                          f"{REFUSED_CREDENTIALS[code]}")
    return None


def one_quick_try(settings: Settings, timeout_s: float = 3.0) -> Settings:
    """`settings` for an S3 client that gives up after one try of at most `timeout_s` seconds to
    connect and to read (or the configured timeouts, when shorter): for a check or a gauge that must
    not wait out the client's full retries."""
    return settings.model_copy(update={"s3_max_attempts": 1,
                                       "s3_read_timeout_s": min(timeout_s, settings.s3_read_timeout_s),
                                       "s3_connect_timeout_s": min(timeout_s, settings.s3_connect_timeout_s)})


def check_access(settings: Settings, timeout_s: float = 3.0) -> None:
    """One quick listing of the bucket (`MaxKeys=0`, `one_quick_try`): returns when it is answered or denied for want of a permission. Raises
    `StorageAccessRefused` when the credentials or the TLS are refused (`access_refusal`), and
    `StorageError` when the endpoint does not answer or the bucket does not exist."""
    try:
        client(one_quick_try(settings, timeout_s)).list_objects_v2(Bucket=settings.s3_bucket, MaxKeys=0)
    except (BotoCoreError, ClientError) as exc:
        refusal = access_refusal(exc)
        if refusal is not None:
            raise refusal from exc
        if isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") == "AccessDenied":
            return
        raise StorageError(f"S3 at {settings.s3_endpoint}, bucket {settings.s3_bucket}: {exc}") from exc

"""S3 over HTTPS (issue 40 item 2), against a real endpoint of this module's own.

`devstack.s3server` (moto behind the signature gate) over HTTPS with a certificate of the module's
own CA (`devstack.tls`): with the CA bundle (`s3_ca_bundle`) every kind of write Tapeline makes lands
and carries the asked server-side encryption (SSE-S3, SSE-KMS with a key id), read back with
HeadObject; without the bundle the call fails naming TLS; with no static keys the AWS default
credential chain signs.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Iterator

import boto3
import pytest

from devstack import tls
from domain.errors import StorageError
from tapeline.objectstore import ObjectStore, endpoint_answers
from tapeline.settings import Settings
from tests.conftest import private_moto_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tls_home() -> Iterator[Path]:
    home = Path(tempfile.mkdtemp(prefix="tapeline-s3-tls-"))
    yield home
    shutil.rmtree(home, ignore_errors=True)



@pytest.fixture(scope="module")
def https_s3(tls_home: Path, base_settings: Settings) -> Iterator[Settings]:
    """`devstack.s3server` of this module's own over HTTPS (certificate by the stack's CA); settings
    that trust the CA and ask SSE-S3 on every write, small multipart parts."""
    ca = tls.stack_ca(tls_home / "ca")
    certificate = tls.server_certificate(ca, tls_home / "s3-tls", "s3", ["127.0.0.1", "localhost"])
    with private_moto_server(base_settings, tls_home, tls=certificate, s3_ca_bundle=ca.cert, s3_sse="AES256",
                             multipart_chunk_bytes=5 * 1024**2, s3_max_attempts=1) as (settings, _):
        yield settings


def _encryption(settings: Settings, key: str) -> tuple[str | None, str | None]:
    """(ServerSideEncryption, SSEKMSKeyId) S3 reports for `key`, read with a client of its own."""
    found = ObjectStore(settings).s3.head_object(Bucket=settings.s3_bucket, Key=key)
    return found.get("ServerSideEncryption"), found.get("SSEKMSKeyId")


def test_every_write_over_https_is_encrypted(https_s3: Settings, tmp_path: Path) -> None:
    """Each way Tapeline writes an object (put, conditional put, exclusive create, a file as one
    PutObject and as a conditional multipart upload, a streamed upload, upload_file, a server-side
    copy) reaches the HTTPS endpoint and the object carries SSE-S3."""
    assert https_s3.s3_endpoint.startswith("https://")
    assert endpoint_answers(https_s3) == (True, None)
    store = ObjectStore(https_s3)
    prefix = f"work/tls-{uuid.uuid4().hex[:8]}"
    small, large = tmp_path / "small.bin", tmp_path / "large.bin"
    small.write_bytes(b"s" * 1000)
    large.write_bytes(b"L" * (6 * 1024**2))
    from tapeline.objects import sha256_file

    assert store.put_if_absent(f"{prefix}/put", b"body", "text/plain")
    assert store.create_exclusive(f"{prefix}/claim", b"{}") is None
    assert store.put_file_if_absent(small, f"{prefix}/small", "application/octet-stream", sha256_file(small))
    assert store.put_file_if_absent(large, f"{prefix}/multipart", "application/octet-stream", sha256_file(large))
    with large.open("rb") as f:
        store.upload_stream(f, f"{prefix}/stream")
    store.upload_file(small, f"{prefix}/file", "application/octet-stream")
    store.copy(f"{prefix}/small", f"{prefix}/copied")
    keys = ["put", "claim", "small", "multipart", "stream", "file", "copied"]
    assert {key: _encryption(https_s3, f"{prefix}/{key}")[0] for key in keys} == {key: "AES256" for key in keys}
    assert store.get_bytes(f"{prefix}/put") == b"body"
    assert store.stored_mismatch(f"{prefix}/multipart", large.stat().st_size, sha256_file(large)) is None


def test_kms_key_id_reaches_the_object(https_s3: Settings) -> None:
    key_id = "arn:aws:kms:us-east-1:123456789012:key/tapeline-test"
    kms = https_s3.model_copy(update={"s3_sse": "aws:kms", "s3_sse_kms_key_id": key_id})
    key = f"work/tls-{uuid.uuid4().hex[:8]}/kms"
    ObjectStore(kms).put_if_absent(key, b"secret media", "application/octet-stream")
    assert _encryption(kms, key) == ("aws:kms", key_id)


def test_without_the_ca_bundle_the_error_names_tls(https_s3: Settings) -> None:
    untrusting = https_s3.model_copy(update={"s3_ca_bundle": None})
    up, why = endpoint_answers(untrusting)
    assert up is False and why.startswith("TLS: ") and "CERTIFICATE_VERIFY_FAILED" in why
    with pytest.raises(StorageError) as failed:
        ObjectStore(untrusting).put_if_absent(f"work/tls-{uuid.uuid4().hex[:8]}/x", b"x", "text/plain")
    assert "SSL validation failed" in str(failed.value) and "CERTIFICATE_VERIFY_FAILED" in str(failed.value)


def test_no_static_keys_uses_the_default_credential_chain(https_s3: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """With both keys unset the client signs with what botocore's chain finds (here its first
    provider, the AWS_* environment): the gate's keys sign, other keys are refused."""
    chain = https_s3.model_copy(update={"s3_access_key": None, "s3_secret_key": None})
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", https_s3.s3_access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", https_s3.s3_secret_key)
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # its credentials are resolved once per session
    store = ObjectStore(chain)
    assert store.s3._request_signer._credentials.method == "env"
    key = f"work/tls-{uuid.uuid4().hex[:8]}/chain"
    assert store.put_if_absent(key, b"signed by the chain", "text/plain")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    with pytest.raises(StorageError, match="SignatureDoesNotMatch|AccessDenied|403"):
        ObjectStore(chain).get_bytes(key)

"""S3 production settings (issue 40 item 2): TLS CA bundle, credentials, addressing, encryption."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tapeline.objectstore import client, encryption_args, object_url
from tapeline.settings import Settings


def test_encryption_args() -> None:
    assert encryption_args(Settings()) == {}
    assert encryption_args(Settings(s3_sse="AES256")) == {"ServerSideEncryption": "AES256"}
    assert encryption_args(Settings(s3_sse="aws:kms")) == {"ServerSideEncryption": "aws:kms"}
    assert encryption_args(Settings(s3_sse="aws:kms", s3_sse_kms_key_id="alias/media")) == {
        "ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "alias/media"}


def test_empty_s3_settings_mean_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAPELINE_S3_ACCESS_KEY", "")
    monkeypatch.setenv("TAPELINE_S3_SECRET_KEY", " ")
    monkeypatch.setenv("TAPELINE_S3_SSE", "")
    settings = Settings()
    assert (settings.s3_access_key, settings.s3_secret_key, settings.s3_sse) == (None, None, None)


@pytest.mark.parametrize(("update", "named"), [
    ({"s3_access_key": ""}, "TAPELINE_S3_ACCESS_KEY and TAPELINE_S3_SECRET_KEY"),
    ({"s3_secret_key": ""}, "TAPELINE_S3_ACCESS_KEY and TAPELINE_S3_SECRET_KEY"),
    ({"s3_sse_kms_key_id": "alias/media"}, "TAPELINE_S3_SSE_KMS_KEY_ID"),
    ({"s3_sse": "AES256", "s3_sse_kms_key_id": "alias/media"}, "TAPELINE_S3_SSE_KMS_KEY_ID"),
    ({"s3_ca_bundle": "/no/such/ca.pem"}, "TAPELINE_S3_CA_BUNDLE"),
    ({"s3_sse": "aes256"}, "s3_sse"),
    ({"s3_addressing_style": "host"}, "s3_addressing_style"),
])
def test_contradicting_s3_settings_are_refused(update: dict, named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        Settings(**update)


def test_static_keys_are_passed_and_none_leaves_the_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "from-the-environment")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-from-the-environment")
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    static = client(Settings())._request_signer._credentials
    assert (static.method, static.access_key) == ("explicit", "tapeline")
    chained = client(Settings(s3_access_key="", s3_secret_key=""))._request_signer._credentials
    assert (chained.method, chained.access_key) == ("env", "from-the-environment")


def test_addressing_style_shapes_request_urls() -> None:
    """Presigning builds the request URL without sending it: the bucket goes in the host for
    virtual-hosted style, in the path for path style."""
    base = {"s3_endpoint": "https://s3.eu-west-1.amazonaws.com", "s3_region": "eu-west-1"}
    virtual = client(Settings(**base, s3_addressing_style="virtual")).generate_presigned_url(
        "get_object", Params={"Bucket": "media-bucket", "Key": "published/j/master.m3u8"})
    path = client(Settings(**base, s3_addressing_style="path")).generate_presigned_url(
        "get_object", Params={"Bucket": "media-bucket", "Key": "published/j/master.m3u8"})
    assert virtual.startswith("https://media-bucket.s3.eu-west-1.amazonaws.com/published/j/master.m3u8?")
    assert path.startswith("https://s3.eu-west-1.amazonaws.com/media-bucket/published/j/master.m3u8?")


def test_public_urls_follow_the_addressing_style() -> None:
    assert object_url("https://s3.eu-west-1.amazonaws.com", "media", "published/j/a.m3u8", "virtual") == \
        "https://media.s3.eu-west-1.amazonaws.com/published/j/a.m3u8"
    assert object_url("http://127.0.0.1:19000/", "media", "published/j/a.m3u8", "path") == \
        "http://127.0.0.1:19000/media/published/j/a.m3u8"


def test_the_ca_bundle_is_what_the_client_verifies_with(tmp_path: Path) -> None:
    bundle = tmp_path / "ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    assert client(Settings(s3_ca_bundle=bundle))._endpoint.http_session._verify == str(bundle)
    assert client(Settings())._endpoint.http_session._verify != str(bundle)  # botocore's own default

"""Issue 20, item 2: the local default object store (`tapeline stack up`'s `devstack.s3server`, moto
behind a signature gate) serves requests signed with the project's credentials and, anonymously,
GET/HEAD of objects under `published/` and nothing else. Against a store of this module's own (the
one `stack up` starts, on a free port), with plain HTTP requests as curl sends them and botocore's
UNSIGNED config."""

from __future__ import annotations

import json
import shutil
import subprocess

import boto3
import httpx
import pytest
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import ClientError

from tapeline.objectstore import ObjectStore, client
from devstack import public_read_policy
from tests.conftest import private_moto_server
from tests.integration.test_http_intake import clip  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration
PUBLIC, PRIVATE = "published/job-1/clip.mp4", "uploads/up-1/1/clip.mp4"


@pytest.fixture(scope="module")
def store(isolated, tmp_path_factory, clip):  # noqa: F811
    with private_moto_server(isolated, tmp_path_factory.mktemp("s3")) as (settings, _):
        objects = ObjectStore(settings)
        objects.s3.put_object(Bucket=objects.bucket, Key=PUBLIC, Body=clip, ContentType="video/mp4")
        objects.s3.put_object(Bucket=objects.bucket, Key=PRIVATE, Body=b"private source")
        yield settings


def anonymous_requests(bucket: str) -> list[tuple[str, str, dict[str, str], bytes]]:
    """Every anonymous request that must be refused: (method, path and query, headers, body)."""
    policy = json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": "*",
                                                                 "Action": "s3:*", "Resource": "*"}]}).encode()
    return [
        ("GET", "/", {}, b""),                                          # ListBuckets
        ("GET", f"/{bucket}", {}, b""),                                 # ListObjects
        ("GET", f"/{bucket}?list-type=2&prefix=uploads/", {}, b""),     # ListObjectsV2
        ("GET", f"/{bucket}/{PRIVATE}", {}, b""),                       # a private source
        ("HEAD", f"/{bucket}/{PRIVATE}", {}, b""),
        ("GET", f"/{bucket}/published/../{PRIVATE}", {}, b""),          # traversal out of published/
        ("GET", f"/{bucket}/published/%2e%2e/{PRIVATE}", {}, b""),
        ("GET", f"/{PRIVATE}", {"Host": f"{bucket}.s3.localhost"}, b""),  # virtual-host style
        ("GET", f"/{bucket}/{PUBLIC}?acl", {}, b""),                    # a sub-resource of a public object
        ("PUT", f"/{bucket}/uploads/evil.mp4", {}, b"evil"),
        ("PUT", f"/{bucket}/published/evil.mp4", {}, b"evil"),
        ("PUT", f"/{bucket}/published/leaked.mp4", {"x-amz-copy-source": f"/{bucket}/{PRIVATE}"}, b""),
        ("DELETE", f"/{bucket}/{PUBLIC}", {}, b""),
        ("POST", f"/{bucket}?delete", {}, b"<Delete><Object><Key>" + PUBLIC.encode() + b"</Key></Object></Delete>"),
        ("POST", f"/{bucket}/published/x.mp4?uploads", {}, b""),        # CreateMultipartUpload
        ("GET", f"/{bucket}?uploads", {}, b""),                         # ListMultipartUploads
        ("GET", f"/{bucket}?policy", {}, b""),
        ("DELETE", f"/{bucket}?policy", {}, b""),
        ("PUT", f"/{bucket}?policy", {}, policy),
        ("PUT", "/another-bucket", {}, b""),                            # CreateBucket
        ("DELETE", f"/{bucket}", {}, b""),
        ("GET", "/moto-api/data.json", {}, b""),                        # moto's dump of every object
        ("POST", "/moto-api/reset-auth", {}, b"0"),
        ("POST", "/moto-api/reset", {}, b""),
    ]


def test_anonymous_access_is_get_and_head_of_published_objects_only(store, clip):  # noqa: F811
    endpoint, bucket = store.s3_endpoint, store.s3_bucket
    got = httpx.get(f"{endpoint}/{bucket}/{PUBLIC}", timeout=10.0)
    assert got.status_code == 200 and got.content == clip
    head = httpx.head(f"{endpoint}/{bucket}/{PUBLIC}", timeout=10.0)
    assert head.status_code == 200 and int(head.headers["content-length"]) == len(clip)
    ranged = httpx.get(f"{endpoint}/{bucket}/{PUBLIC}", headers={"Range": "bytes=0-9"}, timeout=10.0)
    assert ranged.status_code == 206 and ranged.content == clip[:10]
    with httpx.Client(base_url=endpoint, timeout=10.0) as http:
        answers = {f"{m} {p}": http.request(m, p, headers=h, content=b).status_code
                   for m, p, h, b in anonymous_requests(bucket)}
    assert {what: status for what, status in answers.items() if status != 403} == {}
    # Nothing of it happened: the signed view of the bucket is as before.
    s3 = ObjectStore(store).s3
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    assert keys == {PUBLIC, PRIVATE}
    assert json.loads(s3.get_bucket_policy(Bucket=bucket)["Policy"]) == public_read_policy(bucket)
    assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == [bucket]


def test_unsigned_botocore_client_reads_published_objects_only(store, clip):  # noqa: F811
    bucket = store.s3_bucket
    s3 = boto3.client("s3", endpoint_url=store.s3_endpoint, region_name=store.s3_region,
                      config=Config(signature_version=UNSIGNED, s3={"addressing_style": "path"},
                                    retries={"max_attempts": 1}))
    assert s3.get_object(Bucket=bucket, Key=PUBLIC)["Body"].read() == clip
    assert s3.head_object(Bucket=bucket, Key=PUBLIC)["ContentLength"] == len(clip)
    refused = {
        "ListObjectsV2": lambda: s3.list_objects_v2(Bucket=bucket),
        "ListBuckets": lambda: s3.list_buckets(),
        "GetObject(uploads/)": lambda: s3.get_object(Bucket=bucket, Key=PRIVATE),
        "PutObject": lambda: s3.put_object(Bucket=bucket, Key="published/evil", Body=b"evil"),
        "CopyObject": lambda: s3.copy_object(Bucket=bucket, Key="published/leaked",
                                             CopySource={"Bucket": bucket, "Key": PRIVATE}),
        "DeleteObject": lambda: s3.delete_object(Bucket=bucket, Key=PUBLIC),
        "DeleteBucketPolicy": lambda: s3.delete_bucket_policy(Bucket=bucket),
        "PutBucketPolicy": lambda: s3.put_bucket_policy(Bucket=bucket, Policy=json.dumps(public_read_policy(bucket, ""))),
        "CreateMultipartUpload": lambda: s3.create_multipart_upload(Bucket=bucket, Key="published/x"),
    }
    passed = []
    for name, call in refused.items():
        try:
            call()
            passed.append(name)
        except ClientError as exc:
            assert exc.response["ResponseMetadata"]["HTTPStatusCode"] == 403, (name, exc.response)
    assert passed == []


def test_only_the_configured_credentials_sign(store):
    wrong_secret = store.model_copy(update={"s3_secret_key": "not-the-secret", "s3_max_attempts": 1})
    wrong_key = store.model_copy(update={"s3_access_key": "someone-else", "s3_max_attempts": 1})
    for settings, code in ((wrong_secret, "SignatureDoesNotMatch"), (wrong_key, "InvalidAccessKeyId")):
        with pytest.raises(ClientError) as refused:
            client(settings).list_objects_v2(Bucket=store.s3_bucket)
        assert refused.value.response["Error"]["Code"] == code
    # The project's own client (the configured credentials) does everything it needs.
    objects = ObjectStore(store)
    objects.s3.copy_object(Bucket=objects.bucket, Key="work/copy", CopySource={"Bucket": objects.bucket, "Key": PRIVATE})
    assert objects.get_bytes("work/copy") == b"private source"
    objects.delete_many(["work/copy"])
    assert objects.head("work/copy") is None


@pytest.mark.skipif(shutil.which("ffprobe") is None, reason="ffprobe is not installed")
def test_a_player_reads_a_published_object_anonymously(store):
    url = f"{store.s3_endpoint}/{store.s3_bucket}/{PUBLIC}"
    probe = subprocess.run(["ffprobe", "-v", "error", "-show_entries", "stream=codec_name", "-of", "json", url],
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert "h264" in [s["codec_name"] for s in json.loads(probe.stdout)["streams"]]
    private = subprocess.run(["ffprobe", "-v", "error", f"{store.s3_endpoint}/{store.s3_bucket}/{PRIVATE}"],
                             capture_output=True, text=True, timeout=60)
    assert private.returncode != 0 and "403" in private.stderr


def test_an_unfinished_multipart_upload_is_listed_with_the_time_it_was_created(store):
    """moto alone lists every unfinished upload as initiated on 2010-11-10, which made the watchdog's
    cleanup abort uploads in flight (a large `tapeline submit` failed mid-way); the local server lists
    the time the upload was created, and a running upload is not stale."""
    from datetime import datetime, timezone

    objects = ObjectStore(store)
    before = datetime.now(timezone.utc).replace(microsecond=0)
    upload_id = objects.s3.create_multipart_upload(Bucket=objects.bucket, Key="uploads/up-2/big.bin")["UploadId"]
    try:
        listed = {u.upload_id: u.initiated for u in objects.list_multipart(1000)}
        assert before <= listed[upload_id] <= datetime.now(timezone.utc)
    finally:
        objects.abort_multipart("uploads/up-2/big.bin", upload_id)
    assert upload_id not in {u.upload_id for u in objects.list_multipart(1000)}

"""Pure parts of the issue 20 hardening: the stored content type, the anonymous-read rule of the
local object store and the intake's bounded tries of one uploads record."""

from __future__ import annotations

import pytest

from processors.intake import record_backoff, record_hold_bound_s
from tapeline.objectstore import normalised_content_type
from devstack.s3server import anonymous_allowed
from tapeline.settings import Settings


@pytest.mark.parametrize("sent, kept", [
    (None, "application/octet-stream"), ("", "application/octet-stream"),
    ("application/x-www-form-urlencoded", "application/octet-stream"),
    ("multipart/form-data; boundary=abc", "application/octet-stream"), ("text/html", "application/octet-stream"),
    ("video/mp4", "video/mp4"), ("Video/QuickTime; charset=x", "video/quicktime"), ("audio/mpeg", "audio/mpeg"),
    ("video/", "application/octet-stream"), ("video/mp4\r\nX-Evil: 1", "application/octet-stream"),
])
def test_content_type_is_normalised(sent, kept):
    assert normalised_content_type(sent) == kept


@pytest.mark.parametrize("method, path, query, allowed", [
    ("GET", "/b/published/j/master.m3u8", "", True), ("HEAD", "/b/published/j/x.ts", "", True),
    ("GET", "/b/published/", "", False), ("GET", "/b/published/j/x.ts", "acl", False),
    ("PUT", "/b/published/j/x.ts", "", False), ("DELETE", "/b/published/j/x.ts", "", False),
    ("POST", "/b/published/j/x.ts", "uploads", False), ("GET", "/b", "", False), ("GET", "/", "", False),
    ("GET", "/b/uploads/u/x.mp4", "", False), ("GET", "/b/published/../uploads/u/x.mp4", "", False),
    ("GET", "/b/published/./x", "", False), ("GET", "/other/published/j/x.ts", "", False),
    ("GET", "/bpublished/x", "", False),
])
def test_anonymous_reads_are_get_and_head_under_published_only(method, path, query, allowed):
    assert anonymous_allowed(method, path, query, "b") is allowed


def test_a_failing_record_is_tried_a_bounded_number_of_times():
    settings = Settings()
    assert [record_backoff(n, settings) for n in range(1, 5)] == [2.0, 4.0, 8.0, None]
    assert record_hold_bound_s(settings) == 14.0
    many = settings.model_copy(update={"intake_record_max_tries": 10})
    assert max(record_backoff(n, many) for n in range(1, 10)) == 30.0
    assert record_backoff(10, many) is None


@pytest.mark.parametrize("dsn, masked", [
    ("postgresql://u:pw@h:5432/d", "postgresql://u:***@h:5432/d"),
    ("postgresql://u@h/d?password=s3cr3t", "postgresql://u@h/d?password=***"),
    ("postgresql://u@h/d?sslmode=require&password=s3cr3t&application_name=x",
     "postgresql://u@h/d?sslmode=require&password=***&application_name=x"),
    ("postgresql://u@h/d", "postgresql://u@h/d"),
    ("host=h user=u password=s3cr3t dbname=d", "user=u password=*** dbname=d host=h"),
    ("host=h password='s3cr3t with space' dbname=d", "password=*** dbname=d host=h"),
])
def test_dsn_passwords_are_masked(dsn, masked):
    from devstack import masked_dsn

    assert masked_dsn(dsn) == masked and "s3cr3t" not in masked_dsn(dsn)


def test_a_malformed_key_value_dsn_is_not_shown():
    from devstack import masked_dsn

    assert "s3cr3t" not in masked_dsn("host=h password=s3cr3t dbname")


@pytest.mark.parametrize("tokens", ['{"tok-s3cr3t-123": 5}', '{"tok-s3cr3t-123": "alice"', '["tok-s3cr3t-123"]'])
def test_a_malformed_intake_tokens_setting_never_prints_a_token(tokens):
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "cli.main", "status"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TAPELINE_INTAKE_TOKENS": tokens})
    assert done.returncode == 2, done.stderr
    assert "TAPELINE_INTAKE_TOKENS" in done.stderr.upper() or "intake_tokens" in done.stderr
    assert "s3cr3t" not in done.stdout + done.stderr and "Traceback" not in done.stderr


def test_multipart_listings_carry_the_time_each_upload_was_created():
    """moto answers ListMultipartUploads with Initiated 2010-11-10 for every upload, so cleanup aborted
    uploads in flight; the local server's middleware puts the creation time in its place."""
    from datetime import datetime, timedelta, timezone

    from devstack.s3server import MultipartInitiated

    clock = [datetime(2026, 12, 5, 12, 0, 0, 250000, tzinfo=timezone.utc)]
    listing = (b"<ListMultipartUploadsResult><Upload><Key>a</Key><UploadId>up-1</UploadId>"
               b"<Initiated>2010-11-10T20:48:33.000Z</Initiated></Upload><Upload><Key>b</Key>"
               b"<UploadId>up-2</UploadId><Initiated>2010-11-10T20:48:33.000Z</Initiated></Upload>"
               b"</ListMultipartUploadsResult>")

    def moto(environ, start_response):
        body = b"<InitiateMultipartUploadResult><UploadId>up-1</UploadId></InitiateMultipartUploadResult>" \
            if environ["REQUEST_METHOD"] == "POST" else listing
        start_response("200 OK", [("Content-Type", "application/xml"), ("Content-Length", "1")])
        return [body]

    app = MultipartInitiated(moto, now=lambda: clock[0])  # started 12:00:00.250
    clock[0] += timedelta(minutes=5)
    answered = []
    app({"REQUEST_METHOD": "POST", "QUERY_STRING": "uploads"}, lambda s, h, e=None: answered.append(h))
    clock[0] += timedelta(minutes=5)
    body = b"".join(app({"REQUEST_METHOD": "GET", "QUERY_STRING": "uploads&max-uploads=10"},
                        lambda s, h, e=None: answered.append(h)))
    assert b"<UploadId>up-1</UploadId><Initiated>2026-12-05T12:05:00.250Z</Initiated>" in body
    assert b"<UploadId>up-2</UploadId><Initiated>2026-12-05T12:00:00.250Z</Initiated>" in body  # not seen: start
    assert b"2010" not in body and ("Content-Length", str(len(body))) in answered[-1]
    app({"REQUEST_METHOD": "DELETE", "QUERY_STRING": "uploadId=up-1"}, lambda s, h, e=None: None)
    assert app.initiated == {}

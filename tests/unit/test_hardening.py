"""Pure parts of the issue 20 hardening: the stored content type, the anonymous-read rule of the
local object store and the intake's bounded tries of one uploads record."""

from __future__ import annotations

import pytest

from processors.intake import record_backoff, record_hold_bound_s
from tapeline.objectstore import normalised_content_type
from tapeline.s3server import anonymous_allowed
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
    from tapeline.stack import masked_dsn

    assert masked_dsn(dsn) == masked and "s3cr3t" not in masked_dsn(dsn)


def test_a_malformed_key_value_dsn_is_not_shown():
    from tapeline.stack import masked_dsn

    assert "s3cr3t" not in masked_dsn("host=h password=s3cr3t dbname")


@pytest.mark.parametrize("tokens", ['{"tok-s3cr3t-123": 5}', '{"tok-s3cr3t-123": "alice"', '["tok-s3cr3t-123"]'])
def test_a_malformed_intake_tokens_setting_never_prints_a_token(tokens):
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tapeline.cli", "status"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TAPELINE_INTAKE_TOKENS": tokens})
    assert done.returncode == 2, done.stderr
    assert "TAPELINE_INTAKE_TOKENS" in done.stderr.upper() or "intake_tokens" in done.stderr
    assert "s3cr3t" not in done.stdout + done.stderr and "Traceback" not in done.stderr

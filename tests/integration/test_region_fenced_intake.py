"""A fenced region refuses uploads instead of parking them (docs/regions.md "What clients see during
and after a failover"), against the real Kafka, PostgreSQL and S3 of region A only: a
`RegionFailedOver` naming region B is written to this module's own `<prefix>.regions` (no region B
is started: its Kafka address is a port nobody listens on, as for a region that is gone). The real
`tapeline serve` then answers a curl POST with 503 `region_fenced` and where to send it, and
`tapeline submit` (direct, and `--url` through that intake) exits 3; none of them writes a record, a
claim or an object."""

from __future__ import annotations

import json
import socket
import subprocess
import uuid
from pathlib import Path

import httpx
import psycopg
import pytest

from domain import events as ev
from domain.regions import authority, failover_event
from producers.http_intake import upload_id_for_key
from regions.authority import FENCED_EXIT_CODE, write_region_record
from tapeline.clock import system_clock
from tapeline.objectstore import ObjectStore
from tests.conftest import tapeline_cli, wait_for
from tests.integration.helpers import committed_events
from tests.integration.test_http_intake import intake_server

pytestmark = pytest.mark.integration
TOKEN = "tok-fenced"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def settings(isolated):
    """The module's settings with a bucket of its own (every object in it is this module's), an API
    token, a 1 s region check, and region B's Kafka at a port nobody listens on."""
    from devstack.s3 import ensure_bucket

    tag = isolated.topic_prefix.lower()
    settings = isolated.model_copy(update={
        "s3_bucket": f"tapeline-fenced-{tag}", "intake_tokens": {TOKEN: "fenced"}, "region_check_interval_s": 1.0,
        "region_b_kafka_bootstrap": f"127.0.0.1:{_closed_port()}",
        "region_b_intake_public_url": "https://region-b.intake.example"})
    ensure_bucket(settings, None)
    yield settings
    store = ObjectStore(settings)
    keys = [o["Key"] for o in store.s3.list_objects_v2(Bucket=settings.s3_bucket).get("Contents", [])]
    if keys:
        store.s3.delete_objects(Bucket=settings.s3_bucket, Delete={"Objects": [{"Key": k} for k in keys]})
    store.s3.delete_bucket(Bucket=settings.s3_bucket)


def _objects(settings) -> list[str]:
    store = ObjectStore(settings)
    return sorted(o["Key"] for o in store.s3.list_objects_v2(Bucket=settings.s3_bucket).get("Contents", []))


def _curl_post(url: str, body: Path, key: str, filename: str) -> tuple[int, dict, str]:
    """POST `body` as curl does by default (`--data-binary`: Content-Type application/x-www-form-urlencoded)."""
    done = subprocess.run(["curl", "-sS", "-D", "-", "-H", f"Authorization: Bearer {TOKEN}", "-H",
                           f"Idempotency-Key: {key}", "--data-binary", f"@{body}",
                           f"{url}/uploads?filename={filename}"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    head, _, text = done.stdout.replace("\r\n", "\n").partition("\n\n")
    status = int(head.split()[1])
    headers = dict(line.split(": ", 1) for line in head.splitlines()[1:] if ": " in line)
    return status, {k.lower(): v for k, v in headers.items()}, text


def test_a_fenced_region_a_refuses_uploads_with_where_to_send_them_and_writes_nothing(settings, tmp_path):
    source = tmp_path / "clip.mp4"
    source.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 64)
    with intake_server(settings, tmp_path / "serve.log") as url:
        # Before the fence region A is the active region: the same request is accepted.
        status, _, text = _curl_post(url, source, "before-the-fence", "before.mp4")
        assert status == 202, text
        accepted = json.loads(text)
        assert httpx.get(f"{url}/health/ready", timeout=10).status_code == 200
        uploads_before = [e for e in committed_events(settings, settings.uploads_topic)
                          if isinstance(e, ev.UploadCompleted)]
        assert [e.upload_id for e in uploads_before] == [accepted["upload_id"]]
        objects_before = _objects(settings)
        assert len(objects_before) == 1 and objects_before[0].endswith("/before.mp4")

        failover_id = str(uuid.uuid4())
        fence = failover_event(authority([]), "b", reason="test: region a is fenced", operator="pytest",
                               planned=False, recorded_by="pytest", failover_id=failover_id,
                               stamp=system_clock.stamp())
        write_region_record(settings, fence)

        def fenced() -> httpx.Response | None:
            answer = httpx.get(f"{url}/health/ready", timeout=10)
            return answer if answer.status_code == 503 else None

        ready = wait_for(fenced, 30, "the intake to read the fence (region_check_interval_s = 1)")
        assert ready.json()["status"] == "fenced" and ready.json()["active_region"] == "b"

        key = f"after-{uuid.uuid4()}"
        status, headers, text = _curl_post(url, source, key, "after.mp4")
        assert status == 503, text
        body = json.loads(text)
        assert body["error"] == "region_fenced"
        assert (body["region"], body["active_region"], body["epoch"], body["failover_id"]) == ("a", "b", 1, failover_id)
        assert body["upload_to"] == "https://region-b.intake.example/uploads"
        assert f"failover {failover_id}" in body["reason"] and "region b" in body["reason"]
        assert int(headers["retry-after"]) == body["retry_after_s"] > 0

        # `submit --url` stops at that answer (exit 3) instead of waiting out its Retry-After ten times.
        through_http = tapeline_cli(settings, "submit", "--url", url, "--token", TOKEN, str(source), timeout_s=120)
        assert through_http.returncode == FENCED_EXIT_CODE, through_http.stdout + through_http.stderr
        said = " ".join(through_http.stderr.split())
        assert "503 region_fenced" in said and "https://region-b.intake.example/uploads" in said, said
        assert "retrying" not in said

    # Nothing of the refused upload anywhere: no record, no object, no claim row.
    uploads_after = [e for e in committed_events(settings, settings.uploads_topic) if isinstance(e, ev.UploadCompleted)]
    assert [e.upload_id for e in uploads_after] == [accepted["upload_id"]]
    assert _objects(settings) == objects_before
    with psycopg.connect(settings.database_url) as conn:
        rows = conn.execute("SELECT upload_id FROM intake_uploads").fetchall()
    assert [str(r[0]) for r in rows] == [accepted["upload_id"]]
    assert upload_id_for_key("fenced", key) not in {e.upload_id for e in uploads_after}

    # `tapeline submit` is refused the same way, before anything is uploaded.
    refused = tapeline_cli(settings, "submit", str(source), timeout_s=120)
    assert refused.returncode == FENCED_EXIT_CODE, refused.stdout + refused.stderr
    error = " ".join(refused.stderr.split())
    assert f"region a is fenced: failover {failover_id} made region b the active region" in error, error
    assert "https://region-b.intake.example/uploads" in error and "TAPELINE_REGION=b tapeline submit" in error
    assert refused.stdout.strip() == ""
    assert [e.upload_id for e in committed_events(settings, settings.uploads_topic)
            if isinstance(e, ev.UploadCompleted)] == [accepted["upload_id"]]
    assert _objects(settings) == objects_before

"""Claims of the HTTP intake are leases (`TAPELINE_INTAKE_CLAIM_LEASE_S`): a `tapeline serve`
killed with SIGKILL mid-upload leaves its `intake_uploads` row uploading; it holds its tier's
capacity while its lease runs and lapses after it. Real Kafka, PostgreSQL, S3 and two intake
processes; a module of its own, so that no other test's uploads count against the capacity."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import Iterator

import httpx
import psycopg
import pytest

from producers.http_intake import upload_id_for_key
from schemas import models as ev
from tests.conftest import wait_for
from tests.integration.test_http_intake import TOKENS, clip, intake_server, post, uploads_published  # noqa: F401

pytestmark = pytest.mark.integration


def test_an_intake_killed_mid_upload_leaves_a_claim_that_lapses_after_its_lease(isolated, clip, tmp_path):
    """kill -9 of one `tapeline serve` mid-upload: its claim holds the tier's slot while its lease
    runs, then lapses; a retry with the same Idempotency-Key on another intake is the same upload."""
    lease_s = 6.0
    settings = isolated.model_copy(update={"intake_tokens": TOKENS, "intake_claim_lease_s": lease_s,
                                           "intake_tier_capacity": {"archive": 1, "standard": 100, "index": 50}})
    upload_id = upload_id_for_key("alice", "order-kill")
    key = {"Idempotency-Key": "order-kill"}
    servers: list[subprocess.Popen] = []
    go_on = threading.Event()

    def held_body() -> Iterator[bytes]:
        yield clip[:4096]
        go_on.wait(60)  # until its intake has been killed
        yield clip[4096:]

    def claim_updated_at():
        with psycopg.connect(settings.database_url) as conn:
            row = conn.execute("SELECT state, updated_at FROM intake_uploads WHERE upload_id = %s",
                               (upload_id,)).fetchone()
        return row

    def post_quietly() -> None:
        with contextlib.suppress(httpx.HTTPError):
            post(first_url, held_body(), params={"priority": "archive"}, headers=key)

    with intake_server(settings, tmp_path / "serve-a.log", servers) as first_url, \
            intake_server(settings, tmp_path / "serve-b.log") as other_url:
        client = threading.Thread(target=post_quietly)
        client.start()
        wait_for(lambda: claim_updated_at() is not None, 20, "the upload to be claimed", interval_s=0.05)
        claimed_at = claim_updated_at()[1]
        wait_for(lambda: claim_updated_at()[1] > claimed_at, lease_s, "the claim to be renewed", interval_s=0.1)
        os.killpg(servers[0].pid, signal.SIGKILL)
        servers[0].wait(10)
        go_on.set()
        client.join(30)
        assert claim_updated_at()[0] == "uploading"
        # The dead intake's claim still holds the archive tier's one slot while its lease runs ...
        held = post(other_url, clip, params={"priority": "archive"})
        assert held.status_code == 503 and held.json()["error"] == "overloaded"
        # ... and a retry of its key waits for it, then learns it failed (not "still uploading" forever).
        started = time.monotonic()
        lapsed = post(other_url, clip, params={"priority": "archive"}, headers=key)
        assert lapsed.status_code == 409 and lapsed.json()["error"] == "idempotency_key_failed"
        assert time.monotonic() - started < lease_s + 2
        again = post(other_url, clip, params={"priority": "archive"}, headers=key)
    assert again.status_code == 202, again.text
    assert again.json()["upload_id"] == upload_id and again.json()["job_id"] == ev.job_id_for(upload_id)
    assert claim_updated_at()[0] == "published"
    published = [e for e in uploads_published(settings) if e.upload_id == upload_id]
    assert len(published) == 1 and published[0].size_bytes == len(clip)

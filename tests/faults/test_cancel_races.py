"""A cancel that races a running publish (issue 44 item 1), against the real stack: a real pipeline
(`tapeline run --role all`: Kafka, PostgreSQL, the S3 endpoint), the read API's cancel action, and
anonymous GETs of the published URLs.

Before the fix, `POST /api/jobs/J/cancel` while publish attempt 1 ran answered "cancelled (publish
attempt 1, was running)"; the attempt went on, `Published` and `JobCompleted` followed as evidence,
and `published/J/master.m3u8` answered 200 to anyone, forever. Now the publish checks the job before
every object and after the last (it stops within one object), and what was public is withdrawn
(deleted, `OutputsWithdrawn`), with an answer that says since when it had been public.

The race is made certain, not left to luck: the publish pauses before its promotion, before each
object and after the last (`TAPELINE_DELAY_POINTS`), so the test cancels while the job is exactly
before promotion, between two objects, or with every object public and nothing committed yet. One
pipeline serves the module; each test submits its own job of the smallest real clip.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from cli.wiring import build_app
from producers.submit import publish, upload
from tapeline.objectstore import ObjectStore
from tapeline.samples import sample_video
from tapeline.settings import Settings
from tests.conftest import Pipeline, wait_for
from tests.faults.conftest import FAULT_TIMING, job_row
from tests.integration.helpers import committed_events, keys_under, of_job

pytestmark = pytest.mark.integration

TOKEN = "cancel-race-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
DELAYS = "publish.before_promote:4,publish.promote.object:1.5,publish.after_promote:5"
"""Seconds the publish pauses at each point (tapeline/crashpoints.py `delay_point`)."""


@pytest.fixture(scope="module")
def settings(isolated: Settings) -> Settings:
    # Heartbeats 30 s apart (a lease's worth of work between two): the publish of a short clip sends
    # none while it promotes, so only the checks of the fix can stop it, as in production where a
    # heartbeat interval is longer than a small job's promotion.
    return isolated.model_copy(update={**FAULT_TIMING, "heartbeat_interval_s": 30.0, "lease_s": 90.0,
                                       "no_progress_timeout_s": 120.0, "admin_token": SecretStr(TOKEN)})


@pytest.fixture(scope="module")
def pipeline(settings: Settings, tmp_path_factory) -> Iterator[Pipeline]:
    running = Pipeline(settings, tmp_path_factory.mktemp("cancel") / "run.log",
                       extra_env={"TAPELINE_DELAY_POINTS": DELAYS}).start()
    yield running
    running.stop()
    print(running.log_text()[-6000:])


@pytest.fixture(scope="module")
def client(settings: Settings, pipeline: Pipeline) -> Iterator[TestClient]:
    with TestClient(build_app(settings), base_url="http://localhost") as c:  # loopback Host (projections/edge.py)
        yield c


def submit(settings: Settings) -> str:
    submission = upload(settings, sample_video("carphone_pristine.mp4"))
    publish(settings, submission.event)
    return submission.job_id


def anonymous_get(settings: Settings, key: str) -> int:
    """The status an anonymous GET of the object's public URL answers (no credentials at all)."""
    return httpx.get(ObjectStore(settings).public_url(key), timeout=10).status_code


def publishing(settings: Settings, job_id: str) -> dict:
    return wait_for(lambda: (lambda r: r if r and r["state"] == "running" and r["stage"] == "publish" else None)(
        job_row(settings, job_id)), 180, f"job {job_id}'s publish attempt to run")


def attempt_over(settings: Settings, pipeline: Pipeline, job_id: str) -> None:
    """Wait until the publish attempt of `job_id` stopped: its end checked the outputs (the fix's
    Step 8 logs it), or it committed its completion (what it did before the fix)."""
    def over() -> bool:
        if any(job_id in line and "published outputs checked after the attempt" in line
               for line in pipeline.log_text().splitlines()):
            return True
        return bool(of_job(committed_events(settings), job_id, "JobCompleted"))
    wait_for(over, 60, f"job {job_id}'s publish attempt to stop", interval_s=1.0)


def cancel(client: TestClient, job_id: str) -> dict:
    response = client.post(f"/api/jobs/{job_id}/cancel", json={"operator": "carol", "why": "wrong file"}, headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()


def assert_cancelled_and_private(settings: Settings, client: TestClient, job_id: str, keys: list[str]) -> list:
    """The job says cancelled everywhere, nothing is under `published/J/`, every key once public
    answers an anonymous GET with 403 or 404, and no applied event says it completed."""
    assert job_row(settings, job_id)["state"] == "cancelled"
    detail = client.get(f"/api/jobs/{job_id}").json()["job"]
    assert detail["state"] == "cancelled" and detail.get("master_url") is None, detail
    page = client.get(f"/jobs/{job_id}")
    assert page.status_code == 200 and "cancelled" in page.text and "master.m3u8" not in page.text
    assert keys_under(settings, f"published/{job_id}/") == set()
    for key in keys + [f"published/{job_id}/master.m3u8"]:
        assert anonymous_get(settings, key) in (403, 404), key
    rows = client.get(f"/api/jobs/{job_id}/timeline").json()
    assert not [r for r in rows if r["event_type"] == "JobCompleted" and r["applied"]]
    return rows


def test_a_cancel_before_promotion_leaves_nothing_public(settings, pipeline, client):
    job_id = submit(settings)
    publishing(settings, job_id)  # the attempt holds its 4 s pause before promoting anything
    answer = cancel(client, job_id)
    assert answer["detail"] == "cancelled (publish attempt 1, was running)"  # nothing was public: nothing more to say
    attempt_over(settings, pipeline, job_id)
    assert_cancelled_and_private(settings, client, job_id, [])
    events = of_job(committed_events(settings), job_id)
    assert [e.event_type for e in events if e.event_type in ("Published", "JobCompleted", "OutputsWithdrawn")] == []


def test_a_cancel_during_promotion_withdraws_what_was_public_and_says_since_when(settings, pipeline, client):
    job_id = submit(settings)
    publishing(settings, job_id)
    prefix = f"published/{job_id}/"
    first = wait_for(lambda: sorted(keys_under(settings, prefix)) or None, 60, "the first object to be public")
    assert f"{prefix}master.m3u8" not in first  # between two objects: 1.5 s before each
    assert anonymous_get(settings, first[0]) == 200  # it is public to anyone now
    answer = cancel(client, job_id)
    assert answer["detail"].startswith("cancelled (publish attempt 1, was running); ")
    assert "were already public at " in answer["detail"] and answer["detail"].endswith("and are withdrawn (OutputsWithdrawn)")
    attempt_over(settings, pipeline, job_id)
    rows = assert_cancelled_and_private(settings, client, job_id, first)
    events = of_job(committed_events(settings), job_id)
    withdrawn = [e for e in events if e.event_type == "OutputsWithdrawn"]
    assert withdrawn and withdrawn[0].withdrawn_by == "operator cancel" and set(first) <= set(withdrawn[0].keys)
    assert all(e.reason == "job cancelled: wrong file" for e in withdrawn)
    assert [e.event_type for e in events if e.event_type in ("Published", "JobCompleted")] == []
    assert any(r["event_type"] == "OutputsWithdrawn" for r in rows)  # on the job's timeline


def test_a_cancel_after_every_output_is_public_withdraws_them_all(settings, pipeline, client):
    job_id = submit(settings)
    publishing(settings, job_id)
    master = f"published/{job_id}/master.m3u8"
    wait_for(lambda: master in keys_under(settings, f"published/{job_id}/"), 90, "the master playlist to be public")
    public = sorted(keys_under(settings, f"published/{job_id}/"))
    assert anonymous_get(settings, master) == 200  # the whole output is public; the attempt has not committed yet
    answer = cancel(client, job_id)
    assert f"; {len(public)} output(s) were already public at " in answer["detail"]
    attempt_over(settings, pipeline, job_id)
    assert_cancelled_and_private(settings, client, job_id, public)
    events = of_job(committed_events(settings), job_id)
    withdrawn = [e for e in events if e.event_type == "OutputsWithdrawn"]
    assert {k for e in withdrawn for k in e.keys} == set(public)
    assert [e.event_type for e in events if e.event_type in ("Published", "JobCompleted")] == []


def test_a_completed_job_keeps_its_outputs_and_its_cancel_is_refused(settings, pipeline, client):
    """The other side of the rule: once the publish won (completed), the cancel is refused and the
    outputs stay public."""
    job_id = submit(settings)
    wait_for(lambda: (job_row(settings, job_id) or {}).get("state") == "completed", 180, "the job to complete")
    response = client.post(f"/api/jobs/{job_id}/cancel", json={"operator": "carol", "why": "late"}, headers=ADMIN)
    assert response.status_code == 409 and "completed" in response.json()["detail"]
    assert anonymous_get(settings, f"published/{job_id}/master.m3u8") == 200
    assert not of_job(committed_events(settings), job_id, "OutputsWithdrawn")

"""The other endings of a job whose publish had made its outputs public (issue 44 item 1, "the other
ending paths"), against the real stack: a publish attempt that fails for good after promoting, and a
dead-lettered publish that an operator fails for good (`POST /api/dead-letters/fail`). Before the
fix both left `published/J/` readable by anyone while the job said failed.

The failure is injected right after the promotion (`TAPELINE_FAIL_POINTS=publish.after_promote:CLASS`):
`invalid_input` ends the job as failed at once (the attempt's own `JobFailed`), `output_conflict`
dead-letters it at once. Each test runs its own pipeline, one after the other (one fail class per
process environment); the cancel races are tests/faults/test_cancel_races.py.
"""

from __future__ import annotations

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

TOKEN = "ending-race-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def settings(isolated: Settings) -> Settings:
    return isolated.model_copy(update={**FAULT_TIMING, "heartbeat_interval_s": 30.0, "lease_s": 90.0,
                                       "no_progress_timeout_s": 120.0, "admin_token": SecretStr(TOKEN)})


def pipeline_failing_with(settings: Settings, tmp_path: Path, error_class: str) -> Pipeline:
    return Pipeline(settings, tmp_path / "run.log",
                    extra_env={"TAPELINE_FAIL_POINTS": f"publish.after_promote:{error_class}"}).start()


def submit(settings: Settings) -> str:
    submission = upload(settings, sample_video("carphone_pristine.mp4"))
    publish(settings, submission.event)
    return submission.job_id


def ended(settings: Settings, job_id: str, state: str) -> dict:
    return wait_for(lambda: (lambda r: r if r and r["state"] == state else None)(job_row(settings, job_id)), 180,
                    f"job {job_id} to be {state}")


def anonymous_get(settings: Settings, key: str) -> int:
    return httpx.get(ObjectStore(settings).public_url(key), timeout=10).status_code


@pytest.fixture()
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(build_app(settings), base_url="http://localhost") as c:
        yield c


def test_a_publish_that_fails_for_good_after_promoting_withdraws_its_outputs(settings, tmp_path):
    pipeline = pipeline_failing_with(settings, tmp_path, "invalid_input")
    try:
        job_id = submit(settings)
        ended(settings, job_id, "failed")
        withdrawn = wait_for(lambda: of_job(committed_events(settings), job_id, "OutputsWithdrawn"), 60,
                             "the attempt's OutputsWithdrawn")
    finally:
        pipeline.stop()
    master = f"published/{job_id}/master.m3u8"
    [event] = withdrawn
    assert event.withdrawn_by == "publish attempt 1" and master in event.keys and event.public_since is not None
    assert event.reason.startswith("job failed")
    assert keys_under(settings, f"published/{job_id}/") == set()
    assert all(anonymous_get(settings, key) in (403, 404) for key in event.keys)


def test_failing_a_dead_lettered_publish_for_good_withdraws_what_it_had_made_public(settings, tmp_path, client):
    pipeline = pipeline_failing_with(settings, tmp_path, "output_conflict")
    try:
        job_id = submit(settings)
        ended(settings, job_id, "dead_lettered")
        master = f"published/{job_id}/master.m3u8"
        # dead_lettered may still be replayed (and publish the same objects): its outputs stay for now
        assert anonymous_get(settings, master) == 200
        public = sorted(keys_under(settings, f"published/{job_id}/"))
        letter = wait_for(lambda: [r for r in client.get("/api/dead-letters", headers=ADMIN).json()
                                   if r.get("job_id") == job_id] or None, 60, "the dead letter to be listed")[0]
        response = client.post("/api/dead-letters/fail", json={"dead_letter_id": letter["id"], "operator": "dave",
                                                               "why": "bad master", "refund": False}, headers=ADMIN)
        assert response.status_code == 200, response.text
        assert response.json()["detail"].startswith(f"failed for good; {len(public)} output(s) were already public at ")
        assert job_row(settings, job_id)["state"] == "failed"
    finally:
        pipeline.stop()
    assert keys_under(settings, f"published/{job_id}/") == set()
    assert anonymous_get(settings, master) in (403, 404)
    withdrawn = of_job(committed_events(settings), job_id, "OutputsWithdrawn")
    assert [e.withdrawn_by for e in withdrawn] == ["operator fail"] and set(withdrawn[0].keys) == set(public)

"""`tapeline dlq fail ID --refund --why ...` (issue 23 item 5) against the real stack: a dead-lettered
job ends failed for good with operator and reason, its submitter's daily quota is credited back once
(a second call changes nothing and says so), the customer gets one signed job.failed webhook (and no
job.replayed for the bookkeeping JobReplayed), and the dead letter leaves the pending list."""

from __future__ import annotations

import json
import time

import pytest

from fastapi.testclient import TestClient
from pydantic import SecretStr

from producers.submit import publish, upload
from tapeline.samples import sample_video
from tests.conftest import Pipeline, tapeline_cli, wait_for
from tests.faults.test_worker_faults import wait_state
from tests.integration.helpers import committed_events, of_job
from tests.integration.receiver import Receiver, body_of
from tests.integration.test_dead_letters import dlq_list
from cli.wiring import build_app

pytestmark = pytest.mark.integration


def submit_as(settings, submitter: str) -> str:
    submission = upload(settings, sample_video("carphone_pristine.mp4"), submitter=submitter)
    publish(settings, submission.event)
    return submission.job_id


def test_failing_a_dead_letter_with_a_refund_credits_the_quota_once_and_tells_the_customer(isolated, tmp_path):
    settings = isolated.model_copy(update={"max_attempts": 1, "retry_jitter": 0.0, "submitter_daily_quota": 1,
                                           "notify_allow_loopback": True, "notify_poll_s": 0.3})
    receiver = Receiver().start()
    added = tapeline_cli(settings, "webhooks", "add", receiver.url("/erin"), "--submitter", "erin", "--event",
                         "job.failed", "--event", "job.replayed", "--json")
    assert added.returncode == 0, added.stderr
    receiver.secrets["/erin"], receiver.scripts["/erin"] = json.loads(added.stdout)["secret"], [200]
    broken = Pipeline(settings, tmp_path / "broken.log",
                      extra_env={"TAPELINE_FAIL_POINTS": "transcode.download:storage_transient"}).start()
    try:
        job_id = submit_as(settings, "erin")
        row = wait_state(settings, job_id, "dead_lettered", timeout_s=120)
        over = submit_as(settings, "erin")  # the quota (1 a day) is used up by the dead-lettered job
        assert wait_state(settings, over, "rejected", timeout_s=60)["error_class"] == "quota_exceeded"
        letter_id = f"{job_id}/{row['attempt']}"
        assert [r["id"] for r in dlq_list(settings, "--pending")] == [letter_id]

        first = tapeline_cli(settings, "dlq", "fail", letter_id, "--refund", "--why", "source is corrupt",
                             "--operator", "ops")
        assert first.returncode == 0, first.stderr
        assert f"{letter_id}: failed, failed for good; the submitter's quota is credited back" in first.stdout
        again = tapeline_cli(settings, "dlq", "fail", letter_id, "--refund", "--why", "again", "--operator", "ops2")
        assert again.returncode == 0, again.stderr
        assert "unchanged, already failed by ops at" in again.stdout and "(quota refunded)" in again.stdout
        # the same action in the admin API and the dashboard's dead-letter form: nothing more changes
        with TestClient(build_app(settings.model_copy(update={"admin_token": SecretStr("t0ken")})),
                        base_url="http://localhost") as web:
            form = {"dead_letter_id": letter_id, "operator": "ops3", "why": "again", "refund": "yes"}
            assert web.post("/ui/dead-letters/fail", data={**form, "token": "wrong"}).status_code == 401
            done = web.post("/ui/dead-letters/fail", data={**form, "token": "t0ken"}, follow_redirects=False)
            assert done.status_code == 303 and done.headers["location"].startswith(f"/jobs/{job_id}?")
            api = web.post("/api/dead-letters/fail", headers={"Authorization": "Bearer t0ken"},
                           json={"dead_letter_id": letter_id, "operator": "ops4", "why": "again", "refund": True})
            assert api.status_code == 200 and api.json()["done"] is False, api.text
            assert "already failed by ops at" in api.json()["detail"]
        swept = tapeline_cli(settings, "dlq", "fail", "--all", "--reason", "storage_transient", "--refund",
                             "--why", "sweep")
        assert swept.returncode == 0 and "nothing to fail" in swept.stdout, swept.stdout

        failed = wait_state(settings, job_id, "failed", timeout_s=30)
        assert failed["reason"] == "failed for good by ops: source is corrupt (quota refunded)"
        assert dlq_list(settings, "--pending") == []
        table = tapeline_cli(settings, "dlq", "list").stdout  # says it was failed, not just "replayed"
        assert "by ops: to fail it" in table, table
        # the quota is credited back once: one more job of erin's is accepted, the next one is not
        credited = submit_as(settings, "erin")
        wait_for(lambda: of_job(committed_events(settings), credited, "JobAccepted"), 60, "the credited job's JobAccepted")
        beyond = submit_as(settings, "erin")
        assert wait_state(settings, beyond, "rejected", timeout_s=60)["error_class"] == "quota_exceeded"

        wait_for(lambda: receiver.ids_of("/erin"), 60, "the job.failed webhook")
        time.sleep(3)  # a second POST (or a job.replayed) would come within a few notifier passes
    finally:
        broken.stop()
        receiver.stop()
    events = of_job(committed_events(settings), job_id)
    fails = of_job(events, job_id, "JobFailed")
    assert [(e.operator, e.refunded, e.dead_letter_id, e.error_class) for e in fails] == \
        [("ops", True, letter_id, "storage_transient")]
    replays = of_job(events, job_id, "JobReplayed")
    assert len(replays) == 1 and fails[0].causation_id == replays[0].event_id
    posts = receiver.ids_of("/erin")
    assert len(posts) == 1 and not receiver.unverified, posts
    [(webhook_id, [post])] = posts.items()
    payload = body_of(post)
    assert payload["type"] == "job.failed" and payload["data"]["job_id"] == job_id
    assert payload["data"]["operator"] == "ops" and payload["data"]["refunded"] is True

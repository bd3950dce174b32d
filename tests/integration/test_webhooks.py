"""Customer notifications by webhook (issue 23 items 1, 2 and 6) against the real stack: `tapeline
run --role all` (the notifier included) on real Kafka, PostgreSQL and S3, and a real local receiver
that verifies every Standard Webhooks signature and counts deliveries per webhook-id
(`tests/integration/receiver.py`)."""

from __future__ import annotations

import json
import time

import psycopg
import pytest
from pydantic import SecretStr

from domain.policy.webhooks import delivery_id
from tapeline.samples import sample_video
from tests.conftest import Pipeline, tapeline_cli, wait_for
from tests.integration.helpers import committed_events, of_job
from tests.integration.receiver import Receiver, body_of
from tapeline.postgres import migrate
from tests.integration.roles import rows
from tests.integration.test_problems_strip import strip
from cli.wiring import build_app
from fastapi.testclient import TestClient

pytestmark = pytest.mark.integration

TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def settings(isolated):
    return isolated.model_copy(update={"notify_allow_loopback": True, "notify_timeout_s": TIMEOUT_S,
                                       "notify_retry_schedule_s": (1.0, 1.0), "notify_disable_after_s": 1.5,
                                       "notify_poll_s": 0.3})


@pytest.fixture(scope="module")
def receiver():
    running = Receiver().start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def pipeline(settings, tmp_path_factory):
    running = Pipeline(settings, tmp_path_factory.mktemp("pipeline") / "run.log").start()
    yield running
    running.stop()
    print(running.log_text()[-4000:])


def register(settings, receiver: Receiver, path: str, submitter: str, script: list) -> dict:
    done = tapeline_cli(settings, "webhooks", "add", receiver.url(path), "--submitter", submitter, "--json")
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    assert row["secret"].startswith("whsec_")
    receiver.secrets[path], receiver.scripts[path] = row["secret"], script
    return row


def submit_as(settings, submitter: str) -> dict:
    done = tapeline_cli(settings, "submit", str(sample_video("carphone_pristine.mp4")), "--wait", "--json",
                        "--submitter", submitter, "--timeout", "180")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def delivery(settings, job_id: str, endpoint_id: str) -> dict | None:
    found = rows(settings, "SELECT * FROM webhook_deliveries WHERE job_id = %s AND endpoint_id = %s",
                 job_id, endpoint_id)
    return found[0] if found else None


def settled(settings, job_id: str, endpoint_id: str, states=("delivered",)) -> dict:
    return wait_for(lambda: (d := delivery(settings, job_id, endpoint_id)) and d["state"] in states and d, 60,
                    f"the delivery of {job_id} to {endpoint_id} to reach {states}")


@pytest.mark.parametrize("url", ["http://10.0.0.1/hook", "http://169.254.169.254/latest/meta-data",
                                 "http://192.168.1.5:8080/x", "http://[fd00::1]/x", "ftp://example.com/x"])
def test_a_private_or_malformed_url_is_refused_at_registration(settings, url):
    done = tapeline_cli(settings, "webhooks", "add", url, "--submitter", "mallory")
    assert done.returncode == 2, done.stdout
    assert "refused" in done.stderr or "must be http" in done.stderr, done.stderr
    assert "mallory" not in tapeline_cli(settings, "webhooks", "list").stdout


def test_loopback_is_refused_unless_allowed(settings):
    strict = settings.model_copy(update={"notify_allow_loopback": False})
    done = tapeline_cli(strict, "webhooks", "add", "http://127.0.0.1:9/x", "--submitter", "mallory")
    assert done.returncode == 2 and "loopback" in done.stderr, done.stderr


def test_a_completed_job_delivers_exactly_one_signed_job_completed(settings, receiver, pipeline):
    endpoint = register(settings, receiver, "/ok", "alice", [200])
    job = submit_as(settings, "alice")
    assert job["state"] == "completed"
    row = settled(settings, job["job_id"], endpoint["endpoint_id"])
    time.sleep(3)  # any second POST would come within a few notifier passes
    ids = receiver.ids_of("/ok")
    assert list(ids) == [row["delivery_id"]] and len(ids[row["delivery_id"]]) == 1
    completed = of_job(committed_events(settings), job["job_id"], "JobCompleted")[0]
    assert row["delivery_id"] == delivery_id(completed.dedup_key, endpoint["endpoint_id"])
    payload = body_of(ids[row["delivery_id"]][0])
    assert payload["type"] == "job.completed" and payload["data"]["job_id"] == job["job_id"]
    assert payload["data"]["master_url"] == job["master_url"]
    assert not receiver.unverified
    events = of_job(committed_events(settings), job["job_id"])
    kinds = [e.event_type for e in events if e.stage == "notify"]
    assert kinds == ["NotificationIntended", "NotificationDelivered"]
    assert events[-1].http_status == 200 and events[-1].try_number == 1
    # the secret is shown once: never listed, never logged
    listing = tapeline_cli(settings, "webhooks", "list", "--json")
    assert endpoint["secret"] not in listing.stdout and endpoint["endpoint_id"] in listing.stdout
    assert endpoint["secret"] not in pipeline.log_text()


def test_an_endpoint_answering_500_then_200_gets_one_success(settings, receiver, pipeline):
    endpoint = register(settings, receiver, "/flaky", "bob", [500, 200])
    job = submit_as(settings, "bob")
    row = settled(settings, job["job_id"], endpoint["endpoint_id"])
    assert row["tries"] == 2 and row["last_status"] == 200
    posts = receiver.ids_of("/flaky")[row["delivery_id"]]
    assert len(posts) == 2 and len({p["headers"]["webhook-id"] for p in posts}) == 1
    events = [e for e in of_job(committed_events(settings), job["job_id"]) if e.stage == "notify"]
    assert [e.event_type for e in events] == ["NotificationIntended", "NotificationFailed", "NotificationDelivered"]
    assert events[1].http_status == 500 and events[1].retry_at is not None
    assert "HTTP 500" in events[1].reason


def test_a_receiver_that_hangs_is_cut_off_at_the_timeout_and_retried(settings, receiver, pipeline):
    endpoint = register(settings, receiver, "/hang", "carol", [("hang", TIMEOUT_S + 3, 200), 200])
    job = submit_as(settings, "carol")
    row = settled(settings, job["job_id"], endpoint["endpoint_id"])
    assert row["tries"] == 2
    failed = [e for e in of_job(committed_events(settings), job["job_id"], "NotificationFailed")]
    assert len(failed) == 1 and failed[0].http_status is None and "timeout" in failed[0].reason
    posts = receiver.ids_of("/hang")[row["delivery_id"]]
    assert len(posts) == 2
    # the second POST came after the timeout and the 1 s backoff, not after the receiver's 5 s
    assert posts[1]["at"] - posts[0]["at"] < TIMEOUT_S + 3


def test_an_endpoint_failing_throughout_is_dead_lettered_and_disabled(settings, receiver, pipeline):
    endpoint = register(settings, receiver, "/down", "dave", [503])
    job = submit_as(settings, "dave")
    row = settled(settings, job["job_id"], endpoint["endpoint_id"], states=("dead_lettered",))
    assert row["tries"] == 3  # the first try and the schedule's two retries
    assert len(receiver.ids_of("/down")[row["delivery_id"]]) == 3
    events = of_job(committed_events(settings), job["job_id"])
    disabled = [e for e in events if e.event_type == "WebhookEndpointDisabled"]
    assert len(disabled) == 1 and disabled[0].endpoint_id == endpoint["endpoint_id"]
    listed = json.loads(tapeline_cli(settings, "webhooks", "list", "--submitter", "dave", "--json").stdout)
    assert listed[0]["enabled"] is False and "failing without a success" in listed[0]["disabled_reason"]
    assert listed[0]["dead_lettered"] == 1
    # the dashboard's strip names it with its job (and TapelineWebhookEndpointDisabled's gauge counts it)
    admin = settings.model_copy(update={"admin_token": SecretStr("webhooks-page-token")})
    with TestClient(build_app(admin), base_url="http://localhost") as web:
        line = strip(web, "/").get("webhook_endpoints_disabled")
        assert line is not None and f"{endpoint['endpoint_id']} of dave" in line, strip(web, "/")
        assert f'href="/jobs/{job["job_id"]}"' in line and 'href="/webhooks"' in line
        page = web.post("/ui/webhooks", data={"token": "webhooks-page-token"}).text  # the page needs the token
        assert endpoint["endpoint_id"] in page and "failing without a success" in page
        assert endpoint["secret"] not in page
        # enabled again: off the strip (its failure streak ends); an operator's own disable is not a problem
        assert tapeline_cli(settings, "webhooks", "enable", endpoint["endpoint_id"]).returncode == 0
        assert tapeline_cli(settings, "webhooks", "disable", endpoint["endpoint_id"], "--why", "asked").returncode == 0
        assert not {k for k in strip(web, "/") if k.startswith("webhook")}, strip(web, "/")


def test_a_replay_rebuilds_the_deliveries_from_the_log(settings, pipeline):
    """webhook_deliveries is a projection: a fresh replay of the log gives the same rows."""
    live = rows(settings, "SELECT delivery_id, job_id, endpoint_id, state, tries, last_status FROM webhook_deliveries "
                          "ORDER BY delivery_id")
    assert len(live) >= 4
    done = tapeline_cli(settings, "replay", "--into", "rebuilt")
    assert done.returncode == 0, done.stderr
    rebuilt = rows(settings, "SELECT delivery_id, job_id, endpoint_id, state, tries, last_status "
                             "FROM rebuilt.webhook_deliveries ORDER BY delivery_id")
    assert rebuilt == live


def test_the_read_only_role_never_reads_a_secret(settings, receiver):
    """The dashboard and Grafana log in as the reader role: they see endpoints, never their secrets,
    and `tapeline migrate` (grant_reader) keeps it so after the default privileges granted the table."""
    register(settings, receiver, "/hidden", "erin", [200])
    for _ in range(2):  # a second migrate changes nothing
        with psycopg.connect(settings.database_url, autocommit=True) as conn:
            migrate(settings.database_url, settings.db_schema)
            conn.execute(f"SET ROLE {settings.reader_role}")
            assert conn.execute("SELECT count(*) FROM webhook_endpoints WHERE submitter = 'erin'").fetchone()[0] == 1
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT secret FROM webhook_endpoints")


def test_a_second_endpoint_at_the_same_url_is_registered_with_a_note(settings):
    """Registering the same URL again (a secret rotation, or an operator who lost the secret) makes a
    second endpoint: every event then reaches the receiver twice, under two webhook-ids and two
    secrets, which it cannot dedupe. Found adding an endpoint twice as a user: nothing said so."""
    url = "http://127.0.0.1:9/same"
    first = tapeline_cli(settings, "webhooks", "add", url, "--submitter", "rotating", "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["same_url"] == []
    second = tapeline_cli(settings, "webhooks", "add", url, "--submitter", "rotating")
    old = json.loads(first.stdout)["endpoint_id"]
    assert second.returncode == 0, second.stderr
    said = " ".join((second.stdout + second.stderr).split())
    assert f"rotating already has this URL as {old}" in said and "cannot dedupe" in said, said
    other = tapeline_cli(settings, "webhooks", "add", url + "/other", "--submitter", "rotating", "--json")
    assert json.loads(other.stdout)["same_url"] == []


def test_a_post_goes_to_the_address_that_was_checked_not_to_a_new_dns_answer(receiver):
    """DNS rebinding (issue 23 item 2): the host is resolved and checked, then the POST connects to
    that checked address with the URL's host in `Host`, so a resolver that answers differently the
    second time cannot send it elsewhere. Here the host does not resolve at all (`.invalid`, RFC
    6761): the POST reaches the real receiver only because it is pinned to 127.0.0.1."""
    import httpx
    from processors.notify import post, signed_headers
    from datetime import datetime, timezone

    secret = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    receiver.secrets["/pinned"], receiver.scripts["/pinned"] = secret, [200]
    url = f"http://rebind.invalid:{receiver.port}/pinned"
    body = b'{"type": "job.completed"}'
    headers = signed_headers(secret, "msg_pinned", body, datetime.now(timezone.utc))
    with httpx.Client(timeout=5.0) as client:
        unpinned = post(client, url, body, headers, 5.0, 4096)
        result = post(client, url, body, headers, 5.0, 4096, address="127.0.0.1")
    assert unpinned.status is None and "no answer" in unpinned.reason  # the name itself goes nowhere
    assert result.ok, result.reason
    (record,), = receiver.ids_of("/pinned").values()
    assert record["headers"]["host"] == f"rebind.invalid:{receiver.port}"

"""Crash points around every notification boundary (issue 23 item 6): for each point of
`NOTIFY_CRASH_POINTS` in turn, a real job of a submitter with a registered endpoint runs through the
real pipeline (`tapeline run --role all`), the notifier is killed with SIGKILL at that point,
supervision restarts it, and at the end:

- every crash point fired;
- the chaos audit (`devstack/chaos.py` `audit_notifications`) finds nothing: every POST signed, one
  webhook-id per notified event, each recorded delivered exactly once after a 2xx, nothing POSTed
  after its record, every intended notification delivered;
- every job's notification is recorded delivered exactly once (one committed `NotificationDelivered`
  per webhook-id in the log) and the projection says delivered;
- the receiver (a real HTTP server verifying every Standard Webhooks signature) saw only ever one
  webhook-id per notification and exactly one 2xx for it, except where the crash came after the
  receiver's 2xx and before the record (`notify.after_post`, `notify.delivered.before_produce` and
  `.after_produce`: the record's transaction never began or was aborted): two 2xx with the same id, which receivers dedupe by
  webhook-id, as the convention asks. At the `notify.failed.*` points the first POST is answered 500:
  one failure, then one success.
"""

from __future__ import annotations

import json
import uuid

import pytest

from domain.policy.webhooks import delivery_id
from producers.submit import upload
from devstack.chaos import audit_notifications
from tapeline.crashpoints import NOTIFY_CRASH_POINTS
from tapeline.samples import sample_video
from tests.conftest import Pipeline, tapeline_cli, wait_for
from tests.faults.conftest import FAULT_TIMING
from tests.integration.helpers import committed_events
from tests.integration.receiver import Receiver
from tests.integration.roles import rows

pytestmark = pytest.mark.integration

REDELIVERED = {"notify.after_post", "notify.delivered.before_produce", "notify.delivered.after_produce"}
"""Crashes after the receiver answered 2xx and before the answer was committed: the same
notification is sent again, with the same webhook-id."""


def submit_as(settings, submitter: str) -> str:
    from producers.submit import publish

    submission = upload(settings, sample_video("carphone_pristine.mp4"), submitter=submitter)
    publish(settings, submission.event)
    return submission.job_id


def test_every_notify_crash_point_leaves_one_recorded_delivery_and_one_webhook_id(isolated, tmp_path):
    settings = isolated.model_copy(update={
        **FAULT_TIMING, "app_name": f"{isolated.app_name}-notify-{uuid.uuid4().hex[:6]}", "restart_backoff_s": (0.5,),
        "notify_allow_loopback": True, "notify_timeout_s": 3.0, "notify_retry_schedule_s": (1.0,) * 5,
        "notify_poll_s": 0.3})
    receiver = Receiver().start()
    receiver.scripts["/hook"] = [200]
    done = tapeline_cli(settings, "webhooks", "add", receiver.url("/hook"), "--submitter", "zed", "--json")
    assert done.returncode == 0, done.stderr
    endpoint = json.loads(done.stdout)
    receiver.secrets["/hook"] = endpoint["secret"]
    points_file, once = tmp_path / "crash-points", tmp_path / "crashed"
    points_file.write_text("")
    pipeline = Pipeline(settings, tmp_path / "run.log", extra_env={
        "TAPELINE_CRASH_POINTS_FILE": str(points_file), "TAPELINE_CRASH_ONCE_DIR": str(once)}).start()
    jobs: dict[str, str] = {}

    def delivered(job_id):
        found = rows(settings, "SELECT state FROM webhook_deliveries WHERE job_id = %s", job_id)
        return found and found[0]["state"] == "delivered"

    try:
        for point in NOTIFY_CRASH_POINTS:
            calls = receiver.calls["/hook"]  # the next POST is this job's first: 500 at a failure point
            receiver.scripts["/hook"] = [200] * calls + ([500, 200] if point.startswith("notify.failed.") else [200])
            points_file.write_text(point + "\n")
            job_id = submit_as(settings, "zed")
            jobs[job_id] = point
            wait_for(lambda: (once / point).exists(), 120, f"crash point {point} to fire")
            wait_for(lambda: delivered(job_id), 120, f"the notification of the job run with {point} to be delivered")
            points_file.write_text("")
    finally:
        points_file.write_text("")
        pipeline.stop()
        receiver.stop()
        print(pipeline.log_text()[-3000:])

    fired = {path.name for path in once.iterdir()}
    assert set(NOTIFY_CRASH_POINTS) <= fired, f"not covered: {sorted(set(NOTIFY_CRASH_POINTS) - fired)}"
    events = committed_events(settings)
    assert audit_notifications(events, receiver.ids_of("/hook"), len(receiver.unverified), settled=True) == []
    completed = {e.job_id: e for e in events if e.event_type == "JobCompleted"}
    for job_id, point in jobs.items():
        msg_id = delivery_id(completed[job_id].dedup_key, endpoint["endpoint_id"])
        recorded = [e for e in events if e.event_type == "NotificationDelivered" and e.delivery_id == msg_id]
        assert len(recorded) == 1, (point, recorded)
        intended = {e.dedup_key for e in events if e.event_type == "NotificationIntended" and e.delivery_id == msg_id}
        assert len(intended) == 1, (point, intended)
        posts = receiver.ids_of("/hook").get(msg_id, [])
        answered = [p["status"] for p in posts]
        expected = [200, 200] if point in REDELIVERED else [500, 200] if point.startswith("notify.failed.") else [200]
        assert answered == expected, (point, answered)
        assert {p["headers"]["webhook-id"] for p in posts} == {msg_id}
    # no POST for anything but these notifications, and one row per notification in the projection
    assert set(receiver.ids_of("/hook")) == {delivery_id(completed[j].dedup_key, endpoint["endpoint_id"]) for j in jobs}
    states = rows(settings, "SELECT state, count(*) AS n FROM webhook_deliveries GROUP BY state")
    assert states == [{"state": "delivered", "n": len(jobs)}]

"""The notifier's queries against real PostgreSQL (issue 23).

What the notifier intends does not depend on where the projector's batches end: the
operator writes `JobReplayed` with what it causes in one Kafka transaction, but the projector may
apply that transaction in two batches. Real PostgreSQL, the projector's own `apply_batch` and the
notifier's own query (`notify_new_deliveries`), with the operator's own event builders.

Between the two batches of `tapeline dlq fail` (JobReplayed, then JobFailed) a subscriber to
`job.replayed` must not be told of a replay: the job is being failed, and `job.failed` follows. A
real replay (JobReplayed, then the next StageQueued) is notified once its second half is projected.

And a slow endpoint's backlog never hides another endpoint's due delivery from the notifier's page.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import psycopg
import pytest

from domain import events as ev
from domain.policy.webhooks import NOTIFICATION_TYPES
from processors.operator_events import fail_events, replay_events
from projections.projector import apply_batch
from tapeline import webhook_endpoints as webhooks
from tapeline.clock import system_clock
from tapeline.postgres import PostgresJobStore, connect, migrate, q
from tests.fakelog import T0, FakeLog
from tests.integration.test_read_api import LADDER, MEDIA

pytestmark = pytest.mark.integration


def dead_lettered(log: FakeLog, submitter: str) -> str:
    """A job of `submitter` that ends dead-lettered on transcode attempt 1; its job id."""
    upload_id = f"u-{uuid.uuid4()}"
    job_id = ev.job_id_for(upload_id)
    common = dict(job_id=job_id, recorded_by="test", correlation_id=upload_id)
    stamp = system_clock.stamp
    for event in [
        ev.UploadCompleted.new(stamp(), stage="upload", attempt=0, upload_id=upload_id, bucket="b", object_key="k",
                               size_bytes=1, sha256="0" * 64, filename="f.mp4", priority="standard",
                               submitter=submitter, **common),
        ev.JobAccepted.new(stamp(), stage="intake", attempt=0, upload_id=upload_id, source_key="k",
                           source_sha256="0" * 64, source_size_bytes=1, priority="standard", profile="default",
                           media=MEDIA, ladder=LADDER, **common),
        ev.StageQueued.new(stamp(), stage="transcode", attempt=1, tier="standard", work_topic="w", **common),
        ev.AttemptStarted.new(stamp(), stage="transcode", attempt=1, claim_token="t1", lease_s=10.0, worker="w",
                              work_topic="w", work_partition=0, work_offset=0, **common),
        ev.JobDeadLettered.new(stamp(), stage="transcode", attempt=1, claim_token="t1", error_class="storage_transient",
                               reason="S3 answered 503", attempts=1, evidence="test", **common),
    ]:
        log.append(len(log.messages), event)
    return job_id


def wanted(conn: psycopg.Connection) -> list[tuple[str, str]]:
    """(job_id, event_type) the notifier would intend now: its own query, as `Notifier.step` runs it."""
    kinds = list(NOTIFICATION_TYPES)
    rows = conn.execute(q("notify_new_deliveries"), {
        "event_types": kinds, "notification_types": [NOTIFICATION_TYPES[k] for k in kinds],
        "since": T0 - timedelta(days=1), "limit": 500}).fetchall()
    return sorted((row["job_id"], row["event_type"]) for row in rows)


def job_row(conn: psycopg.Connection, job_id: str) -> dict:
    return conn.execute("SELECT * FROM job_state WHERE job_id = %s", (job_id,)).fetchone()


def append(log: FakeLog, events) -> list:
    return [log.append(len(log.messages), event) for _topic, event in events]


def test_a_replay_is_notified_only_with_what_it_caused_and_never_before_a_dlq_fail(isolated):
    settings = isolated.model_copy(update={"notify_allow_loopback": True})
    migrate(settings.database_url, settings.db_schema)
    store = PostgresJobStore(settings)
    store.open()
    try:
        endpoint = webhooks.register(store, settings, "erin", "http://127.0.0.1:9/hook", ["job.replayed", "job.failed"])
    finally:
        store.close()
    log = FakeLog(topic=settings.jobs_topic)
    failing, replaying = dead_lettered(log, "erin"), dead_lettered(log, "erin")
    with connect(settings.database_url, schema=settings.db_schema, autocommit=True) as conn:
        conn.row_factory = psycopg.rows.dict_row
        conn.execute("UPDATE webhook_endpoints SET created_at = %s WHERE endpoint_id = %s",
                     (T0 - timedelta(hours=1), endpoint["endpoint_id"]))
        apply_batch(conn, list(log.messages))
        assert wanted(conn) == []  # job.dead_lettered is not subscribed

        # `tapeline dlq fail`: one transaction, applied by the projector in two batches
        replayed, failed = append(log, fail_events(job_row(conn, failing), f"{failing}/1", "ops", "corrupt", True,
                                                   settings, "test", clock=system_clock))
        apply_batch(conn, [replayed])
        assert wanted(conn) == [], "a job.replayed intended for a job that is being failed"
        apply_batch(conn, [failed])
        assert wanted(conn) == [(failing, "JobFailed")]
        assert job_row(conn, failing)["state"] == "failed"

        # `tapeline dlq replay`: JobReplayed + StageQueued (+ the work item, on its own topic)
        replay = [(topic, e) for topic, e in replay_events(job_row(conn, replaying), f"{replaying}/1", "ops", "fixed",
                                                           settings, "test", clock=system_clock)
                  if topic == settings.jobs_topic]
        assert [type(e).__name__ for _t, e in replay] == ["JobReplayed", "StageQueued"]
        first, second = append(log, replay)
        apply_batch(conn, [first])
        assert wanted(conn) == [(failing, "JobFailed")], "a replay notified before what it caused is projected"
        apply_batch(conn, [second])
        assert wanted(conn) == sorted([(failing, "JobFailed"), (replaying, "JobReplayed")])


def test_a_backlog_at_one_endpoint_never_hides_another_endpoints_due_delivery(isolated):
    """Step 3 of the notifier reads at most `limit` due deliveries: a slow or failing endpoint with a
    long backlog (older than everything else) must not fill that page, or every other customer waits
    behind it. The notifier's own query, real PostgreSQL."""
    settings = isolated.model_copy(update={"notify_allow_loopback": True})
    store = PostgresJobStore(settings)
    store.open()
    try:
        slow = webhooks.register(store, settings, "slowpoke", "http://127.0.0.1:9/slow", ["job.completed"])
        fast = webhooks.register(store, settings, "zippy", "http://127.0.0.1:9/fast", ["job.completed"])
    finally:
        store.close()
    with connect(settings.database_url, schema=settings.db_schema, autocommit=True) as conn:
        conn.row_factory = psycopg.rows.dict_row
        for n, endpoint in [(i, slow) for i in range(20)] + [(20, fast)]:  # the slow endpoint's backlog is older
            conn.execute("INSERT INTO webhook_deliveries (delivery_id, job_id, endpoint_id, notification_type, "
                         "source_event_id, source_dedup_key, state, intended_at, updated_at) "
                         "VALUES (%s, %s, %s, 'job.completed', %s, %s, 'pending', %s, %s)",
                         (f"msg_{n}", f"job-{n}", endpoint["endpoint_id"], f"e{n}", f"k{n}",
                          T0 + timedelta(seconds=n), T0 + timedelta(seconds=n)))
        due = conn.execute(q("notify_due_deliveries"), {"now": T0 + timedelta(hours=1), "limit": 5,
                                                        "per_endpoint": 2}).fetchall()
    assert [row["delivery_id"] for row in due] == ["msg_0", "msg_1", "msg_20"]

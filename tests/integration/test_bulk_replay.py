"""The bulk replay (`projections/bulk.py`) builds exactly what the projector's `apply_batch` builds,
row for row in every table, on a hand-made log with duplicates, zombies, superseded claims, a job
dead letter and its replay, an undecodable record, a processor's dead letter, watchdog ticks and
repeated uploads, against real PostgreSQL; and a bulk replay that fails leaves nothing behind."""

from __future__ import annotations

import psycopg
import pytest

from projections import native
from projections.bulk import BulkReplay
from projections.projector import apply_batch
from tapeline.postgres import connect, migrate
from domain import events as ev
from tapeline.clock import system_clock
from tests.fakelog import FakeLog
from tests.integration.test_attempt_views import Job

pytestmark = pytest.mark.integration
JOBS, UPLOADS, DLQ = "fake.jobs", "fake.uploads", "fake.dlq"
TABLES = {  # table -> (columns compared, order); wall-clock columns (now()) are left out
    "job_state": ("*", "job_id"),
    "lifecycle_evidence": ("*", 'topic, partition, "offset"'),
    "uploads": ("*", "upload_id"),
    "dead_letters": ('id, kind, topic, partition, "offset", broker_ts, key, value, headers, error, job_id, stage, '
                     "attempt, error_class, attempts, evidence, seen_by, replayed_at, replayed_by, replay_reason",
                     "id"),
    "applied_dedup_keys": ("*", "dedup_key"),
    "log_clock": ("*", "partition"),
    "projector_offsets": ("projection, topic, partition, next_offset", "projection, topic, partition"),
}


def build_log() -> tuple[list, dict]:
    """Messages of three topics interleaved in one consumption order, and what they hold."""
    p0, p1, uploads, dlq = FakeLog(JOBS, 0), FakeLog(JOBS, 1), FakeLog(UPLOADS, 0), FakeLog(DLQ, 0)
    a, b, c, d = Job(), Job(), Job(), Job()
    order: list = []

    def put(log, at_s, event):
        order.append(log.append(at_s, event))

    put(uploads, 0, ev.UploadCompleted.new(system_clock.stamp(), job_id=a.job_id, stage="intake", attempt=0, recorded_by="t",
                                           correlation_id=a.upload_id, upload_id=a.upload_id, bucket="b",
                                           object_key="k", size_bytes=1, sha256="0" * 64, filename="a.mp4",
                                           priority="standard"))
    # A: attempt 1 fails and is retried; its zombie heartbeats late (superseded); attempt 2 succeeds,
    # publishes and completes; then a redelivery (duplicates) and a late event of the completed job.
    hb_a1 = a.heartbeat(1, "a1", 1, 100, 4.0)
    for at_s, event in [(1, a.accepted()), (2, a.queued("transcode", 1)), (3, a.started("transcode", 1, "a1", "w1")),
                        (4, hb_a1),
                        (5, a.event(ev.AttemptFailed, "transcode", 1, "a1", error_class="storage_transient",
                                    retryable=True, reason="S3 503")),
                        (5, a.event(ev.RetryScheduled, "transcode", 1, "a1", next_attempt=2,
                                    not_before=a.accepted().occurred_at, error_class="storage_transient")),
                        (6, a.queued("transcode", 2)),
                        (7, a.heartbeat(1, "a1", 2, 200, 8.0)),  # the zombie
                        (8, a.started("transcode", 2, "a2", "w2")),
                        (9, a.event(ev.CheckpointRecorded, "transcode", 2, "a2", sequence=0, segment_index=0,
                                    rendition="720p", object_key="o", sha256="1" * 64, frames=100,
                                    media_start_s=0.0, media_duration_s=4.0)),
                        (10, a.succeeded("transcode", 2, "a2")), (11, a.queued("publish", 1)),
                        (12, a.started("publish", 1, "ap", "p1")),
                        (13, a.event(ev.JobCompleted, "publish", 1, "ap", master_url="http://x/m.m3u8"))]:
        put(p0, at_s, event)
    put(p0, 14, ev.WatchdogTick.new(system_clock.stamp(), job_id="watchdog", stage="watchdog", attempt=0, recorded_by="t",
                                    correlation_id="tick", partition=0, sequence=1))
    put(p0, 15, b"\x00not an event")  # undecodable: a projection dead letter
    put(p0, 16, hb_a1)  # redelivered: a duplicate
    put(p0, 17, a.heartbeat(2, "a2", 9, 900, 36.0))  # after completion: evidence only
    put(uploads, 18, ev.UploadCompleted.new(system_clock.stamp(), job_id=a.job_id, stage="intake", attempt=0, recorded_by="t",
                                            correlation_id=a.upload_id, upload_id=a.upload_id, bucket="b",
                                            object_key="k", size_bytes=1, sha256="0" * 64, filename="a.mp4",
                                            priority="standard"))  # a second copy
    # B: two failed attempts, dead-lettered, replayed by an operator (twice: the second is a
    # duplicate), then fails for good. The dead letter's copy on the DLQ topic is skipped.
    dead = b.event(ev.JobDeadLettered, "transcode", 2, "b2", error_class="storage_transient", reason="out of attempts",
                   attempts=2, evidence="fake.jobs/1")
    replayed = b.event(ev.JobReplayed, "transcode", 2, operator="ops", reason="S3 is back",
                       dead_letter_id=f"{b.job_id}/2")
    for at_s, event in [(20, b.accepted()), (21, b.queued("transcode", 1)), (22, b.started("transcode", 1, "b1", "w1")),
                        (23, b.event(ev.AttemptFailed, "transcode", 1, "b1", error_class="storage_transient",
                                     retryable=True, reason="S3 503")),
                        (24, b.queued("transcode", 2)), (25, b.started("transcode", 2, "b2", "w1")),
                        (26, b.started("intake", 1, "b0", "w9")),  # a claim of an earlier stage: superseded
                        (27, b.event(ev.AttemptFailed, "transcode", 2, "b2", error_class="storage_transient",
                                     retryable=True, reason="S3 503")),
                        (28, dead)]:
        put(p1, at_s, event)
    put(dlq, 28, dead)
    put(dlq, 29, ev.DeadLetter.new(system_clock.stamp(), job_id=b.job_id, stage="transcode", attempt=0, recorded_by="t",
                                   correlation_id="x", source_topic="fake.work", source_partition=3, source_offset=7,
                                   key=b"k", value=b"\x01\x02", headers={"h": b"v"}, error_class="invalid_input",
                                   error="not Avro", processor="transcode"))
    for at_s, event in [(30, replayed), (31, replayed), (32, b.queued("transcode", 3)),
                        (33, b.started("transcode", 3, "b3", "w2")),
                        (34, b.event(ev.JobFailed, "transcode", 3, "b3", error_class="invalid_input", reason="bad"))]:
        put(p1, at_s, event)
    # C: rejected at intake; D: an event of a job nobody accepted (evidence only).
    put(p1, 35, c.event(ev.JobRejected, "intake", 0, upload_id=c.upload_id, error_class="invalid_input",
                        reason="not a video"))
    put(p0, 36, d.heartbeat(1, "zz", 1, 1, 0.1))
    return order, {"a": a, "b": b, "c": c, "d": d}


def live_path(conn, messages, batch: int) -> None:
    for start in range(0, len(messages), batch):
        apply_batch(conn, messages[start:start + batch], clock_topic=JOBS, dlq_topic=DLQ)


def bulk_path(conn, messages, batch: int, flush_rows: int, engine: str = "python") -> BulkReplay:
    writer = BulkReplay(conn, clock_topic=JOBS, dlq_topic=DLQ, flush_rows=flush_rows, engine=engine)
    for start in range(0, len(messages), batch):
        writer.apply(messages[start:start + batch])
    writer.finish()
    return writer


def table(conn, schema, name):
    columns, order = TABLES[name]
    return conn.execute(f"SELECT {columns} FROM {schema}.{name} ORDER BY {order}").fetchall()


def row_counts(conn, schema):
    names = [r["tablename"] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = %s", (schema,))]
    return {name: conn.execute(f"SELECT count(*) AS n FROM {schema}.{name}").fetchone()["n"]
            for name in names if name != "schema_migrations"}


def indexes(conn, schema):
    return sorted(r["indexdef"].replace(f"{schema}.", "") for r in conn.execute(
        "SELECT indexdef FROM pg_indexes WHERE schemaname = %s", (schema,)).fetchall())


@pytest.fixture(scope="module")
def log():
    return build_log()


ENGINES = ["python"] + (["native"] if native.tapeline_native is not None else [])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("live_batch, bulk_batch, flush_rows", [(7, 5, 2000), (1000, 1, 1)])
def test_bulk_replay_equals_the_projector_row_for_row(isolated, log, live_batch, bulk_batch, flush_rows, engine):
    messages, jobs = log
    live, bulk = f"live_{live_batch}_{engine}", f"bulk_{bulk_batch}_{engine}"
    for schema in (live, bulk):
        migrate(isolated.database_url, schema)
    with connect(isolated.database_url, schema=live, autocommit=True) as conn:
        conn.row_factory = psycopg.rows.dict_row
        live_path(conn, messages, live_batch)
    with connect(isolated.database_url, schema=bulk, autocommit=True) as conn:
        conn.row_factory = psycopg.rows.dict_row
        writer = bulk_path(conn, messages, bulk_batch, flush_rows, engine)
    assert writer.state.native == (engine == "native")
    # (the native engine decodes and folds in one pass: its seconds are all "fold")
    assert set(writer.phases) >= {"fold", "copy_evidence", "build_indexes"} | ({"decode"} if engine == "python" else set())
    with connect(isolated.database_url, autocommit=True) as conn:
        conn.row_factory = psycopg.rows.dict_row
        for name in TABLES:
            assert table(conn, bulk, name) == table(conn, live, name), f"{name} differs"
        assert indexes(conn, bulk) == indexes(conn, live)
        # Every table, including any a later migration adds, holds as many rows both ways (a table
        # the projector writes and the bulk path does not would show here; add it to TABLES then).
        assert row_counts(conn, bulk) == row_counts(conn, live)
        # The log really holds what this test is about.
        flags = conn.execute(f"SELECT count(*) FILTER (WHERE duplicate) AS dup,"
                             f" count(*) FILTER (WHERE superseded) AS sup,"
                             f" count(*) FILTER (WHERE NOT applied) AS not_applied FROM {bulk}.lifecycle_evidence"
                             ).fetchone()
        assert (flags["dup"], flags["sup"], flags["not_applied"]) == (2, 2, 6)
        states = {r["job_id"]: r["state"] for r in conn.execute(f"SELECT job_id, state FROM {bulk}.job_state")}
        assert states == {jobs["a"].job_id: "completed", jobs["b"].job_id: "failed", jobs["c"].job_id: "rejected"}
        dead = {r["kind"]: r for r in conn.execute(f"SELECT * FROM {bulk}.dead_letters")}
        assert set(dead) == {"job", "record", "projection"}
        assert dead["job"]["replayed_by"] == "ops" and dead["record"]["headers"] == {"h": "dg=="}
        copies = conn.execute(f"SELECT copies FROM {bulk}.uploads").fetchall()
        assert [r["copies"] for r in copies] == [2]
        assert len(conn.execute(f"SELECT * FROM {bulk}.log_clock").fetchall()) == 2


@pytest.mark.parametrize("engine", ENGINES)
def test_a_failed_bulk_replay_leaves_the_schema_empty_with_its_indexes(isolated, log, engine):
    messages, _ = log
    migrate(isolated.database_url, f"broken_{engine}")
    with connect(isolated.database_url, schema=f"broken_{engine}", autocommit=True) as conn:
        conn.row_factory = psycopg.rows.dict_row
        before = indexes(conn, f"broken_{engine}")
        writer = BulkReplay(conn, clock_topic=JOBS, dlq_topic=DLQ, flush_rows=1, engine=engine)
        writer.apply(messages[:20])
        writer.apply(messages[20:25])
        assert writer.phases["write_final_rows"] > 0 and writer._copy is not None  # rows written, a COPY open
        writer.abort(RuntimeError("the broker went away"))
        for name in ("lifecycle_evidence", "job_state", "applied_dedup_keys", "projector_offsets", "dead_letters"):
            assert conn.execute(f"SELECT count(*) AS n FROM {name}").fetchone()["n"] == 0, name
        assert indexes(conn, f"broken_{engine}") == before

"""Replay into a schema of its own, as-of replays, swapping a rebuilt schema in, and export, against
real Kafka and PostgreSQL."""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import threading
import uuid
from datetime import datetime, timezone

import fastavro
import psycopg
import pytest
from confluent_kafka import TopicPartition

from bench import lifecycles
from projections import native
from projections.export import export
from projections.replay import replay, replay_lock
from domain.codec import default_codec
from tapeline import kafka
from tests.conftest import tapeline_cli, wait_for
from cli.wiring import build_projector
from tests.integration.test_projector import run_projector_until_caught_up

pytestmark = pytest.mark.integration
COMPARED = {  # table -> (columns compared, order); columns written with now() are left out
    "job_state": ("*", "job_id"),
    "lifecycle_evidence": ("*, payload::text AS payload_text", "topic, partition, \"offset\""),
    "uploads": ("*", "upload_id"),
    "dead_letters": ("topic, partition, \"offset\", broker_ts, key, value, error, kind, error_class, job_id, stage, "
                     "attempt, attempts", "topic, partition, \"offset\""),
    "projector_offsets": ("projection, topic, partition, next_offset", "projection, topic, partition"),
    "applied_dedup_keys": ("*", "dedup_key"),  # the projector continues a swapped-in replay from these
}


def rows(settings, sql, *params):
    with psycopg.connect(settings.database_url, row_factory=psycopg.rows.dict_row) as conn:
        return conn.execute(sql, params).fetchall()


def produce(settings, producer, events, uploads=(), raw=(), abort=False):
    """One transaction: lifecycle events (and uploads, and raw bytes) to their partitions."""
    codec = default_codec()
    jobs_n = kafka.partition_count(producer, settings.jobs_topic)
    uploads_n = kafka.partition_count(producer, settings.uploads_topic)
    producer.begin_transaction()
    for event in events:
        producer.produce(settings.jobs_topic, key=event.job_id.encode(), value=codec.encode(event.to_record()),
                         partition=kafka.partition_for(event.job_id, jobs_n))
    for event in uploads:
        producer.produce(settings.uploads_topic, key=event.upload_id.encode(), value=codec.encode(event.to_record()),
                         partition=kafka.partition_for(event.upload_id, uploads_n))
    for key, value in raw:
        producer.produce(settings.jobs_topic, key=key, value=value, partition=kafka.partition_for(key.decode(), jobs_n))
    if abort:
        producer.flush(30)
        producer.abort_transaction(30)
    else:
        producer.commit_transaction(30)


def phase(settings, producer, seed, count, duplicate_first=False):
    rng = random.Random(seed)
    jobs = [lifecycles.job(rng, heartbeats=4, checkpoints=2, failed_attempts=i % 2, zombie=i % 3 == 0,
                           terminal_failure=i % 4 == 3) for i in range(count)]
    uploads = [lifecycles.upload(job[0].upload_id) for job in jobs]
    produce(settings, producer, [e for job in jobs for e in job], uploads=uploads + uploads[:1])
    if duplicate_first:  # a redelivery of the first job: duplicates, evidence only
        produce(settings, producer, jobs[0])
    return jobs


def watermarks(settings):
    consumer = kafka.consumer(settings, f"wm-{uuid.uuid4().hex[:6]}")
    try:
        marks = {}
        for topic in settings.all_topics():
            for p in range(kafka.partition_count(consumer, topic)):
                marks[(topic, p)] = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)
        return marks
    finally:
        consumer.close()


@pytest.fixture(scope="module")
def busy(isolated):
    """Two phases of lifecycles, separated in broker time; the live projection caught up after each."""
    producer = kafka.transactional_producer(isolated, f"{isolated.app_name}.replay-writer")
    first = phase(isolated, producer, 1, 6, duplicate_first=True)
    produce(isolated, producer, [e for job in lifecycles.jobs(9, 2, heartbeats=2) for e in job], abort=True)
    produce(isolated, producer, [], raw=[(b"not-a-job", b"\x00garbage")])  # undecodable: a dead letter
    run_projector_until_caught_up(isolated)
    cut = rows(isolated, "SELECT max(broker_ts) AS t FROM lifecycle_evidence")[0]["t"]
    wait_for(lambda: datetime.now(timezone.utc).timestamp() > cut.timestamp() + 0.05, 5, "broker time to move on")
    second = phase(isolated, producer, 2, 3)
    run_projector_until_caught_up(isolated)
    return {"producer": producer, "cut": cut, "first": first, "second": second}


def assert_same_tables(settings, schema_a, schema_b):
    for name, (columns, order) in COMPARED.items():
        a = rows(settings, f"SELECT {columns} FROM {schema_a}.{name} ORDER BY {order}")
        b = rows(settings, f"SELECT {columns} FROM {schema_b}.{name} ORDER BY {order}")
        assert a == b, f"{name} differs between {schema_a} and {schema_b}"


def test_replay_into_a_fresh_schema_equals_the_live_projection_row_for_row(isolated, busy):
    before = watermarks(isolated)
    done = tapeline_cli(isolated, "replay", "--into", "rebuilt", "--json", "--workers", "2")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["dead_letters"] == 1 and summary["duplicates"] > 0 and summary["superseded"] > 0
    assert summary["workers"] == 2  # partitions split between two processes (projections/partitioned.py)
    # the default engine: native when built (projections/native.py), and it did not fall back
    assert (summary["engine"], summary["engine_note"]) == ("native" if native.tapeline_native else "python", "")
    assert_same_tables(isolated, "public", "rebuilt")
    # applied_dedup_keys was built on a second connection and renamed into place
    # (keys_aside.DedupKeysAside): the tables are defined, documented and granted as migrated
    assert catalog(isolated, "rebuilt") == catalog(isolated, "public")
    assert rows(isolated, "SELECT * FROM rebuilt.log_clock ORDER BY partition") == \
        rows(isolated, "SELECT * FROM public.log_clock ORDER BY partition")
    states = {r["state"] for r in rows(isolated, "SELECT state FROM rebuilt.job_state")}
    assert {"completed", "failed"} <= states
    assert watermarks(isolated) == before  # a replay never produces


def catalog(settings, schema):
    """Every table of `schema` as the catalog describes it: columns (type, collation, NOT NULL,
    comment), indexes, constraints, the table's comment and its grants, the schema's name taken out."""
    tables = [r["tablename"] for r in rows(settings, "SELECT tablename FROM pg_tables WHERE schemaname = %s"
                                                     " ORDER BY 1", schema)]
    return {table: _describe(settings, f"{schema}.{table}", schema, table) for table in tables}


def _describe(settings, relation, schema, table):
    with psycopg.connect(settings.database_url, row_factory=psycopg.rows.dict_row) as conn:
        return conn.execute("""
            SELECT obj_description(%(r)s::regclass, 'pg_class') AS comment,
                   (SELECT relacl::text FROM pg_class WHERE oid = %(r)s::regclass) AS grants,
                   (SELECT array_agg(format('%%s %%s %%s %%s %%s', a.attname, format_type(a.atttypid, a.atttypmod),
                                            c.collname, a.attnotnull, col_description(a.attrelid, a.attnum))
                                     ORDER BY a.attnum)
                    FROM pg_attribute a LEFT JOIN pg_collation c ON c.oid = a.attcollation
                    WHERE a.attrelid = %(r)s::regclass AND a.attnum > 0 AND NOT a.attisdropped) AS columns,
                   (SELECT array_agg(replace(indexdef, %(prefix)s, '') ORDER BY indexname) FROM pg_indexes
                    WHERE schemaname = %(s)s AND tablename = %(t)s) AS indexes,
                   (SELECT array_agg(conname || ' ' || pg_get_constraintdef(oid) ORDER BY conname) FROM pg_constraint
                    WHERE conrelid = %(r)s::regclass) AS constraints""",
                            {"r": relation, "s": schema, "t": table, "prefix": f"{schema}."}).fetchone()


def test_a_replay_worker_killed_mid_replay_fails_it_and_leaves_the_schema_empty(isolated, busy):
    # The worker that reads first kills itself with SIGKILL right after sending its first slice.
    killed = tapeline_cli(isolated, "replay", "--into", "killed", "--workers", "2", "--batch-size", "50",
                          env={"TAPELINE_CRASH_POINTS": "replay.worker.after_slice"})
    assert killed.returncode == 1
    assert "died (exit code -9) before it finished; nothing was committed" in killed.stderr
    counts = rows(isolated, "SELECT (SELECT count(*) FROM killed.lifecycle_evidence) AS evidence,"
                            " (SELECT count(*) FROM killed.job_state) AS jobs,"
                            " (SELECT count(*) FROM killed.projector_offsets) AS offsets,"
                            " (SELECT count(*) FROM pg_indexes WHERE schemaname = 'killed'"
                            "  AND tablename = 'lifecycle_evidence') AS evidence_indexes")[0]
    assert counts == {"evidence": 0, "jobs": 0, "offsets": 0,
                      "evidence_indexes": rows(isolated, "SELECT count(*) AS n FROM pg_indexes WHERE schemaname ="
                                                         " 'public' AND tablename = 'lifecycle_evidence'")[0]["n"]}
    assert replay_workers_of(isolated) == []  # the other worker was stopped too
    # What the failed replay left holds no row: the same command redoes it, no --force needed.
    redone = tapeline_cli(isolated, "replay", "--into", "killed", "--workers", "2", "--json")
    assert redone.returncode == 0, redone.stderr
    assert_same_tables(isolated, "public", "killed")


def test_a_replay_killed_after_its_dedup_keys_committed_leaves_no_projection_row_and_is_redone(isolated, busy):
    # The replay's parent is killed between the commit of the staging table its second connection
    # built (keys_aside.DedupKeysAside) and its own commit.
    killed = tapeline_cli(isolated, "replay", "--into", "halfway", "--workers", "2",
                          env={"TAPELINE_CRASH_POINTS": "replay.keys_aside_committed"})
    assert killed.returncode == -9, killed.stderr
    staging = "SELECT count(*) AS n FROM pg_tables WHERE schemaname = 'halfway' AND tablename LIKE 'replay_staging_keys_%%'"
    assert rows(isolated, staging)[0]["n"] == 1
    counts = rows(isolated, "SELECT (SELECT count(*) FROM halfway.lifecycle_evidence) AS evidence,"
                            " (SELECT count(*) FROM halfway.job_state) AS jobs,"
                            " (SELECT count(*) FROM halfway.applied_dedup_keys) AS keys,"
                            " (SELECT count(*) FROM halfway.projector_offsets) AS offsets")[0]
    assert counts == {"evidence": 0, "jobs": 0, "keys": 0, "offsets": 0}
    # No projection row: the same command drops the schema, staging table included, and redoes it.
    redone = tapeline_cli(isolated, "replay", "--into", "halfway", "--workers", "2", "--json")
    assert redone.returncode == 0, redone.stderr
    assert rows(isolated, staging)[0]["n"] == 0
    assert_same_tables(isolated, "public", "halfway")
    assert catalog(isolated, "halfway") == catalog(isolated, "public")


def test_replay_refuses_a_non_empty_schema_unless_forced(isolated, busy):
    refused = tapeline_cli(isolated, "replay", "--into", "rebuilt")
    assert refused.returncode == 2 and "not empty" in refused.stderr
    live = tapeline_cli(isolated, "replay", "--into", "public", "--force")
    assert live.returncode == 2 and "live schema" in live.stderr
    forced = tapeline_cli(isolated, "replay", "--into", "rebuilt", "--force", "--json")
    assert forced.returncode == 0, forced.stderr
    assert_same_tables(isolated, "public", "rebuilt")
    # Another application's schema is never dropped, --force or not.
    with psycopg.connect(isolated.database_url, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA billing; CREATE TABLE billing.invoices (id int); INSERT INTO billing.invoices VALUES (1)")
    for extra in ((), ("--force",)):
        kept = tapeline_cli(isolated, "replay", "--into", "billing", *extra)
        assert kept.returncode == 2 and "not a Tapeline projection" in kept.stderr, kept.stderr
    assert rows(isolated, "SELECT count(*) AS n FROM billing.invoices")[0]["n"] == 1


def test_a_second_replay_into_a_schema_being_replayed_refuses_at_once(isolated, busy):
    with replay_lock(isolated.database_url, "contended"):  # what a running replay into it holds
        second = tapeline_cli(isolated, "replay", "--into", "contended")
    assert second.returncode == 1
    assert "another replay into contended is running" in second.stderr
    assert rows(isolated, "SELECT count(*) AS n FROM pg_namespace WHERE nspname = 'contended'")[0]["n"] == 0
    before_1970 = tapeline_cli(isolated, "replay", "--into", "contended", "--as-of", "1960-01-01")
    assert before_1970.returncode == 2 and "before 1970-01-01" in before_1970.stderr
    system = tapeline_cli(isolated, "replay", "--into", "information_schema", "--force")
    assert system.returncode == 2 and "not pg_* or information_schema" in system.stderr
    before_log = tapeline_cli(isolated, "replay", "--into", "before_log", "--as-of", "1971-01-01")
    assert before_log.returncode == 0 and "replayed 0 records" in before_log.stdout
    assert "the log has no record at or before --as-of 1971-01-01" in before_log.stderr


def test_as_of_replay_stops_at_the_broker_timestamp(isolated, busy):
    result = replay(isolated, "asof", as_of=busy["cut"])
    evidence = "SELECT * FROM {}.lifecycle_evidence WHERE broker_ts <= %s ORDER BY topic, partition, \"offset\""
    expected = rows(isolated, evidence.format("public"), busy["cut"])
    got = rows(isolated, evidence.format("asof"), datetime.now(timezone.utc))
    assert got == expected
    total = rows(isolated, "SELECT count(*) AS n FROM public.lifecycle_evidence")[0]["n"]
    assert 0 < len(got) < total
    second_jobs = [job[0].job_id for job in busy["second"]]
    assert rows(isolated, "SELECT count(*) AS n FROM asof.job_state WHERE job_id = ANY(%s)", second_jobs)[0]["n"] == 0
    assert result.rows["job_state"] == len(busy["first"])
    # The bulk path (the default) and the projector's own apply_batch cut at the same place and agree.
    assert result.phases["build_indexes"] >= 0
    by_batches = replay(isolated, "asof_batches", as_of=busy["cut"], bulk=False, batch_size=7)
    assert (by_batches.records, by_batches.applied, by_batches.duplicates, by_batches.superseded,
            by_batches.dead_letters) == (result.records, result.applied, result.duplicates, result.superseded,
                                         result.dead_letters)
    assert result.duplicates > 0 and result.superseded > 0
    assert_same_tables(isolated, "asof", "asof_batches")
    assert rows(isolated, "SELECT * FROM asof.log_clock ORDER BY partition") == \
        rows(isolated, "SELECT * FROM asof_batches.log_clock ORDER BY partition")


def test_export_jsonl_and_avro_stream_the_committed_history(isolated, busy):
    total = rows(isolated, "SELECT count(*) AS n FROM lifecycle_evidence")[0]["n"]
    lines = io.BytesIO()
    result = export(isolated, lines, "jsonl")
    parsed = [json.loads(line) for line in lines.getvalue().decode().splitlines()]
    assert result.events == len(parsed) == total and result.skipped_undecodable == 1
    live = {(r["partition"], r["offset"]): r for r in rows(isolated, "SELECT * FROM lifecycle_evidence")}
    for record in parsed:
        row = live[(record["partition"], record["offset"])]
        assert record["event"]["event_id"] == row["event_id"] and record["event"]["event_type"] == row["event_type"]
        assert datetime.fromisoformat(record["broker_ts"]) == row["broker_ts"]

    blob = io.BytesIO()
    assert export(isolated, blob, "avro").events == total
    blob.seek(0)
    records = list(fastavro.reader(blob))
    assert len(records) == total
    assert {(r["partition"], r["offset"]) for r in records} == set(live)
    assert {r["event"]["event_type"] for r in records} >= {"JobAccepted", "Heartbeat", "CheckpointRecorded",
                                                           "JobCompleted", "JobFailed"}

    job = busy["first"][1][0].job_id
    since = busy["cut"]
    only = io.BytesIO()
    export(isolated, only, "jsonl", job=job)
    assert [json.loads(x)["event"]["job_id"] for x in only.getvalue().decode().splitlines()] == \
        [job] * len(busy["first"][1])
    later = io.BytesIO()
    export(isolated, later, "jsonl", since=since)  # strictly after the cut: the second phase only
    expected_later = rows(isolated, "SELECT count(*) AS n FROM lifecycle_evidence WHERE broker_ts >= %s", since)[0]["n"]
    assert len(later.getvalue().splitlines()) == expected_later
    cli = tapeline_cli(isolated, "export", "--format", "avro", "--job", job, "--output", "/dev/null")
    assert cli.returncode == 0 and f"exported {len(busy['first'][1])} events" in cli.stderr


def test_export_writes_a_whole_file_or_none_and_checks_its_arguments_first(isolated, busy, tmp_path):
    total = rows(isolated, "SELECT count(*) AS n FROM lifecycle_evidence")[0]["n"]
    kept = tmp_path / "kept.jsonl"
    kept.write_text("an earlier export\n")
    for args, message in ((("--since", "garbage"), "not an ISO 8601 timestamp"),
                          (("--since", "1960-01-01"), "before 1970-01-01"),
                          (("--since", "2026-01-02", "--until", "2026-01-01"), "is not before --until")):
        refused = tapeline_cli(isolated, "export", *args, "--output", str(kept))
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
        assert kept.read_text() == "an earlier export\n"  # never opened
    missing = tapeline_cli(isolated, "export", "--output", str(tmp_path / "no-such-dir" / "x.jsonl"))
    assert missing.returncode == 1 and "cannot write" in missing.stderr and "Traceback" not in missing.stderr
    done = tapeline_cli(isolated, "export", "--output", str(kept))
    assert done.returncode == 0, done.stderr
    assert len(kept.read_text().splitlines()) == total
    assert sorted(path.name for path in tmp_path.iterdir()) == ["kept.jsonl"]  # no .partial left
    unknown = tapeline_cli(isolated, "export", "--job", "no-such-job", "--output", "/dev/null")
    assert unknown.returncode == 0 and "no event of job 'no-such-job'" in unknown.stderr


def test_swap_pauses_the_projector_and_it_resumes_from_the_new_schema(isolated, busy):
    stop, ready = threading.Event(), threading.Event()
    projector = build_projector(isolated)
    thread = threading.Thread(target=projector.run, args=(stop, ready), daemon=True)
    thread.start()
    try:
        wait_for(ready.is_set, 60, "the live projector to catch up")
        replay(isolated, "next", force=True)  # as of now; then the log moves on
        third = phase(isolated, busy["producer"], 3, 2)
        done = tapeline_cli(isolated, "replay", "--swap", "next", "--no-catch-up", "--json")
        assert done.returncode == 0, done.stderr
        retired = json.loads(done.stdout)["retired"]
        fourth = phase(isolated, busy["producer"], 4, 2)
        expected = sum(len(job) for job in busy["first"] + busy["second"] + third + fourth) + len(busy["first"][0])
        wait_for(lambda: rows(isolated, "SELECT count(*) AS n FROM public.lifecycle_evidence")[0]["n"] == expected,
                 60, "the projector to fill the swapped-in schema without gaps")
        assert rows(isolated, "SELECT count(*) AS n FROM pg_namespace WHERE nspname = %s", retired)[0]["n"] == 1
        stop.set()
        thread.join(30)
        fresh = replay(isolated, "rechecked", force=True)
        assert fresh.records > 0
        assert_same_tables(isolated, "public", "rechecked")
    finally:
        stop.set()
        thread.join(30)


def replay_workers_of(settings) -> list[int]:
    """Pids of replay worker processes (`python -m projections.partitioned`) started with `settings`'
    topic prefix (other test modules may be replaying at the same time)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if b"projections.partitioned" not in fh.read():
                    continue
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environment = fh.read().split(b"\0")
        except OSError:  # ended meanwhile
            continue
        if f"TAPELINE_TOPIC_PREFIX={settings.topic_prefix}".encode() in environment:
            found.append(int(entry))
    return found

"""What `replay --swap` refuses, the retired schema's name, the source a replay records, the reader
grants `migrate` restores, read commands on an unmigrated schema, the schema `run` migrates, and
export's counts and closed pipes: against real Kafka and PostgreSQL."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import uuid
from datetime import datetime, timezone

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from projections import pgschema
from projections.export import export
from projections.replay import replay
from tapeline.postgres import migrate
from tapeline import kafka
import devstack as stack
from tests.conftest import settings_env, tapeline_cli, wait_for
from tests.integration.test_projector import run_projector_until_caught_up
from tests.integration.test_replay import phase, produce, rows

pytestmark = pytest.mark.integration


def execute(settings, statement, *params):
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        conn.execute(statement, params)


def schemas_like(settings, pattern):
    return sorted(r["nspname"] for r in rows(settings, "SELECT nspname FROM pg_namespace WHERE nspname LIKE %s", pattern))


def broker_cluster(settings):
    consumer = kafka.consumer(settings, f"cluster-{uuid.uuid4().hex[:6]}")
    try:
        return consumer.list_topics(timeout=10).cluster_id
    finally:
        consumer.close()


@pytest.fixture(scope="module")
def log(isolated):
    """A few jobs, a garbage record, and the live projection (`public`) caught up."""
    producer = kafka.transactional_producer(isolated, f"{isolated.app_name}.guards-writer")
    jobs = phase(isolated, producer, 11, 5)
    produce(isolated, producer, [], raw=[(b"not-a-job", b"\x00garbage")])
    run_projector_until_caught_up(isolated)
    return {"producer": producer, "jobs": jobs}


def test_swap_refuses_another_apps_schema_a_missing_one_the_live_one_and_an_unfinished_replay(isolated, log):
    live_jobs = rows(isolated, "SELECT count(*) AS n FROM public.job_state")[0]["n"]
    assert live_jobs == len(log["jobs"])
    execute(isolated, "CREATE SCHEMA otherapp; CREATE TABLE otherapp.invoices (id int PRIMARY KEY, amount numeric);"
                      " INSERT INTO otherapp.invoices VALUES (1, 9.99)")
    migrate(isolated.database_url, "halfdone")  # what a replay that crashed leaves: migrated, empty, no offsets
    refusals = [(("otherapp", "--no-catch-up"), "not a Tapeline projection"),
                (("otherapp",), "not a Tapeline projection"),  # refused before a catch-up writes to it
                (("o_rebuitl", "--no-catch-up"), "does not exist"),
                (("o_rebuitl",), "does not exist"),
                (("public", "--no-catch-up"), "already the live schema"),
                (("public",), "already the live schema"),
                (("halfdone", "--no-catch-up"), "no finished replay")]
    for args, message in refusals:
        refused = tapeline_cli(isolated, "replay", "--swap", *args)
        assert refused.returncode == 2 and message in refused.stderr, (args, refused.stderr)
        assert "Traceback" not in refused.stderr
    # Nothing changed: the other application's table, the live projection, no retired or typo schema.
    assert rows(isolated, "SELECT count(*) AS n FROM otherapp.invoices")[0]["n"] == 1
    assert rows(isolated, "SELECT count(*) AS n FROM public.job_state")[0]["n"] == live_jobs
    assert schemas_like(isolated, "public_retired_%") == [] and schemas_like(isolated, "o_rebuitl") == []
    assert rows(isolated, "SELECT count(*) AS n FROM halfdone.job_state")[0]["n"] == 0

    # A catch-up completes the unfinished replay (from offset 0), which may then be swapped in.
    caught_up = tapeline_cli(isolated, "replay", "--swap", "halfdone", "--json")
    assert caught_up.returncode == 0, caught_up.stderr
    assert rows(isolated, "SELECT count(*) AS n FROM public.job_state")[0]["n"] == live_jobs
    # Swapping the same schema again: it no longer exists under that name.
    again = tapeline_cli(isolated, "replay", "--swap", "halfdone", "--no-catch-up")
    assert again.returncode == 2 and "does not exist" in again.stderr, again.stderr
    assert len(schemas_like(isolated, "public_retired_%")) == 1


def test_two_swaps_in_one_second_retire_under_distinct_readable_names(isolated, log, monkeypatch):
    moment = datetime(2026, 11, 30, 6, 24, 9, 123456, tzinfo=timezone.utc)

    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return moment

    monkeypatch.setattr(pgschema, "datetime", Frozen)
    replay(isolated, "first_swap", force=True)
    replay(isolated, "second_swap", force=True)
    first = pgschema.swap(isolated.database_url, "first_swap", "public")
    second = pgschema.swap(isolated.database_url, "second_swap", "public")
    assert first.retired == "public_retired_20261130062409"
    assert second.retired == "public_retired_20261130062409_2"
    assert set(schemas_like(isolated, "public_retired_2026113006240%")) == {first.retired, second.retired}
    taken = pgschema.swap  # an explicit name that exists is refused, not a raw DuplicateSchema
    replay(isolated, "third_swap", force=True)
    with pytest.raises(pgschema.SwapRefused, match="already exists"):
        taken(isolated.database_url, "third_swap", "public", retired=first.retired)


def test_a_replay_records_the_cluster_it_was_built_from(isolated, log):
    cluster = broker_cluster(isolated)
    for schema, workers in (("source_one", 1), ("source_two", 2)):
        done = tapeline_cli(isolated, "replay", "--into", schema, "--force", "--workers", str(workers), "--json")
        assert done.returncode == 0, done.stderr
        assert rows(isolated, f"SELECT projection, cluster_id FROM {schema}.projection_source") == \
            [{"projection": "main", "cluster_id": cluster}]
    by_batches = replay(isolated, "source_batches", force=True, bulk=False)
    assert by_batches.records > 0
    assert rows(isolated, "SELECT cluster_id FROM source_batches.projection_source")[0]["cluster_id"] == cluster
    # A catch-up of a schema built from another cluster is refused: its offsets mean nothing here.
    execute(isolated, "UPDATE source_one.projection_source SET cluster_id = 'another-cluster'")
    refused = tapeline_cli(isolated, "replay", "--swap", "source_one")
    assert refused.returncode == 1 and "another Kafka cluster" in refused.stderr, refused.stderr
    assert "source_one" in schemas_like(isolated, "source_one")


def test_migrate_restores_the_reader_grants_of_a_schema_every_run(isolated):
    schema = "granted"
    env = {"TAPELINE_DB_SCHEMA": schema}
    first = tapeline_cli(isolated, "migrate", env=env)
    assert first.returncode == 0 and "001_init.sql" in first.stderr, first.stderr
    # What a schema migrated while the role was missing looks like (010 granted nothing).
    execute(isolated, f"REVOKE SELECT ON ALL TABLES IN SCHEMA {schema} FROM tapeline_reader;"
                      f" REVOKE USAGE ON SCHEMA {schema} FROM tapeline_reader;"
                      f" ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} REVOKE SELECT ON TABLES FROM tapeline_reader")

    def can(what):
        return rows(isolated, f"SELECT {what} AS ok")[0]["ok"]

    assert not can(f"has_table_privilege('tapeline_reader', '{schema}.job_state', 'SELECT')")
    second = tapeline_cli(isolated, "migrate", env=env)
    assert second.returncode == 0 and "nothing (up to date)" in second.stderr, second.stderr
    assert can(f"has_schema_privilege('tapeline_reader', '{schema}', 'USAGE')")
    for relation in ("job_state", "lifecycle_evidence", "attempts", "stage_durations", "projector_offsets"):
        assert can(f"has_table_privilege('tapeline_reader', '{schema}.{relation}', 'SELECT')"), relation
    execute(isolated, f"CREATE TABLE {schema}.later (id int)")  # default privileges restored too
    assert can(f"has_table_privilege('tapeline_reader', '{schema}.later', 'SELECT')")


def test_read_commands_on_a_schema_never_migrated_say_so_in_one_line(isolated):
    env = {"TAPELINE_DB_SCHEMA": "never_migrated"}
    for args in (("status",), ("status", "some-job"), ("stalled",), ("timeline", "some-job"), ("dlq", "list"),
                 ("review", "list")):
        done = tapeline_cli(isolated, *args, env=env)
        assert done.returncode == 1, (args, done.stderr)
        assert "projection schema never_migrated has no tables yet" in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) <= 2, done.stderr


def test_run_migrates_the_configured_schema_and_not_public(isolated, tmp_path):
    dbname = f"tapeline_run_{uuid.uuid4().hex[:8]}"
    execute(isolated, f'CREATE DATABASE "{dbname}"')
    params = conninfo_to_dict(isolated.database_url)
    url = (f"postgresql://{params['user']}:{params['password']}@{params.get('host', '127.0.0.1')}:"
           f"{params.get('port', 5432)}/{dbname}")
    settings = isolated.model_copy(update={"database_url": url, "db_schema": "live_x"})
    logfile = open(tmp_path / "run.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--role", "projector"],
                               env={**settings_env(settings), "TAPELINE_HEALTH_PORT": "0"}, stdout=logfile,
                               stderr=logfile, start_new_session=True)
    try:
        # `run` migrates before it starts the role, and the projector records its source once it has
        # migrated live_x itself: by then a migration of public would have happened.
        wait_for(lambda: rows(settings, "SELECT to_regclass('live_x.projection_source') IS NOT NULL AS ok")[0]["ok"],
                 60, "run to migrate live_x")
        wait_for(lambda: rows(settings, "SELECT count(*) AS n FROM live_x.projection_source")[0]["n"] > 0, 60,
                 "the projector to start on live_x")
        assert rows(settings, "SELECT count(*) AS n FROM pg_tables WHERE schemaname = 'public'")[0]["n"] == 0
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)
        logfile.close()
        stack.drop_database(isolated.database_url, dbname)


def test_export_of_one_job_counts_other_jobs_apart_and_a_closed_pipe_ends_quietly(isolated, log):
    job = log["jobs"][0][0].job_id
    producer = log["producer"]
    partitions = kafka.partition_count(producer, isolated.jobs_topic)
    home = kafka.partition_for(job, partitions)
    junk = next(f"junk-{n}" for n in range(1000) if kafka.partition_for(f"junk-{n}", partitions) == home)
    produce(isolated, producer, [], raw=[(junk.encode(), b"\x00garbage of another key")])
    others = sum(len(other) for other in log["jobs"][1:] if kafka.partition_for(other[0].job_id, partitions) == home)
    others += 1 + (kafka.partition_for("not-a-job", partitions) == home)  # undecodable records keyed by others
    result = export(isolated, io.BytesIO(), "jsonl", job=job)
    assert result.events == len(log["jobs"][0])
    assert result.skipped_undecodable == 0
    assert result.skipped_other_jobs == others
    cli = tapeline_cli(isolated, "export", "--job", job, "--output", "/dev/null")
    assert cli.returncode == 0 and "undecodable" not in cli.stderr, cli.stderr
    assert f"skipped {others} records of other jobs" in cli.stderr

    for fmt in ("jsonl", "avro"):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader has gone before the first byte (`| head` after its line)
        closed = subprocess.run([sys.executable, "-m", "cli.main", "export", "--format", fmt],
                                env=settings_env(isolated), stdout=write_end, stderr=subprocess.PIPE, text=True,
                                timeout=120)
        os.close(write_end)
        assert closed.returncode == 141, closed.stderr
        assert "Traceback" not in closed.stderr and "Error" not in closed.stderr, closed.stderr


def test_a_read_only_role_cannot_freeze_the_projector(isolated, log):
    """A dashboard session (`SET ROLE tapeline_reader`) holding the old swap lock's advisory key, and
    trying the swap guard table: the guard is refused, and the projector applies new records meanwhile."""
    with psycopg.connect(isolated.database_url, autocommit=True) as reader:
        reader.execute(f"SET ROLE {isolated.reader_role}")
        reader.execute("SELECT pg_advisory_lock(%s)", (0x7A9E_0002,))  # what froze it before
        with pytest.raises(psycopg.errors.InsufficientPrivilege), reader.transaction():
            reader.execute(f"LOCK TABLE {pgschema.SWAP_GUARD} IN EXCLUSIVE MODE")
        more = phase(isolated, log["producer"], 12, 2)
        run_projector_until_caught_up(isolated)  # returns only once every partition's end is applied
        applied = rows(isolated, "SELECT count(*) AS n FROM public.job_state WHERE job_id = ANY(%s)",
                       [job[0].job_id for job in more])[0]["n"]
        assert applied == 2

"""The local stack against the real services: Kafka (KRaft), PostgreSQL, moto's S3 and ffmpeg.

No mocks. conftest's `base_settings` brings the local stack up (unless TAPELINE_* variables name
the services); `up()` is idempotent, so calling it again is cheap. Nothing here calls `down()` on
the shared stack: `down()` is exercised on a throwaway home directory that started nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType
from psycopg.conninfo import conninfo_to_dict
from typer.testing import CliRunner

from tapeline.settings import Settings
from devstack.commands import stack_app
from devstack import (
    StackError,
    HomePaths,
    kafka_nodes,
    s3_client,
    check_ffmpeg,
    down,
    drop_database,
    ensure_topics,
    masked_dsn,
    status,
    up,
)

pytestmark = pytest.mark.integration


SERVICES_GIVEN = all(os.environ.get(name) for name in
                     ("TAPELINE_KAFKA_BOOTSTRAP", "TAPELINE_DATABASE_URL", "TAPELINE_S3_ENDPOINT"))
"""True when the services come from the environment (conftest then does not start the local stack)."""


@pytest.fixture(scope="module")
def stack_settings(base_settings: Settings) -> Settings:
    """The shared services' settings; conftest's `base_settings` has brought the local stack up."""
    return base_settings


def _topic_config(settings: Settings, topic: str) -> dict[str, str]:
    admin = AdminClient({"bootstrap.servers": settings.kafka_bootstrap})
    resource = ConfigResource(ResourceType.TOPIC, topic)
    entries = admin.describe_configs([resource], request_timeout=30)[resource].result(timeout=30)
    return {name: entry.value for name, entry in entries.items()}


def test_status_reports_every_service_up(stack_settings: Settings) -> None:
    report = status(stack_settings)
    for service in ("kafka", "postgres", "s3", "ffmpeg"):
        assert report[service]["up"] is True, report[service]
    assert report["kafka"]["address"] == stack_settings.kafka_bootstrap
    assert report["s3"]["address"] == stack_settings.s3_endpoint
    assert report["ffmpeg"]["version"]
    if urlsplit(stack_settings.database_url).password:
        assert urlsplit(report["postgres"]["address"]).password == "***"
    json.dumps(report)  # serialisable as is


def test_status_shows_monitoring_that_was_never_started_as_optional(tmp_path: Path, monkeypatch) -> None:
    """Prometheus and Alertmanager are optional: not started, they read `off`, not `down` (`--json`
    keeps `up: false`). Free ports of a throwaway home, so nothing answers there."""
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0)), b.bind(("127.0.0.1", 0))
        ports = a.getsockname()[1], b.getsockname()[1]
    monkeypatch.setenv("TAPELINE_HOME", str(tmp_path))
    monkeypatch.setenv("TAPELINE_PROMETHEUS_PORT", str(ports[0]))
    monkeypatch.setenv("TAPELINE_ALERTMANAGER_PORT", str(ports[1]))
    table = CliRunner().invoke(stack_app, ["status"], env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    rows = {line.split("│")[1].strip(): line for line in table.output.splitlines() if line.count("│") > 2}
    for service in ("prometheus", "alertmanager"):
        assert rows[service].split("│")[2].strip() == "off", rows[service]
        assert "optional: tapeline stack up --with-monitoring" in rows[service]
    report = json.loads(CliRunner().invoke(stack_app, ["status", "--json"]).stdout)
    assert report["prometheus"]["up"] is False and report["alertmanager"]["up"] is False


@pytest.mark.skipif(SERVICES_GIVEN, reason="services given by TAPELINE_* variables: the local stack is not used")
def test_up_twice_is_harmless(stack_settings: Settings) -> None:
    first = up(stack_settings)
    second = up(stack_settings)
    for service in ("kafka", "s3"):
        assert first[service]["pid"] == second[service]["pid"]
        assert second[service]["up"] is True
    assert second["postgres"]["up"] is True


def test_status_json_cli(stack_settings: Settings) -> None:
    result = CliRunner().invoke(stack_app, ["status", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert {"kafka", "postgres", "s3", "ffmpeg"} <= report.keys()
    assert all(report[name]["up"] for name in ("kafka", "postgres", "s3", "ffmpeg"))
    if urlsplit(stack_settings.database_url).password:
        assert urlsplit(report["postgres"]["address"]).password == "***"


def test_jobs_topic_uses_log_append_time_and_keeps_everything(stack_settings: Settings) -> None:
    config = _topic_config(stack_settings, stack_settings.jobs_topic)
    assert config["message.timestamp.type"] == "LogAppendTime"
    assert config["retention.ms"] == "-1"
    assert config["retention.bytes"] == "-1"
    for topic in (stack_settings.uploads_topic, stack_settings.dlq_topic):
        assert _topic_config(stack_settings, topic)["retention.ms"] == "-1"


def test_ensure_topics_for_any_settings_is_idempotent(stack_settings: Settings) -> None:
    settings = stack_settings.model_copy(update={
        "topic_prefix": f"stacktest-{uuid.uuid4().hex[:8]}",
        "jobs_partitions": 3, "work_partitions": 1, "uploads_partitions": 2})
    admin = AdminClient({"bootstrap.servers": settings.kafka_bootstrap})
    try:
        # A jobs topic that someone created with the broker defaults (CreateTime, 7 days) is repaired.
        admin.create_topics([NewTopic(settings.jobs_topic, num_partitions=3, replication_factor=1)])[
            settings.jobs_topic].result()
        assert _topic_config(settings, settings.jobs_topic)["message.timestamp.type"] == "CreateTime"
        ensure_topics(settings)
        ensure_topics(settings)  # a second call finds everything in place
        metadata = admin.list_topics(timeout=10)
        for topic, partitions in settings.all_topics().items():
            assert len(metadata.topics[topic].partitions) == partitions
        config = _topic_config(settings, settings.jobs_topic)
        assert config["message.timestamp.type"] == "LogAppendTime"
        assert config["retention.ms"] == "-1"
        assert _topic_config(settings, settings.work_topic("transcode", "standard"))[
            "message.timestamp.type"] == "CreateTime"
    finally:
        for future in admin.delete_topics(list(settings.all_topics()), operation_timeout=30).values():
            future.result()


def test_only_the_published_prefix_is_public(stack_settings: Settings) -> None:
    s3 = s3_client(stack_settings)
    bucket = stack_settings.s3_bucket
    s3.head_bucket(Bucket=bucket)
    name = uuid.uuid4().hex
    public_key, private_key = f"published/stacktest/{name}.txt", f"work/stacktest/{name}.txt"
    s3.put_object(Bucket=bucket, Key=public_key, Body=b"published bytes")
    s3.put_object(Bucket=bucket, Key=private_key, Body=b"attempt output")
    try:
        with urllib.request.urlopen(f"{stack_settings.s3_endpoint}/{bucket}/{public_key}", timeout=10) as resp:
            assert resp.status == 200
            assert resp.read() == b"published bytes"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{stack_settings.s3_endpoint}/{bucket}/{private_key}", timeout=10)
        assert refused.value.code == 403
    finally:
        s3.delete_object(Bucket=bucket, Key=public_key)
        s3.delete_object(Bucket=bucket, Key=private_key)


def test_check_ffmpeg_names_the_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    check_ffmpeg()  # present on this machine
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no ffmpeg, no ffprobe
    with pytest.raises(StackError, match=r"apt-get install -y ffmpeg"):
        check_ffmpeg()


def _database_exists(settings: Settings, dbname: str) -> bool:
    with psycopg.connect(settings.database_url) as conn:
        return conn.execute("SELECT count(*) FROM pg_database WHERE datname = %s", (dbname,)).fetchone()[0] == 1


def _superuser_session(settings: Settings, dbname: str, sql: str) -> subprocess.Popen:
    """A session of the `postgres` superuser in `dbname` running `sql` (psql over the local socket):
    one the DSN's role may not terminate, as PostgreSQL 15 treats an autovacuum worker."""
    port = str(conninfo_to_dict(settings.database_url).get("port", 5432))
    process = subprocess.Popen(["runuser", "-u", "postgres", "--", "psql", "-X", "-q", "-p", port, "-d", dbname,
                                "-c", sql], cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # autocommit: pg_stat_activity is a snapshot taken once per transaction
    with psycopg.connect(settings.database_url, autocommit=True) as conn:  # the session is there first
        deadline = time.monotonic() + 30
        while conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND usename = 'postgres'",
                           (dbname,)).fetchone()[0] == 0:
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "the superuser session never connected"
            time.sleep(0.05)
    return process


needs_local_superuser = pytest.mark.skipif(
    SERVICES_GIVEN or os.geteuid() != 0 or shutil.which("runuser") is None or shutil.which("psql") is None,
    reason="needs the stack's own PostgreSQL and root, to open a superuser session with `runuser -u postgres psql`")


def test_drop_database_ends_the_sessions_of_its_own_role(stack_settings: Settings) -> None:
    dbname = f"tapeline_drop_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(stack_settings.database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    session = psycopg.connect(stack_settings.database_url.rsplit("/", 1)[0] + "/" + dbname)
    drop_database(stack_settings.database_url, dbname)
    assert not _database_exists(stack_settings, dbname)
    with pytest.raises(psycopg.OperationalError):
        session.execute("SELECT 1")
    session.close()
    drop_database(stack_settings.database_url, dbname)  # IF EXISTS: a second drop is harmless


@needs_local_superuser
def test_drop_database_waits_out_a_session_it_may_not_terminate(stack_settings: Settings) -> None:
    """CI once failed in a test's cleanup: `DROP DATABASE ... WITH (FORCE)` refused (InsufficientPrivilege)
    because an autovacuum worker was in the database. A session that ends on its own within the wait
    must not fail the drop; one that stays gets ObjectInUse, and the database is left whole."""
    dbname = f"tapeline_drop_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(stack_settings.database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    brief = _superuser_session(stack_settings, dbname, "SELECT pg_sleep(2)")
    drop_database(stack_settings.database_url, dbname)
    assert brief.wait(30) == 0
    assert not _database_exists(stack_settings, dbname)

    with psycopg.connect(stack_settings.database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    stays = _superuser_session(stack_settings, dbname, "SELECT pg_sleep(120)")
    try:
        with pytest.raises(psycopg.errors.ObjectInUse):
            drop_database(stack_settings.database_url, dbname, attempts=1)
        assert _database_exists(stack_settings, dbname)
    finally:
        port = str(conninfo_to_dict(stack_settings.database_url).get("port", 5432))
        subprocess.run(["runuser", "-u", "postgres", "--", "psql", "-X", "-q", "-p", port, "-d", "postgres", "-c",
                        f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{dbname}'"],
                       cwd="/", check=True, capture_output=True, timeout=30)
        stays.wait(30)
        drop_database(stack_settings.database_url, dbname)
    assert not _database_exists(stack_settings, dbname)


def test_masked_dsn_hides_the_password() -> None:
    assert masked_dsn("postgresql://u:s3cret@h:5432/d") == "postgresql://u:***@h:5432/d"
    assert "s3cret" not in masked_dsn("host=h user=u password=s3cret dbname=d")
    assert masked_dsn("postgresql://u@h/d") == "postgresql://u@h/d"


def test_down_signals_only_processes_the_stack_recorded(tmp_path: Path) -> None:
    """`down` on a home that started nothing: it must stop only a process whose pid file *and*
    command line are the stack's, leave a stranger (whose pid sits in a pid file) alone, drop
    stale pid files, and not touch PostgreSQL (stack.json records no cluster)."""
    settings = Settings(home=tmp_path / "home", s3_endpoint="http://127.0.0.1:1")
    paths = HomePaths(settings.home.resolve())
    [node] = kafka_nodes(settings, paths)  # the one-node layout: files directly in <home>/kafka/
    paths.kafka.mkdir(parents=True)
    paths.s3.mkdir(parents=True)
    sleeper = "import time; time.sleep(120)"
    # Looks exactly like the broker the stack launches: argv holds kafka.Kafka and its properties path.
    ours = subprocess.Popen([sys.executable, "-c", sleeper, "kafka.Kafka", str(node.properties)])
    stranger = subprocess.Popen([sys.executable, "-c", sleeper])
    try:
        node.pid_file.write_text(f"{ours.pid}\n")
        paths.s3_pid.write_text(f"{stranger.pid}\n")  # a recycled pid: not moto_server
        down(settings)
        ours.wait(timeout=20)  # stopped by SIGTERM
        assert stranger.poll() is None, "down signalled a process the stack did not start"
        assert not node.pid_file.exists() and not paths.s3_pid.exists()
        assert "postgres" not in json.loads(paths.state.read_text() if paths.state.exists() else "{}")
        down(settings)  # again: nothing recorded, nothing to do
        assert stranger.poll() is None
    finally:
        for proc in (ours, stranger):
            if proc.poll() is None:
                proc.kill()
                proc.wait()

"""Fixtures shared by every tier.

Real services only: `TAPELINE_KAFKA_BOOTSTRAP`, `TAPELINE_DATABASE_URL` and `TAPELINE_S3_ENDPOINT`
name services to use; without them the project's local stack is started (`tapeline stack up`).
Isolation: every test module gets its own topic prefix, app name (consumer groups and transactional
ids) and a fresh PostgreSQL database.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tapeline.postgres import migrate
from tapeline.settings import Settings

REPO = Path(__file__).resolve().parent.parent
SMALL_TOPICS = {"jobs_partitions": 3, "work_partitions": 2, "uploads_partitions": 2}


def missing_under_ci(reason: str, module_level: bool = False) -> NoReturn:
    """A prerequisite the test cannot run without is missing (`reason`): skip the test (or, with
    `module_level`, its module), except under CI (`CI` set by .ci/run, whose bootstrap provides every
    prerequisite, as root), where that fails instead, so nothing is skipped there unseen."""
    if os.environ.get("CI"):
        pytest.fail(f"CI: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=module_level)


def wait_for(condition: Callable[[], Any], timeout_s: float, message: str, interval_s: float = 0.2) -> Any:
    """Poll `condition` until it returns something truthy; fail the test after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s: {message}")
        time.sleep(interval_s)


@pytest.fixture(scope="session")
def base_settings() -> Settings:
    """Settings of the shared real services, started by the local stack unless given by environment."""
    settings = Settings()
    given = all(os.environ.get(v) for v in ("TAPELINE_KAFKA_BOOTSTRAP", "TAPELINE_DATABASE_URL", "TAPELINE_S3_ENDPOINT"))
    if not given:
        import devstack as stack

        stack.up(settings)
    return settings


def settings_env(settings: Settings) -> dict[str, str]:
    """Environment variables that reproduce `settings` in a child process."""
    env = dict(os.environ)
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if value is None or name == "instance_id":
            continue
        if hasattr(value, "get_secret_value"):  # pydantic SecretStr (admin_token): str() would mask it
            value = value.get_secret_value()
        env[f"TAPELINE_{name.upper()}"] = json.dumps(value) if isinstance(value, (tuple, list, dict)) else str(value)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def isolated_settings(base_settings: Settings, tag: str, database_url: str, **update: Any) -> Settings:
    """`base_settings` with topics, app name and database of their own (`tag`), small partition
    counts, and the test defaults (`update` overrides)."""
    return base_settings.model_copy(update={"topic_prefix": f"t{tag}", "app_name": f"tapeline-test-{tag}",
                                            "database_url": database_url, **SMALL_TOPICS,
                                            # the bucket is shared by every test: never sweep others' objects
                                            "cleanup_orphans": False,
                                            # many tests resubmit one sample and count its transcode
                                            # attempts; tests/integration/test_bounded_work.py turns it on
                                            "reuse_results": False, **update})


def database_named(database_url: str, dbname: str) -> str:
    """`database_url` naming database `dbname` instead, as a URL; every other part kept (its libpq
    parameters too: sslmode, sslrootcert, ...)."""
    from urllib.parse import urlsplit, urlunsplit

    if "://" in database_url:
        return urlunsplit(urlsplit(database_url)._replace(path=f"/{dbname}"))
    params = conninfo_to_dict(database_url)
    return (f"postgresql://{params.get('user')}:{params.get('password')}@{params.get('host', '127.0.0.1')}:"
            f"{params.get('port', 5432)}/{dbname}")


@contextlib.contextmanager
def own_database(base_settings: Settings, tag: str) -> Iterator[str]:
    """A fresh database `tapeline_test_<tag>` on the shared PostgreSQL, migrated; yields its URL and
    drops it afterwards (a leftover session of another role leaks it: printed, the test stands)."""
    import devstack as stack

    dbname = f"tapeline_test_{tag}"
    with psycopg.connect(base_settings.database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    url = database_named(base_settings.database_url, dbname)
    try:
        migrate(url)
        yield url
    finally:
        try:
            stack.drop_database(base_settings.database_url, dbname)
        except psycopg.Error as exc:
            print(f"could not drop test database {dbname}: {exc}")


@pytest.fixture(scope="module")
def isolated(base_settings: Settings) -> Iterator[Settings]:
    """A module's own topics (small partition counts), app name and database on the shared services."""
    import devstack as stack

    tag = uuid.uuid4().hex[:8]
    with own_database(base_settings, tag) as url:
        settings = isolated_settings(base_settings, tag, url)
        stack.ensure_topics(settings)
        yield settings
        leftover = stack.delete_topics(settings)
        if leftover:
            print(f"could not delete test topics {leftover}")


class Pipeline:
    """`tapeline run --role all` as a real child process with the module's settings."""

    def __init__(self, settings: Settings, log_path: Path, extra_env: dict[str, str] | None = None) -> None:
        self.settings, self.log_path = settings, log_path
        self.extra_env = extra_env or {}
        self.process: subprocess.Popen | None = None

    def start(self) -> "Pipeline":
        self.log = open(self.log_path, "ab")
        self.process = subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--role", "all"],
                                        env={**settings_env(self.settings), **self.extra_env}, stdout=self.log,
                                        stderr=self.log, start_new_session=True)
        return self

    def wait_projection(self, timeout_s: float = 120.0) -> "Pipeline":
        """Wait until this pipeline's projector has applied every partition of the lifecycle log up to
        its last stable offset now (a command run right after `start` waits only its own
        `caught_up_timeout_s` for that, which a loaded machine's start-up can outlast). Raises
        `ServiceUnavailable` after `timeout_s` seconds."""
        from tapeline.kafka import KafkaEventLog
        from tapeline.postgres import PostgresJobStore

        topic = self.settings.jobs_topic
        events = KafkaEventLog(self.settings, f"{self.settings.app_name}.tests.lso")
        jobs = PostgresJobStore(self.settings)
        deadline = time.monotonic() + timeout_s
        try:
            for partition in range(events.partition_count(topic)):
                jobs.wait_applied(topic, partition, events.last_stable_offset(topic, partition),
                                  max(1.0, deadline - time.monotonic()))
        finally:
            jobs.close()
            events.close()
        return self

    def stop(self, timeout_s: float = 40.0) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child_roles(self) -> list[tuple[str, int]]:
        """(role, pid) of every live child of the supervisor, read from /proc (several per stage with
        `*_workers`)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == self.process.pid and b"--role" in cmdline:
                role = cmdline[cmdline.index(b"--role") + 1].decode()
                if role != "all":  # a child forked but not yet exec'd still shows the supervisor's command line
                    found.append((role, int(entry.name)))
        return found

    def children(self) -> dict[str, int]:
        """{role: pid} of the supervisor's live children."""
        return dict(self.child_roles())


@pytest.fixture(scope="module")
def pipeline(isolated: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    """Every processor role running against the module's isolated settings."""
    running = Pipeline(isolated, tmp_path_factory.mktemp("pipeline") / "run.log").start()
    yield running
    running.stop()
    print(running.log_text()[-4000:])


def tapeline_cli(settings: Settings, *args: str, timeout_s: float = 300.0,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the `tapeline` CLI as a user would, with the module's settings (and `env`) in the environment."""
    return subprocess.run([sys.executable, "-m", "cli.main", *args], env={**settings_env(settings), **(env or {})},
                          capture_output=True, text=True, timeout=timeout_s)


def make_dsn(settings: Settings) -> str:
    return make_conninfo(settings.database_url)


@contextlib.contextmanager
def private_moto_server(settings: Settings, directory: Path, tls: Any = None,
                        **overrides: Any) -> Iterator[tuple[Settings, subprocess.Popen]]:
    """A local object store (`devstack.s3server`: moto behind the signature gate) of the caller's own
    on a free port, with the bucket and policy `tapeline stack up`
    creates: for tests that pause S3 or sweep the whole bucket, which the shared endpoint (objects in
    memory, used by every test) must never see. With `tls` (a `devstack.tls.ServerCertificate` for
    127.0.0.1) it serves HTTPS; `overrides` must then name the CA (`s3_ca_bundle`). Yields (settings
    pointing at it + `overrides`, process)."""
    import socket

    from tapeline.objectstore import endpoint_answers
    from devstack import s3 as stack

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(directory / "moto.log", "wb")
    scheme = "https" if tls is not None else "http"
    private = settings.model_copy(update={"s3_endpoint": f"{scheme}://127.0.0.1:{port}", **overrides})
    server = subprocess.Popen(stack.s3_server_command("127.0.0.1", port, tls), stdout=log, stderr=log, cwd=directory,
                              env=stack.s3_server_env(private), start_new_session=True)
    try:
        wait_for(lambda: endpoint_answers(private)[0], 30, "the private moto_server to answer")
        stack.ensure_bucket(private, None)
        yield private, server
    finally:
        os.kill(server.pid, signal.SIGCONT)  # it may have been paused
        server.terminate()
        server.wait(10)
        log.close()

"""`tapeline migrate`, `run` and `serve`: the commands that start the processes (registered on the
main CLI in `cli/main.py`)."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from typing import NoReturn, Optional

import typer

import structlog

from domain.errors import AccessRefused, KafkaAccessRefused, StorageAccessRefused, StorageError, TapelineError
from tapeline import logs
from cli.helpers import region_settings, console, fail, load_settings
from domain.pipeline import STAGE_NAMES
from tapeline.settings import Settings

ROLE_CHOICES = ("intake", *STAGE_NAMES, "projector", "watchdog", "notify", "all")
"""Every role of `tapeline run --role`: each stage of the registry (`domain/pipeline.py`) is one."""


def migrate() -> None:
    """Apply the PostgreSQL migrations (projections/sql/migrations) to the projection schema
    (TAPELINE_DB_SCHEMA), and make the read grants of TAPELINE_READER_ROLE again where missing."""
    from tapeline.postgres import migrate as run_migrations

    settings = load_settings()
    try:
        applied = run_migrations(settings.database_url, settings.db_schema, settings.reader_role)
    except TapelineError as exc:
        fail(exc)
    console.print(f"schema {settings.db_schema}: applied {', '.join(applied) if applied else 'nothing (up to date)'}",
                  highlight=False)


def as_role(settings: Settings, role: str) -> Settings:
    """`settings` of a process running `role`: its Kafka principal is that role's (`Settings.kafka_role`),
    unless the environment names one (TAPELINE_KAFKA_ROLE); `all` (the supervisor) keeps the operator's."""
    if role == "all" or "kafka_role" in settings.model_fields_set:
        return settings
    return settings.model_copy(update={"kafka_role": role})


def check_storage_access(settings: Settings, role: str) -> None:
    """Before a role that uses the bucket starts (`cli.wiring.STORAGE_ROLES`; `all` runs them): raise
    `StorageAccessRefused` when S3 refuses its credentials or TLS (`tapeline.objectstore.check_access`).
    An endpoint that does not answer now is only logged: it may answer later, and each call retries."""
    from cli.wiring import STORAGE_ROLES
    from tapeline.objectstore import check_access

    if role != "all" and role not in STORAGE_ROLES:
        return
    try:
        check_access(settings)
    except StorageAccessRefused:
        raise
    except StorageError as exc:
        structlog.get_logger("tapeline.run").warning("S3 did not answer the start-up check; starting anyway",
                                                    error=str(exc))


def exit_refused(settings: Settings, role: str, exc: AccessRefused) -> NoReturn:
    """A refusal met while `run` starts: `run --role all` exits `ACCESS_REFUSED_EXIT_CODE` at once (its
    children would each meet it), a single role holds it (`hold_refusal`), then exits."""
    if role == "all":
        fail(exc, code=ACCESS_REFUSED_EXIT_CODE)
    raise typer.Exit(hold_refusal(settings, role, exc))


def hold_refusal(settings: Settings, role: str, exc: AccessRefused) -> int:
    """`refused` for a refusal met before the role's processor was built (its region check): the health
    server on `settings.health_port` answers `/health/ready` with it until SIGTERM/SIGINT."""
    from tapeline.health import HealthServer, HealthState

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    health = HealthState(role, settings.instance_id)
    server = HealthServer(health, settings.health_host, settings.health_port).start() if settings.health_port else None
    try:
        return refused(exc, health, stop)
    finally:
        if server is not None:
            server.stop()


def run_role(settings: Settings, role: str) -> int:
    """Run one processor role in this process until SIGTERM/SIGINT, as that role's Kafka principal
    (`as_role`). A refusal by Kafka ends its work for good (`refused`)."""
    settings = as_role(settings, role)
    from tapeline.health import HealthServer, HealthState
    from cli.wiring import build_processor

    stop = threading.Event()
    # `kill -USR1 <pid>` writes every thread's Python stack to the process's stderr (the run log): how
    # to see where a processor that answers its health check but does nothing is waiting.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    health = HealthState(role, settings.instance_id)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: (health.mark_draining(), stop.set()))
    server = HealthServer(health, settings.health_host, settings.health_port).start() if settings.health_port else None
    try:
        try:
            processor = build_processor(role, settings, health)
            processor.run(stop)
        except AccessRefused as exc:
            return refused(exc, health, stop)
    finally:
        if server is not None:
            server.stop()
    return 0


ACCESS_REFUSED_EXIT_CODE = 78
"""`run --role R` exits with this (EX_CONFIG, sysexits.h) after Kafka refused its principal,
PostgreSQL its login or TLS, or S3 its credentials or TLS."""


def refused(exc: AccessRefused, health, stop: threading.Event) -> int:
    """Kafka refused this role (a certificate, password or ACL), or PostgreSQL (TLS, login) or S3 did
    (TLS, credentials): log
    it once, answer `/health/ready` 503 with the reason, do nothing more until stopped (no retry
    loop: the same settings are refused again, and a supervisor would restart the process into the
    same refusal), then exit `ACCESS_REFUSED_EXIT_CODE`."""
    log = structlog.get_logger("tapeline.run")
    log.error(f"{exc.service} refused this process; fix its settings and start it again", kind=exc.kind,
              error=str(exc))
    health.mark_refused(str(exc))
    print(f"error: {exc}", file=sys.stderr, flush=True)
    stop.wait()
    return ACCESS_REFUSED_EXIT_CODE


def run(role: str = typer.Option("all", "--role", envvar="TAPELINE_ROLE", help=f"One of {', '.join(ROLE_CHOICES)}"),
        detach: bool = typer.Option(False, "--detach", help="Run in the background (logs in <home>/logs/run.log)"),
        stop: bool = typer.Option(False, "--stop", help="Stop the background processors started with --detach"),
        log_format: str = typer.Option("json", "--log-format", envvar="TAPELINE_LOG_FORMAT", help="json | console")) -> None:
    """Run the processors: one role, or every role as supervised child processes."""
    from cli import supervisor

    settings = load_settings()
    logs.configure(log_format)
    if stop:
        stopped = supervisor.stop_detached(settings)
        console.print("processors stopped" if stopped else "no background processors were running")
        return
    if role not in ROLE_CHOICES:
        fail(ValueError(f"unknown role {role!r}; choose one of {', '.join(ROLE_CHOICES)}"), 2)
    if detach:
        pid = supervisor.detach(settings, role)
        console.print(f"processors running in the background (pid {pid}); logs: {settings.home / 'logs' / 'run.log'}")
        return
    from regions.authority import FENCED_EXIT_CODE, RegionGuard, check_region

    regions = {name: as_role(region, role) for name, region in region_settings().items()}
    settings = as_role(settings, role)
    try:
        reason = check_region(settings.region, regions)  # a fenced region's processors write nothing
    except KafkaAccessRefused as exc:
        exit_refused(settings, role, exc)
    if reason is not None:
        fail(RuntimeError(reason), code=FENCED_EXIT_CODE)
    guard = None
    if os.environ.get(supervisor.SUPERVISED_ENV) != "1":  # a supervisor's children: their supervisor checks
        guard = RegionGuard(settings.region, regions, settings.region_check_interval_s,
                            lambda _reason: os.kill(os.getpid(), signal.SIGTERM)).start()
    try:
        from tapeline.postgres import migrate as run_migrations
        from cli.wiring import rescue_on_exit

        try:
            run_migrations(settings.database_url, settings.db_schema, settings.reader_role)
            check_storage_access(settings, role)
        except AccessRefused as exc:
            exit_refused(settings, role, exc)
        if role == "all":
            code = supervisor.supervise(supervisor.ROLES, grace_s=settings.shutdown_grace_s,
                                        health_port_base=settings.health_port_base,
                                        backoff_s=settings.restart_backoff_s,
                                        workers={stage: settings.workers_of(stage) for stage in STAGE_NAMES},
                                        on_exit=rescue_on_exit(settings))
        else:
            code = run_role(settings, role)
    except TapelineError as exc:
        fail(exc)
    if guard is not None and guard.reason is not None:
        fail(RuntimeError(guard.reason), code=FENCED_EXIT_CODE)
    raise typer.Exit(code)


def serve(host: Optional[str] = typer.Option(None, "--host", envvar="TAPELINE_SERVE_HOST",
                                             help="Address to listen on (default 127.0.0.1)"),
          port: Optional[int] = typer.Option(None, "--port", envvar="TAPELINE_SERVE_PORT",
                                             help="Port (default 8400)"),
          log_format: str = typer.Option("json", "--log-format", envvar="TAPELINE_LOG_FORMAT", help="json | console")) -> None:
    """Serve the read API (/api, OpenAPI at /docs), the web dashboard (/), /health/* and /metrics. Reads through
    the read-only role `tapeline_reader`; actions (replay, resolve, cancel) need TAPELINE_ADMIN_TOKEN."""
    from cli.wiring import serve as run_server

    logs.configure(log_format)
    settings = load_settings()
    try:
        console.print(f"serving on http://{host or settings.serve_host}:{port or settings.serve_port}/ "
                      f"(actions {'enabled' if settings.admin_token else 'disabled: no TAPELINE_ADMIN_TOKEN'})")
        run_server(settings, host, port)
    except TapelineError as exc:
        fail(exc)

"""Where the adapters are built and handed to the parts that use them through ports.

`build_app` composes the web layer (`projections/api.py`, which imports neither the processors nor
the producers) with the operator actions of `processors/operator.py` and the HTTP intake of
`producers/http_intake.py`; `serve` runs it (`tapeline serve`). `build_processor` builds one
processor role with its adapters (the ports of `tapeline/ports.py`: Kafka's `KafkaEventLog`,
PostgreSQL's `PostgresJobStore`, S3's `ObjectStore`, the system clock) for `tapeline run`
(`cli/run_command.py` `run_role`, in each child of the supervisor too), the projector through
`build_projector`; `rescue_on_exit` builds the supervisor's rescuer the same way.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping, Sequence

from typing import TYPE_CHECKING

from domain.pipeline import STAGE_NAMES, spec as pipeline_spec
from tapeline.health import HealthState
from tapeline.settings import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI


class OperatorService:
    """`projections.web_ports.OperatorActions` over `processors/operator.py`, bound to one deployment's
    settings (each call emits its events in its own Kafka transaction, on adapters of its own: the
    web app runs actions concurrently). The CLI's `dlq replay`, `resolve` and `cancel` use it too."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def adapters(self):
        """Fresh adapters for one action (`processors.operator.ActionAdapters`): the Kafka event log
        (offsets client of group `<app>.operator.lso`), a PostgreSQL job store, an S3 bucket built
        on demand, the system clock."""
        from processors.operator import ActionAdapters
        from tapeline.clock import system_clock
        from tapeline.kafka import KafkaEventLog
        from tapeline.objectstore import ObjectStore
        from tapeline.postgres import PostgresJobStore

        return ActionAdapters(events=KafkaEventLog(self.settings, f"{self.settings.app_name}.operator.lso"),
                              jobs=PostgresJobStore(self.settings), storage=lambda: ObjectStore(self.settings),
                              clock=system_clock)

    def replay_dead_letters(self, ids: Sequence[str], operator: str, reason: str) -> list:
        """`processors.operator.replay_dead_letters`."""
        from processors.operator import replay_dead_letters

        return replay_dead_letters(self.settings, list(ids), operator, reason, adapters=self.adapters())

    def fail_dead_letters(self, ids: Sequence[str], operator: str, reason: str, refund: bool) -> list:
        """`processors.operator.fail_dead_letters`."""
        from processors.operator import fail_dead_letters

        return fail_dead_letters(self.settings, list(ids), operator, reason, refund, adapters=self.adapters())

    def dismiss_dead_letters(self, ids: Sequence[str], operator: str, reason: str) -> list:
        """`processors.operator.dismiss_dead_letters`."""
        from processors.operator import dismiss_dead_letters

        return dismiss_dead_letters(self.settings, list(ids), operator, reason, adapters=self.adapters())

    def cancel_job(self, job_id: str, operator: str, reason: str) -> str:
        """`processors.operator.cancel_job`."""
        from processors.operator import cancel_job

        return cancel_job(self.settings, job_id, operator, reason, adapters=self.adapters())

    def resolve_review(self, job_id: str, operator: str, reason: str, posted_ref: str | None) -> str:
        """`processors.operator.resolve_review` (provider `webhook`)."""
        from processors.operator import resolve_review

        return resolve_review(self.settings, job_id, operator, reason, posted_ref, adapters=self.adapters())


class WebhookService:
    """`projections.web_ports.WebhookEndpoints` over `tapeline/webhook_endpoints.py`, one PostgreSQL session per
    call as the login role (the read API's role cannot write)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def _call(self, fn, *args, **kwargs):
        from tapeline.postgres import PostgresJobStore

        store = PostgresJobStore(self.settings)
        try:
            return fn(store, *args, **kwargs)
        finally:
            store.close()

    def register(self, submitter: str, url: str, event_types: Sequence[str], secret: str | None) -> dict:
        from tapeline import webhook_endpoints as webhooks

        return self._call(webhooks.register, self.settings, submitter, url, list(event_types), secret=secret)

    def endpoints(self, submitter: str | None) -> list[dict]:
        from tapeline import webhook_endpoints as webhooks

        return self._call(webhooks.endpoints, submitter)

    def set_enabled(self, endpoint_id: str, enabled: bool, reason: str | None) -> bool:
        from tapeline import webhook_endpoints as webhooks

        return self._call(webhooks.set_enabled, endpoint_id, enabled, reason)

    def remove(self, endpoint_id: str) -> bool:
        from tapeline import webhook_endpoints as webhooks

        return self._call(webhooks.remove, endpoint_id)


class HttpIntake:
    """`projections.web_ports.Intake` over `producers/http_intake.py`: `POST /uploads` writes as the
    login role (it writes `intake_uploads`), not as the read API's read-only role. While another
    region holds the job history it refuses every upload (`regions/authority.py` `IntakeFence` over
    `regions`, every region's settings: `region_pair(settings)` by default)."""

    def __init__(self, settings: Settings, regions: dict[str, Settings] | None = None) -> None:
        from producers.http_intake import IntakeService, intake_router
        from regions.authority import IntakeFence

        fence = IntakeFence(settings.region, regions or region_pair(settings))
        self.service = IntakeService(settings, fence=fence.refusal)
        self.router = intake_router(self.service)

    def fenced(self) -> dict | None:
        refusal = self.service.fenced()
        return refusal.body() if refusal is not None else None

    def open(self) -> None:
        self.service.open()

    def close(self) -> None:
        self.service.close()


def region_pair(settings: Settings) -> dict[str, Settings]:
    """`{"a": ..., "b": ...}`: `settings` and the other region's. Region A's settings derive region B's
    (`Settings.for_region`); region B's cannot derive region A's, so those come from the environment
    (`cli/helpers.py` `region_settings`, which always describes region A). When region B cannot be
    derived (a key=value `database_url` without `region_b_database_url`), `{settings.region: settings}`
    alone: its own region's epochs are still read."""
    try:
        if settings.region == "a":
            return {"a": settings, "b": settings.for_region("b")}
        from cli.helpers import region_settings

        return {**region_settings(), settings.region: settings}
    except ValueError as exc:
        import structlog

        structlog.get_logger("tapeline.region").warning(
            "the other region's settings cannot be derived; reading this region's epochs only", error=str(exc))
        return {settings.region: settings}


def build_app(settings: Settings) -> FastAPI:
    """The whole `tapeline serve` app for `settings`: read API, dashboard, actions and intake."""
    from projections.api import create_app

    return create_app(settings, actions=OperatorService(settings), intake=HttpIntake(settings),
                      webhooks=WebhookService(settings), storage_bytes=storage_meter(settings))


def storage_meter(settings: Settings):
    """The bucket's bytes for the dashboard's strip, or None when no `storage_limit_bytes` is set:
    `StorageGauge.bytes` over an `ObjectStore` of its own that gives up after one try of at most 3 s
    per call, a measurement and a failure each reused for `storage_usage_cache_s`, so an S3 endpoint
    that does not answer costs one page one short wait, not every page the client's full retries."""
    if settings.storage_limit_bytes is None:
        return None
    import time

    from tapeline.objects import StorageGauge
    from tapeline.objectstore import ObjectStore, one_quick_try

    quick = one_quick_try(settings)
    gauge = StorageGauge(quick, ObjectStore(quick))
    failed: list[tuple[float, Exception]] = []

    def measure() -> int:
        if failed and time.monotonic() - failed[-1][0] < settings.storage_usage_cache_s:
            raise failed[-1][1]
        try:
            value = gauge.bytes()
        except Exception as exc:  # StorageError; kept to answer at once until the cache age passes
            failed[:] = [(time.monotonic(), exc)]
            raise
        failed.clear()
        return value

    return measure


def serve(settings: Settings, host: str | None = None, port: int | None = None, log_level: str = "info") -> None:
    """Run `build_app` with uvicorn until SIGINT/SIGTERM (`tapeline serve`). Checks the read-only
    role first so a missing grant is one clear error, not a traceback per request."""
    import uvicorn

    from projections.api import check_reader

    check_reader(settings)
    if host:  # the address it binds decides which Host headers it answers (projections/edge.py allowed_hosts)
        settings = settings.model_copy(update={"serve_host": host})
    uvicorn.run(build_app(settings), host=host or settings.serve_host, port=port or settings.serve_port,
                log_level=log_level, access_log=False)


WORKER_ROLES = STAGE_NAMES
PROCESSOR_ROLES = ("projector", "intake", *STAGE_NAMES, "watchdog", "notify")
STORAGE_ROLES = ("intake", *STAGE_NAMES, "watchdog")
"""The roles that read or write the bucket (intake probes uploads, the stages read and write media,
the watchdog cleans up); `tapeline run` checks their S3 credentials before it starts them."""


def processor_adapters(settings: Settings, role: str, health: HealthState) -> dict:
    """The adapters a processor of `role` runs on, as keyword arguments: `events` (Kafka, its offsets
    client in group `<app>.<role>.lso`), `jobs` (a PostgreSQL job store), `storage` (the S3 bucket),
    `clock` (the system clock) and `health`. Nothing connects yet."""
    from tapeline.clock import system_clock
    from tapeline.kafka import KafkaEventLog
    from tapeline.objectstore import ObjectStore
    from tapeline.postgres import PostgresJobStore

    return dict(events=KafkaEventLog(settings, f"{settings.app_name}.{role}.lso"), jobs=PostgresJobStore(settings),
                storage=ObjectStore(settings), clock=system_clock, health=health)


def build_runtime(settings: Settings, role: str, **kwargs):
    """A `processors.runtime.Runtime` for `role` over fresh Kafka and PostgreSQL adapters (offsets
    client in group `<app>.<role>.lso`), for tests and benches that produce events themselves;
    `kwargs` go to `Runtime` (`health`, `stop`). Opens the job store's session now."""
    from processors.runtime import Runtime
    from tapeline.kafka import KafkaEventLog
    from tapeline.postgres import PostgresJobStore

    return Runtime(settings, role, events=KafkaEventLog(settings, f"{settings.app_name}.{role}.lso"),
                   jobs=PostgresJobStore(settings), **kwargs)


def build_processor(role: str, settings: Settings, health: HealthState):
    """The processor of `role` (one of `PROCESSOR_ROLES`) with its adapters built here
    (`processor_adapters`; the watchdog's leader lock gets a job store of its own, intake and
    transcode the ffprobe/ffmpeg tool), reporting to `health` (a processor that does not report
    readiness itself is marked ready at once). Raises `KeyError` for an unknown role."""
    if role == "watchdog":
        from processors.watchdog import Watchdog
        from tapeline.postgres import PostgresJobStore

        return Watchdog(settings, leader=PostgresJobStore(settings, leader=True),
                        **processor_adapters(settings, role, health))
    if role == "notify":
        from processors.notify import Notifier
        from tapeline.postgres import PostgresJobStore

        return Notifier(settings, leader=PostgresJobStore(settings, leader=True), new_store=lambda: PostgresJobStore(settings),
                        **processor_adapters(settings, role, health))
    if role == "intake":
        from processors.intake import IntakeProcessor
        from processors.media import FfmpegTool

        return IntakeProcessor(settings, media=FfmpegTool(), **processor_adapters(settings, role, health))
    if role in STAGE_NAMES:  # a stage of the registry (domain/pipeline.py): its worker class, by name
        declared = pipeline_spec(role)
        module, _, name = declared.worker.partition(":")
        worker = getattr(importlib.import_module(module), name)
        if declared.uses_media_tool:
            from processors.media import FfmpegTool

            return worker(settings, media=FfmpegTool(), **processor_adapters(settings, role, health))
        return worker(settings, **processor_adapters(settings, role, health))
    processor = {"projector": build_projector}[role](settings)
    processor.health = health
    return processor


def build_projector(settings: Settings, projection: str = "main", batch_size: int = 1000,
                    lag_interval_s: float = 5.0):
    """The projector (`projections/projector.py`) over the Kafka event log (its offsets and metadata
    client in group `<app>.projector.lso`), measuring projection lag every `lag_interval_s` seconds
    with a `tapeline.lag.LagObserver` (its own thread, consumer and connection; 0 turns it off). The
    projector's PostgreSQL session (its batches' transactions, its standby lock) is its own."""
    from projections.projector import Projector
    from tapeline.kafka import KafkaEventLog
    from tapeline.lag import LagObserver

    def observe_lag(health: HealthState) -> LagObserver:
        return LagObserver(settings, health, projection, lag_interval_s).start()

    return Projector(settings, events=KafkaEventLog(settings, f"{settings.app_name}.projector.lso"),
                     projection=projection, batch_size=batch_size,
                     observe_lag=observe_lag if lag_interval_s > 0 else None)


def rescue_on_exit(settings: Settings):
    """The supervisor's `on_exit` callback (`cli/supervisor.py`): when a worker child dies,
    retry at once the attempt it held (`tapeline/holdings.py`, `processors/rescue.py`). A rescue that
    cannot be made now is logged and left to the attempt's lease."""
    import structlog

    from domain.errors import Fenced, ServiceUnavailable
    from processors.rescue import Rescuer, exit_detail
    from tapeline import holdings
    from tapeline.clock import system_clock
    from tapeline.kafka import KafkaEventLog, KafkaException  # the client's error, named by its adapter
    from tapeline.ports import EventLogError
    from tapeline.postgres import PostgresJobStore

    log = structlog.get_logger("tapeline.supervisor")
    rescuer = Rescuer(settings, "supervisor", clock=system_clock, jobs=PostgresJobStore(settings),
                      events=KafkaEventLog(settings, f"{settings.app_name}.supervisor.lso"))

    def on_exit(name: str, role: str, pid: int, returncode: int) -> None:
        if role not in WORKER_ROLES:
            return
        holding = holdings.read(settings, name, pid)
        if holding is None:
            return  # it held no attempt
        try:
            rescuer.rescue(holding, exit_detail(returncode))
        except (ServiceUnavailable, EventLogError, KafkaException, Fenced) as exc:
            log.warning("could not rescue the dead worker's attempt; its lease will", child=name, pid=pid,
                        job_id=holding.job_id, error=str(exc))
            return
        holdings.release(settings, name, pid)

    return on_exit


class RegionProcesses:
    """The roof's side of region operations (`regions/processes.py` `Processes`): this module's
    projector and runtime, and the supervisor's background `run --role all`."""

    def build_projector(self, settings: Settings) -> Any:
        return build_projector(settings, lag_interval_s=0)

    def build_runtime(self, settings: Settings, name: str) -> Any:
        return build_runtime(settings, name)

    def running_pid(self, settings: Settings) -> int | None:
        from cli import supervisor

        return supervisor.running_pid(settings)

    def start_all(self, settings: Settings, env: Mapping[str, str]) -> int:
        from cli import supervisor

        return supervisor.detach(settings, "all", env=dict(env))

    def stop_all(self, settings: Settings) -> bool:
        from cli import supervisor

        return supervisor.stop_detached(settings)

    def health_port(self, settings: Settings, role: str) -> int:
        from cli.supervisor import ROLES

        return settings.health_port_base + ROLES.index(role)

"""Where the adapters are built and handed to the parts that use them through ports.

`build_app` composes the web layer (`projections/api.py`, which imports neither the processors nor
the producers) with the operator actions of `processors/operator.py` and the HTTP intake of
`producers/http_intake.py`; `serve` runs it (`tapeline serve`).
"""

from __future__ import annotations

from typing import Sequence

from fastapi import FastAPI

from tapeline.settings import Settings


class OperatorService:
    """`projections.ports.OperatorActions` over `processors/operator.py`, bound to one deployment's
    settings (each call emits its events in its own Kafka transaction)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def replay_dead_letters(self, ids: Sequence[str], operator: str, reason: str) -> list:
        from processors.operator import replay_dead_letters

        return replay_dead_letters(self.settings, list(ids), operator, reason)

    def cancel_job(self, job_id: str, operator: str, reason: str) -> str:
        from processors.operator import cancel_job

        return cancel_job(self.settings, job_id, operator, reason)

    def resolve_review(self, job_id: str, operator: str, reason: str, posted_ref: str | None) -> str:
        from processors.operator import resolve_review

        return resolve_review(self.settings, job_id, operator, reason, posted_ref)


class HttpIntake:
    """`projections.ports.Intake` over `producers/http_intake.py`: `POST /uploads` writes as the
    login role (it writes `intake_uploads`), not as the read API's read-only role."""

    def __init__(self, settings: Settings) -> None:
        from producers.http_intake import IntakeService, intake_router

        self.service = IntakeService(settings)
        self.router = intake_router(self.service)

    def open(self) -> None:
        self.service.open()

    def close(self) -> None:
        self.service.close()


def build_app(settings: Settings) -> FastAPI:
    """The whole `tapeline serve` app for `settings`: read API, dashboard, actions and intake."""
    from projections.api import create_app

    return create_app(settings, actions=OperatorService(settings), intake=HttpIntake(settings))


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


WORKER_ROLES = ("transcode", "publish")


def rescue_on_exit(settings: Settings):
    """The supervisor's `on_exit` callback (`tapeline/supervisor.py`): when a worker child dies,
    retry at once the attempt it held (`tapeline/holdings.py`, `processors/rescue.py`). A rescue that
    cannot be made now is logged and left to the attempt's lease."""
    import structlog
    from confluent_kafka import KafkaException

    from domain.errors import Fenced, ServiceUnavailable
    from processors.rescue import Rescuer, exit_detail
    from tapeline import holdings

    log = structlog.get_logger("tapeline.supervisor")
    rescuer = Rescuer(settings, "supervisor")

    def on_exit(name: str, role: str, pid: int, returncode: int) -> None:
        if role not in WORKER_ROLES:
            return
        holding = holdings.read(settings, name, pid)
        if holding is None:
            return  # it held no attempt
        try:
            rescuer.rescue(holding, exit_detail(returncode))
        except (ServiceUnavailable, KafkaException, Fenced) as exc:
            log.warning("could not rescue the dead worker's attempt; its lease will", child=name, pid=pid,
                        job_id=holding.job_id, error=str(exc))
            return
        holdings.release(settings, name, pid)

    return on_exit

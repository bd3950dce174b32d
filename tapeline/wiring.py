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
    uvicorn.run(build_app(settings), host=host or settings.serve_host, port=port or settings.serve_port,
                log_level=log_level, access_log=False)

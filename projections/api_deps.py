"""What the routers of the read API share (`projections/api.py` builds it per app): the `Web`
context and the FastAPI dependencies over it: a read-only connection (`db`), the admin token
(`require_admin`), a job or 404 (`job_or_404`) and a dashboard page with its flash message (`page`).

A route reaches its app's context through the request (`request.app.state.web`), so one router
module serves every app `create_app` builds.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import psycopg
from fastapi import HTTPException, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from psycopg_pool import ConnectionPool, PoolTimeout

from domain.errors import ServiceUnavailable
from projections.edge import FlashSigner
from projections.web_ports import OperatorActions, WebhookEndpoints
from projections.problems import Sources, problems_now
from projections.region_panel import RegionPanelSource
from projections import read_model as read
from tapeline.settings import Settings

if TYPE_CHECKING:
    from projections.api import ApiMetrics, LagCache


@dataclass
class Web:
    """One app's context: its settings, projection lag cache, metrics, flash signer, templates,
    operator actions (None: every action answers 503), the problems strip's `sources` and the Region
    replication panel's `region` (None: no panel); `pool`, the read-only connection pool, is set
    when the app starts (`create_app`'s lifespan)."""

    settings: Settings
    lag: "LagCache"
    metrics: "ApiMetrics"
    flasher: FlashSigner
    templates: Jinja2Templates
    actions: OperatorActions | None = None
    webhooks: WebhookEndpoints | None = None
    sources: Sources = field(default_factory=Sources)
    region: RegionPanelSource | None = None
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def pool(self) -> ConnectionPool:
        """The read-only pool; KeyError before the app started."""
        return self.state["pool"]


def web(request: Request) -> Web:
    """The `Web` of the app serving `request` (a FastAPI dependency)."""
    return request.app.state.web


def db(request: Request) -> Iterator[psycopg.Connection]:
    """A read-only connection from the app's pool for one request (a FastAPI dependency). Raises
    `ServiceUnavailable` (503) when none is free within the pool's timeout (10 s)."""
    try:
        with web(request).pool.connection() as conn:
            yield conn
    except PoolTimeout as exc:
        raise ServiceUnavailable(f"no database connection within 10 s: {exc}") from exc


def token_ok(settings: Settings, presented: str | None) -> bool:
    """True when the server has an admin token and `presented` is it (compared in constant time)."""
    expected = settings.admin_token.get_secret_value() if settings.admin_token else ""
    return bool(expected) and presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


def bearer(request: Request) -> str | None:
    """The token of the request's `Authorization: Bearer <token>` header, None without one. Pure."""
    scheme, _, presented = request.headers.get("authorization", "").partition(" ")
    return presented.strip() if scheme.lower() == "bearer" else None


def refusal_reason(settings: Settings, presented: str | None) -> str:
    """Why a dashboard page or form refuses the admin token `presented` (None: none was sent)."""
    if not settings.admin_token:
        return "actions are disabled: the server has no TAPELINE_ADMIN_TOKEN"
    return "this page needs the admin token" if presented is None else "wrong admin token"


HTTP_METHODS = frozenset("GET HEAD POST PUT PATCH DELETE OPTIONS TRACE CONNECT".split())  # one string: no SQL-like literal
"""The methods a metric label shows as sent (RFC 9110 and PATCH); any other token is "other"."""


def route_label(scope: Any) -> str:
    """The metric label of a request's route: the template of the route that matched (FastAPI sets
    `scope["route"]`: `/api/jobs/{job_id}`), "unmatched" when none did. Never the request path, so a
    client cannot add series by varying it (issue 44 item 2). Pure."""
    return getattr(scope.get("route"), "path", None) or "unmatched"


def method_label(method: str) -> str:
    """The metric label of an HTTP method: one of `HTTP_METHODS`, else "other" (uvicorn's h11 takes
    any token as a method). Pure."""
    return method if method in HTTP_METHODS else "other"


def action_label(scope: Any) -> str:
    """The `action` label of an admin route's request: the last literal segment of the matched
    route's template, `-` as `_` (`/api/jobs/{job_id}/resolve-review`: "resolve_review",
    `/api/webhooks/{endpoint_id}`: "webhooks"); "unmatched" without a route. Never a piece of the
    request path (issue 44 item 2: a 10 KB endpoint id became a label). Pure."""
    literal = [part for part in route_label(scope).split("/") if part and not part.startswith("{")]
    return literal[-1].replace("-", "_") if literal else "unmatched"


def require_admin(request: Request) -> None:
    """The dependency of every JSON action: `Authorization: Bearer <TAPELINE_ADMIN_TOKEN>`. Raises
    HTTPException 401 (with `WWW-Authenticate: Bearer`) and counts the refusal otherwise, labelled
    by the route (`action_label`; `request.scope["route"]` must be the matched route). The edge
    (`create_app`'s `admin_refusal`) calls it too, before the body is read."""
    context = web(request)
    if not token_ok(context.settings, bearer(request)):
        reason = ("actions are disabled: the server has no TAPELINE_ADMIN_TOKEN" if not context.settings.admin_token
                  else "missing or wrong admin token (Authorization: Bearer <TAPELINE_ADMIN_TOKEN>)")
        context.metrics.actions.labels(action=action_label(request.scope), result="unauthorized").inc()
        raise HTTPException(401, reason, headers={"WWW-Authenticate": "Bearer"})


def job_or_404(conn: psycopg.Connection, job_id: str) -> dict[str, Any]:
    """The job's row (`read.job_row`); raises HTTPException 404 when the projections have no such job."""
    row = read.job_row(conn, job_id)
    if row is None:
        raise HTTPException(404, f"no job {job_id!r} in the projections (not submitted, or intake not caught up)")
    return row


def client_of(request: Request) -> str:
    """The client's address for the log, "unknown" when the server does not know it."""
    return request.client.host if request.client else "unknown"


def page(request: Request, template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    """A dashboard page: `template` rendered with `context` and the flash message or error of the
    query string, shown only when this server signed it (`FlashSigner`)."""
    app = web(request)
    flash = app.flasher.shown(request.query_params)  # only outcomes this server signed (FlashSigner)
    return app.templates.TemplateResponse(request, template, {"message": flash["msg"], "error": flash["err"],
                                                              "problems": problems_now(lambda: app.pool, app.settings, app.sources),
                                                              **context}, status_code=status_code)

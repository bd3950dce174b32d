"""The read API and web dashboard of `tapeline serve` (issue 8).

One FastAPI app (`create_app`) serves:

- a JSON read API under `/api/...` over the projections (its OpenAPI document at `/openapi.json`,
  interactive at `/docs`): jobs (filtered, paged), one job with its attempts, stage durations,
  checkpoints, timeline and progress, stalls, dead letters, jobs needing review, projection lag and
  an overview;
- the dashboard: server-rendered pages (Jinja2, autoescaped) that `static/dashboard.js` refreshes
  every few seconds from the JSON API (no build step, no CDN);
- operator actions (replay a dead letter, resolve a review, cancel a job) as JSON endpoints with a
  bearer token and as dashboard forms with a token field. They call the `OperatorActions` port
  (`projections/web_ports.py`; `cli/wiring.py` binds it to the CLI's runners in
  `processors/operator.py`): they emit events and never write a projection;
- `/health/live`, `/health/ready` and `/metrics` (prometheus-client, this process's own registry);
- the HTTP intake `POST /uploads` (the `Intake` port, `producers/http_intake.py`: streamed uploads with API tokens,
  idempotency keys and backpressure); it writes its own table `intake_uploads` as the login role,
  never a projection.

This module builds the app (`create_app`: the pool's lifecycle, the middleware and edge, health and
metrics, the Swagger page) and includes the routes from `api_reads.py` (the JSON reads),
`api_actions.py` (the actions and the dashboard's forms) and `api_pages.py` (the dashboard's pages);
`api_models.py` holds the JSON shapes and models, `api_deps.py` the dependencies they share.

Every read goes through a `psycopg_pool` connection that has switched to the read-only role
(`SET ROLE tapeline_reader`, `Settings.reader_role`) when it was opened, so the API cannot write a
projection even by mistake. Times are broker time (LogAppendTime, UTC, ISO 8601) unless a field
says otherwise; durations are seconds.
"""

from __future__ import annotations

from domain.pipeline import INTAKE, STAGE_NAMES

import threading
import time
from pathlib import Path
from typing import Any, Callable

import psycopg
import structlog
import fastapi_offline
from fastapi import FastAPI, HTTPException, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.routing import APIRoute
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.routing import Match
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from psycopg_pool import ConnectionPool, PoolTimeout

from projections import api_actions, api_pages, api_reads, api_webhooks
from projections.api_deps import Web, method_label, require_admin, route_label
from projections.api_models import answers
from projections.edge import CONTENT_SECURITY_POLICY, Answer, EdgeGuard, FlashSigner, allowed_hosts, script_hashes
from projections.edge import not_json, problem as edge_problem
from projections.glossary import STALL_KINDS, glossary
from projections.web_ports import Intake, OperatorActions, WebhookEndpoints
from projections import read_model as read
from projections.provider_status import provider_overview
from projections.problems import Sources, problems_router
from projections.region_panel import RegionPanelSource
from tapeline.postgres import session_options, connect, q, qf
from domain.errors import ConfigurationError, ServiceUnavailable, TapelineError
from domain.lifecycle import TERMINAL_STATES
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.api")
HERE = Path(__file__).resolve().parent
ROUTERS = (api_reads.router, api_actions.router, api_webhooks.router, api_pages.router)
"""The routers `create_app` includes, in this order: the JSON reads (`api_reads.py`), the operator
actions and their dashboard forms (`api_actions.py`), the dashboard's pages (`api_pages.py`)."""


# ---------------------------------------------------------------------------------------------
# The read-only connection pool


def _as_reader(role: str):
    def configure(conn: psycopg.Connection) -> None:
        conn.execute(qf("set_role", role=role))
    return configure


def check_reader(settings: Settings) -> None:
    """Connect once as the API will and switch to the read-only role. Raises `ConfigurationError`
    saying how to grant the role when the login user may not `SET ROLE` to it, and
    `ServiceUnavailable` when PostgreSQL does not answer."""
    with connect(settings.database_url, schema=settings.db_schema, autocommit=True) as conn:
        try:
            _as_reader(settings.reader_role)(conn)
            conn.execute(q("reader_can_read"))
        except psycopg.errors.InsufficientPrivilege as exc:
            user = conn.info.user
            raise ConfigurationError(
                f"the read API reads as role {settings.reader_role!r}, but {user!r} may not use it ({exc}). "
                f"As a PostgreSQL superuser run `GRANT {settings.reader_role} TO {user}` (`tapeline stack up` "
                f"does this for the local stack), then `tapeline migrate` so the role may read the projections"
            ) from exc
        except psycopg.errors.UndefinedTable as exc:
            raise ConfigurationError(f"no projections in schema {settings.db_schema!r}: run `tapeline migrate` "
                                     f"(or start the processors) first") from exc
        except psycopg.errors.InvalidParameterValue as exc:  # SET ROLE to a role that does not exist
            raise ConfigurationError(f"role {settings.reader_role!r} does not exist: create it with "
                                     f"`CREATE ROLE {settings.reader_role} NOLOGIN` and run `tapeline migrate`") from exc


def reader_pool(settings: Settings, max_size: int = 4) -> ConnectionPool:
    """A pool of autocommit connections in the projections' schema, each switched to the read-only
    role when opened (`SET ROLE`), rows as dicts. Not opened yet: call `.open()`."""
    return ConnectionPool(settings.database_url, min_size=1, max_size=max_size, open=False, timeout=10.0,
                          configure=_as_reader(settings.reader_role), name="tapeline-reader",
                          kwargs={"autocommit": True, "row_factory": psycopg.rows.dict_row, "connect_timeout": 10,
                                  "options": session_options(settings.db_schema)})


class LagCache:
    """Projection lag measured with one reusable read_committed consumer, reused for `max_age_s`
    seconds so a dashboard refreshing every few seconds does not scan the log on every request."""

    def __init__(self, settings: Settings, max_age_s: float) -> None:
        self.settings, self.max_age_s = settings, max_age_s
        self._lock = threading.Lock()
        self._consumer = None
        self._value: dict[str, Any] | None = None
        self._failed: ServiceUnavailable | None = None
        self._at = -float("inf")

    def get(self, conn: psycopg.Connection, timeout_s: float = 10.0) -> dict[str, Any]:
        """`LagReport.as_dict()`; raises `ServiceUnavailable` when Kafka does not answer within
        `timeout_s`, and at once, for `max_age_s`, after it did not (so the problems strip, which
        asks on every page, does not hold every page while Kafka is down)."""
        from tapeline.lag import lag_reader, measure

        with self._lock:
            if time.monotonic() - self._at < self.max_age_s:
                if self._failed is not None:
                    raise self._failed
                if self._value is not None:
                    return self._value
            if self._consumer is None:
                self._consumer = lag_reader(self.settings)
            try:
                report = measure(self.settings, conn, self._consumer, timeout_s=timeout_s)
            except ServiceUnavailable as exc:  # its message names Kafka's address (tapeline/lag.py measure)
                self._failed, self._at = exc, time.monotonic()
                raise
            self._value, self._failed, self._at = report.as_dict(), None, time.monotonic()
            return self._value

    def close(self) -> None:
        with self._lock:
            if self._consumer is not None:
                self._consumer.close()
                self._consumer = None

# ---------------------------------------------------------------------------------------------
# The app


class ApiMetrics:
    """The API process's own registry: requests and actions, plus gauges read from the projections
    when scraped (jobs by state and stage, stalls by kind, dead letters pending) and the projection lag
    (`LagCache`, so a scrape reuses a recent measurement)."""

    def __init__(self, pool_getter, lag: "LagCache | None" = None, providers=None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._providers = providers  # conn -> provider_overview rows (the breaker gauge), or None
        self.requests = Counter("tapeline_api_requests", "HTTP requests served", ["route", "method", "status"],
                                registry=self.registry)
        self.latency = Histogram("tapeline_api_request_duration_seconds", "HTTP request duration, seconds",
                                 ["route"], registry=self.registry)
        self.actions = Counter("tapeline_operator_actions", "Operator actions requested through the API",
                               ["action", "result"], registry=self.registry)
        self._pool_getter = pool_getter
        self._lag = lag
        self.registry.register(self)

    def describe(self):  # the projection gauges are read at scrape time only
        return []

    def collect(self):
        jobs = GaugeMetricFamily("tapeline_jobs", "Jobs by state and current stage (projection)",
                                 labels=["state", "stage"])
        stalls = GaugeMetricFamily("tapeline_stalls", "Stalled attempts, handoffs, missing work, waiting "
                                   "retries and jobs in needs_review, by kind (projection)", labels=["kind"])
        letters = GaugeMetricFamily("tapeline_dead_letters_pending", "Dead letters neither replayed nor dismissed (projection)")
        suspect = GaugeMetricFamily("tapeline_attempts_suspect", "Running attempts not stalled yet whose progress "
                                    "counters (suspect_of=no_progress) or heartbeats (lease) have been still for more "
                                    "than TAPELINE_SUSPECT_FRACTION of their allowance (projection)",
                                    labels=["suspect_of"])
        breakers = GaugeMetricFamily("tapeline_provider_breaker_open", "1 while a publish provider's circuit breaker "
                                     "is open or half-open, 0 when closed (projection)", labels=["provider", "state"])
        try:
            with self._pool_getter().connection(timeout=5.0) as conn:
                for row in read.jobs_by_state_and_stage(conn):
                    jobs.add_metric([row["state"], row["stage"]], row["n"])
                kinds: dict[str, int] = {}
                for stall in read.stalls(conn):
                    kinds[stall["kind"]] = kinds.get(stall["kind"], 0) + 1
                for kind in (*STALL_KINDS, "needs_review"):
                    stalls.add_metric([kind], kinds.get(kind, 0))
                letters.add_metric([], read.dead_letter_counts(conn)["pending"])
                suspects = [s["suspect_of"] for s in read.suspect_attempts(conn)]
                for kind in ("no_progress", "lease"):
                    suspect.add_metric([kind], suspects.count(kind))
                for provider in (self._providers(conn) if self._providers is not None else []):
                    breakers.add_metric([provider["provider"], provider["state"]],
                                        0.0 if provider["state"] == "closed" else 1.0)
                lag = None
                try:
                    lag = self._lag.get(conn) if self._lag is not None else None
                except ServiceUnavailable as exc:  # Kafka down: the other gauges still answer
                    log.warning("metrics: projection lag unmeasurable", error=str(exc))
        except (psycopg.Error, PoolTimeout, TapelineError) as exc:
            log.warning("metrics: projections unreadable", error=str(exc))
            return
        yield jobs
        yield stalls
        yield letters
        yield suspect
        yield breakers
        if lag is not None:
            yield GaugeMetricFamily("tapeline_api_projection_lag_events", "Committed events the projection has not "
                                    "applied, all partitions (measured by the API)", value=lag["events"])
            yield GaugeMetricFamily("tapeline_api_projection_lag_seconds", "Age of the oldest event the projection "
                                    "has not applied, seconds (0 when caught up)", value=lag["seconds"])


def create_app(settings: Settings, *, actions: OperatorActions | None = None, intake: Intake | None = None,
               webhooks: WebhookEndpoints | None = None, storage_bytes: Callable[[], int] | None = None) -> FastAPI:
    """The app for `settings`. The pool opens on startup (after `check_reader`) and closes on shutdown.

    `actions` carries out operator actions (without it every action answers 503); `webhooks` registers
    customer webhook endpoints (`/api/webhooks`; without it they answer 503); `storage_bytes` measures
    the bucket for the problems strip (None: storage is not shown there); `intake` adds
    `POST /uploads`. `cli.wiring.build_app` passes both. The routes are in `ROUTERS`; they
    reach this app's pool, settings and actions through `app.state.web` (`api_deps.Web`).
    """
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        check_reader(settings)
        pool = reader_pool(settings)
        pool.open(wait=True, timeout=15.0)
        context.state["pool"] = app.state.pool = pool
        if intake is not None:
            intake.open()
        try:
            yield
        finally:
            lag.close()
            pool.close()
            if intake is not None:
                intake.close()

    app = FastAPI(title="Tapeline", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Read API over Tapeline's projections (broker time, UTC; seconds) and operator "
                              "actions that emit events. Actions need `Authorization: Bearer <TAPELINE_ADMIN_TOKEN>`.")
    # The edge (projections/edge.py): inside the request counter below, so its refusals are counted too.
    app.add_middleware(EdgeGuard, refuse=lambda scope: admin_refusal(scope), body_limit=lambda scope: body_limit(scope))
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(settings))
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.globals["glossary"] = glossary()  # hover explanations (dashboard.js explainTerms)
    templates.env.globals["stages"] = (INTAKE, *STAGE_NAMES)  # the jobs filter: every registered stage
    templates.env.globals["terminal_states"] = TERMINAL_STATES  # the lifecycle's final and reopenable states
    app.mount("/static/docs", StaticFiles(directory=str(Path(fastapi_offline.__file__).parent / "static")),
              name="docs-assets")
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    lag = LagCache(settings, settings.lag_cache_s)
    metrics = ApiMetrics(lambda: context.pool, lag, providers=lambda conn: provider_overview(conn, settings))
    context = Web(settings=settings, lag=lag, metrics=metrics, flasher=FlashSigner.for_settings(settings),
                  templates=templates, actions=actions, webhooks=webhooks,
                  sources=Sources(lag=lambda conn: lag.get(conn, timeout_s=3.0), storage_bytes=storage_bytes),
                  region=RegionPanelSource.for_settings(settings))
    app.state.settings, app.state.metrics, app.state.web = settings, metrics, context
    if intake is not None:
        app.include_router(intake.router)  # POST /uploads: writes as the login role
    app.include_router(problems_router(lambda: context.pool, settings, context.sources))  # GET /api/problems

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        """Count every response, refusals and server errors included; refuse a NUL byte in the path
        or a query value with 400 before it reaches a handler (PostgreSQL text cannot hold one)."""
        started = time.perf_counter()
        if "\x00" in request.url.path or any("\x00" in k or "\x00" in v for k, v in request.query_params.multi_items()):
            response = JSONResponse({"detail": "a NUL byte (%00) is not allowed in a path or query"}, status_code=400)
        else:
            try:
                response = await call_next(request)
            except Exception:
                metrics.requests.labels(route=route_label(request.scope), method=method_label(request.method),
                                        status="500").inc()
                raise
        route = route_label(request.scope)  # labels: the route's template and fixed sets, never input
        metrics.requests.labels(route=route, method=method_label(request.method),
                                status=str(response.status_code)).inc()
        metrics.latency.labels(route=route).observe(time.perf_counter() - started)
        return response

    @app.exception_handler(ServiceUnavailable)
    async def unavailable(request: Request, exc: ServiceUnavailable):
        return JSONResponse({"detail": str(exc)}, status_code=503)

    @app.exception_handler(psycopg.OperationalError)
    async def db_down(request: Request, exc: psycopg.OperationalError):
        return JSONResponse({"detail": f"PostgreSQL failed: {exc}"}, status_code=503)

    # -- health and metrics ---------------------------------------------------------------------

    @app.get("/health/live", tags=["health"])
    def live() -> dict[str, str]:
        """200 while the process runs."""
        return {"status": "live"}

    @app.get("/health/ready", tags=["health"], responses=answers(503))
    def ready() -> JSONResponse:
        """200 when a read-only connection answers, else 503 with the reason; 503 `{"status":
        "fenced", reason, active_region, upload_to, ...}` while this region's intake refuses uploads
        because another region holds the job history (docs/regions.md), so a load balancer in front of
        both regions sends clients to the active one."""
        fenced = intake.fenced() if intake is not None else None
        if fenced is not None:
            return JSONResponse({"status": "fenced", **{k: v for k, v in fenced.items() if k != "error"}},
                                status_code=503)
        try:
            with context.pool.connection(timeout=5.0) as conn:
                role = conn.execute(q("current_role")).fetchone()["role"]
        except (psycopg.Error, PoolTimeout) as exc:
            return JSONResponse({"status": "not_ready", "reason": str(exc)}, status_code=503)
        return JSONResponse({"status": "ready", "role": role})

    @app.get("/metrics", tags=["health"], response_class=Response)
    def prometheus() -> Response:
        """Prometheus text exposition: API requests and actions, and projection gauges."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- the routers, and what the edge checks before a body is read ----------------------------

    app.include_router(api_reads.router)

    def admin_routes() -> list[APIRoute]:
        routes = [*app.routes, *(route for router in ROUTERS for route in router.routes)]
        return [r for r in routes if isinstance(r, APIRoute)
                and any(d.dependency is require_admin for d in r.dependencies)]

    def admin_refusal(scope) -> Answer | None:
        """`require_admin`'s answer for a request to an action route, then 415 for an action body not
        declared JSON (`not_json`), from its headers alone (the edge calls it before the body is
        read); None for other routes and for a good token with a JSON body or none."""
        matched = next((route for route in admin_routes() if route.matches(scope)[0] is Match.FULL), None)
        if matched is None:
            return None
        try:
            require_admin(Request({**scope, "route": matched}))  # its refusal is labelled by the route
        except HTTPException as exc:
            return edge_problem(exc.status_code, exc.detail, exc.headers)
        return not_json(scope)

    def body_limit(scope) -> int | None:
        """Bytes a request body may have: `POST /uploads` applies its own limits, every other route
        `serve_max_body_bytes`."""
        return None if intake is not None and scope["path"] == "/uploads" else settings.serve_max_body_bytes

    @app.get("/docs", include_in_schema=False)
    def openapi_page() -> HTMLResponse:
        """Swagger UI from the assets installed with `fastapi-offline` (no CDN: the dashboard's
        machine may have no internet, and an admin pastes a token into this page); its one inline
        script is allowed by hash."""
        page_html = get_swagger_ui_html(openapi_url=app.openapi_url, title="Tapeline API",
                                        swagger_js_url="/static/docs/swagger-ui-bundle.js",
                                        swagger_css_url="/static/docs/swagger-ui.css",
                                        swagger_favicon_url="/static/docs/favicon.png")
        policy = CONTENT_SECURITY_POLICY + "; script-src 'self' " + " ".join(script_hashes(page_html.body.decode()))
        page_html.headers["content-security-policy"] = policy
        return page_html

    app.include_router(api_actions.router)
    app.include_router(api_webhooks.router)
    app.include_router(api_pages.router)
    return app

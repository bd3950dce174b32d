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
  (`projections/ports.py`; `tapeline/wiring.py` binds it to the CLI's runners in
  `processors/operator.py`): they emit events and never write a projection;
- `/health/live`, `/health/ready` and `/metrics` (prometheus-client, this process's own registry);
- the HTTP intake `POST /uploads` (the `Intake` port, `producers/http_intake.py`: streamed uploads with API tokens,
  idempotency keys and backpressure); it writes its own table `intake_uploads` as the login role,
  never a projection.

Every read goes through a `psycopg_pool` connection that has switched to the read-only role
(`SET ROLE tapeline_reader`, `Settings.reader_role`) when it was opened, so the API cannot write a
projection even by mistake. Times are broker time (LogAppendTime, UTC, ISO 8601) unless a field
says otherwise; durations are seconds.
"""

from __future__ import annotations

import base64
import hmac
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Literal
from urllib.parse import quote, urlencode

import psycopg
import structlog
import fastapi_offline
from fastapi import Depends, FastAPI, Form, HTTPException, Query, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.routing import APIRoute
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.routing import Match
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from psycopg_pool import ConnectionPool, PoolTimeout
from pydantic import BaseModel, Field, model_validator

from domain import lifecycle
from projections.edge import CONTENT_SECURITY_POLICY, Answer, EdgeGuard, FlashSigner, allowed_hosts, script_hashes
from projections.edge import problem as edge_problem
from projections.glossary import STALL_KINDS, glossary
from projections.ports import Intake, OperatorActions
from tapeline import read
from projections.provider_status import provider_overview
from tapeline.postgres import check_schema_name, connect, q, qf
from domain.errors import ConfigurationError, NotCancellable, NotReplayable, ServiceUnavailable, TapelineError
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.api")
HERE = Path(__file__).resolve().parent
STATES = lifecycle.STATES  # schemas/lifecycle.json, in lifecycle order
State = Literal[STATES]  # type: ignore[valid-type]  (a job state, checked by FastAPI)
Stage = Literal[tuple(lifecycle.STAGE_ORDER)]  # type: ignore[valid-type]
PG_BIGINT_MAX = 2**63 - 1
"""The largest OFFSET PostgreSQL takes (bigint); a larger one would reach psycopg and fail there."""
Priority = Literal["archive", "standard", "index"]


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
                                  "options": f"-c search_path={check_schema_name(settings.db_schema)}"})


class LagCache:
    """Projection lag measured with one reusable read_committed consumer, reused for `max_age_s`
    seconds so a dashboard refreshing every few seconds does not scan the log on every request."""

    def __init__(self, settings: Settings, max_age_s: float) -> None:
        self.settings, self.max_age_s = settings, max_age_s
        self._lock = threading.Lock()
        self._consumer = None
        self._value: dict[str, Any] | None = None
        self._at = 0.0

    def get(self, conn: psycopg.Connection) -> dict[str, Any]:
        """`LagReport.as_dict()`; raises `ServiceUnavailable` when Kafka does not answer."""
        from confluent_kafka import KafkaException

        from tapeline.lag import lag_reader, measure

        with self._lock:
            if self._value is not None and time.monotonic() - self._at < self.max_age_s:
                return self._value
            if self._consumer is None:
                self._consumer = lag_reader(self.settings)
            try:
                report = measure(self.settings, conn, self._consumer, timeout_s=10.0)
            except KafkaException as exc:
                raise ServiceUnavailable(f"Kafka at {self.settings.kafka_bootstrap} did not answer: {exc}") from exc
            self._value, self._at = report.as_dict(), time.monotonic()
            return self._value

    def close(self) -> None:
        with self._lock:
            if self._consumer is not None:
                self._consumer.close()
                self._consumer = None


# ---------------------------------------------------------------------------------------------
# JSON shapes


def _iso(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def job_json(row: dict[str, Any]) -> dict[str, Any]:
    """One job for the API: `read.job_summary` (what `tapeline status --json` prints) plus priority,
    upload, worker, error class and reason (always), progress and times (broker time, ISO)."""
    data = read.job_summary(row)
    data.update({name: _iso(row.get(name)) for name in (
        "upload_id", "priority", "worker", "error_class", "reason", "progress_out_time_s", "progress_speed",
        "progress_at", "last_event_type", "events", "created_at", "completed_at")})
    return data


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    return {k: _iso(v) for k, v in row.items()}


def _event_json(row: dict[str, Any]) -> dict[str, Any]:
    flags = [f for f in ("superseded", "duplicate") if row[f]] or ([] if row["applied"] else ["evidence"])
    return {"broker_ts": _iso(row["broker_ts"]), "event_id": row["event_id"], "event_type": row["event_type"],
            "stage": row["stage"], "attempt": row["attempt"], "claim_token": row["claim_token"],
            "occurred_at": _iso(row["occurred_at"]), "recorded_by": row["recorded_by"],
            "causation_id": row["causation_id"], "dedup_key": row["dedup_key"], "applied": row["applied"],
            "superseded": row["superseded"], "duplicate": row["duplicate"], "flags": flags,
            "partition": row["partition"], "offset": row["offset"], "payload": row["payload"]}


def _letter_json(row: dict[str, Any], raw: bool = False) -> dict[str, Any]:
    data = {k: _iso(v) for k, v in row.items() if k not in ("key", "value", "headers")}
    if raw:
        for name in ("key", "value"):
            data[name] = base64.b64encode(bytes(row[name])).decode() if row.get(name) is not None else None
        data["headers"] = row.get("headers")
    return data


class JobPage(BaseModel):
    """One page of jobs: `jobs` (newest last event first), `total` matching the filters."""

    jobs: list[dict[str, Any]]
    total: int
    limit: int
    offset: int


class SameSourceJob(BaseModel):
    """Another job of the same source sha256 and how it ended (or where it is)."""

    job_id: str
    state: str
    error_class: str | None = None


class DiagnosisOut(BaseModel):
    """`domain.diagnosis.Diagnosis` as the API answers it: what happened and what to do, in plain words."""

    summary: str = Field(description="One or two plain sentences: what happened to the job")
    stall: str | None = Field(None, description="The last stall in words (ffmpeg stopped advancing, the worker "
                                                "stopped heartbeating, ...); null when none")
    permanent: bool | None = Field(None, description="true: a retry would fail the same way; false: a retry may "
                                                     "pass; null: nothing failed")
    why: str | None = Field(None, description="Why `permanent` is what it is (the error-class table, a repeat "
                                              "after a replay, the same file failing in another job)")
    action: str = Field(description="What an operator should do")
    same_source: list[SameSourceJob] = Field(description="Other jobs of the same source sha256, newest first")


class JobDetail(BaseModel):
    """One job with its attempts (view `attempts`), per-stage durations (view `stage_durations`) and
    checkpoints (`CheckpointRecorded` evidence; empty until checkpointed transcoding writes them)."""

    job: dict[str, Any]
    attempts: list[dict[str, Any]]
    stage_durations: list[dict[str, Any]]
    checkpoints: list[dict[str, Any]]
    source: dict[str, Any] | None = Field(None, description="The source: upload (filename, size, sha256), the "
                                          "probe summary per stream, and other jobs of the same sha256 "
                                          "(`tapeline.read.job_source`)")
    diagnosis: DiagnosisOut | None = Field(None, description="What happened and what to do, in plain words: "
                                             "summary, stall, permanent, why, action, same_source "
                                             "(`domain.diagnosis.diagnose`)")


class Problem(BaseModel):
    """An error answer, FastAPI's shape: `detail` says what was wrong (a string; a 422 from request
    validation carries FastAPI's list of `{loc, msg, type}` instead)."""

    detail: str | list[dict[str, Any]]


ERRORS: dict[int, str] = {
    400: "A NUL byte (%00) in the path or a query value, or a body that is not valid JSON",
    401: "No valid `Authorization: Bearer <TAPELINE_ADMIN_TOKEN>` (or the server has no admin token)",
    404: "No such job or dead letter in the projections",
    409: "The action does not apply to what the job or dead letter is now",
    413: "The body is larger than `serve_max_body_bytes` (checked before it is read)",
    422: "A parameter or body field out of its range or shape",
    503: "PostgreSQL, Kafka or the operator actions are not available",
}
"""What each error status of the read API and actions means: the one list the routes' documented
responses (`answers`) and docs/operations.md follow."""


def answers(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route: each of `statuses` with its meaning (`ERRORS`) and the `Problem`
    shape, so the OpenAPI document names every status the route can answer. Raises KeyError for a
    status without a meaning in `ERRORS`."""
    return {status: {"model": Problem, "description": ERRORS[status]} for status in statuses}


READS = answers(400, 422, 503)
"""The error answers of a read with parameters (a NUL, a value out of range, a service down)."""
ONE = answers(400, 404, 422, 503)
"""The error answers of a read of one job or dead letter."""
ACTIONS = answers(400, 401, 404, 409, 413, 422, 503)
"""The error answers of an operator action."""


OPERATOR_MAX, WHY_MAX, ID_MAX, TOKEN_MAX = 200, 2000, 500, 1000
"""Longest operator name, reason, id (a dead letter's, a provider's post ref) and admin token an
action takes, characters: the same for the JSON API and the dashboard's forms."""
NUL_FREE = r"^[^\x00]*$"
"""Every text an action takes (JSON field or form field) matches this: PostgreSQL text cannot hold
a NUL byte, so an event carrying one could not be projected. A NUL answers 422."""


class Action(BaseModel):
    """Who does it and why: recorded in the event (`operator`, `reason`) and so in the timeline."""

    operator: str = Field(..., min_length=1, max_length=OPERATOR_MAX, pattern=NUL_FREE, description="Who acts (a person's name or login)")
    why: str = Field(..., min_length=1, max_length=WHY_MAX, pattern=NUL_FREE, description="Why: recorded as the event's reason")


class ReplayRequest(Action):
    dead_letter_id: str = Field(..., min_length=1, max_length=ID_MAX, pattern=NUL_FREE, description="Id from /api/dead-letters, e.g. JOB/ATTEMPT")


class ResolveRequest(Action):
    posted_ref: str | None = Field(None, max_length=ID_MAX, pattern=NUL_FREE, description="The provider's id of the post you found: record it, "
                                                     "complete the job, post nothing")
    not_posted: bool = Field(False, description="You checked: the provider has no post; release the claim "
                                                "marker and publish again")

    @model_validator(mode="after")
    def _one_finding(self) -> "ResolveRequest":
        if (self.posted_ref is None) == (not self.not_posted):
            raise ValueError("say what you found: posted_ref or not_posted=true (exactly one)")
        return self


class ActionResult(BaseModel):
    """What an action did: `done` false when it changed nothing (already replayed, ...)."""

    action: Literal["replay", "resolve_review", "cancel"]
    job_id: str | None
    done: bool
    detail: str
    next_attempt: int | None = None


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
        letters = GaugeMetricFamily("tapeline_dead_letters_pending", "Dead letters not yet replayed (projection)")
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
        yield breakers
        if lag is not None:
            yield GaugeMetricFamily("tapeline_api_projection_lag_events", "Committed events the projection has not "
                                    "applied, all partitions (measured by the API)", value=lag["events"])
            yield GaugeMetricFamily("tapeline_api_projection_lag_seconds", "Age of the oldest event the projection "
                                    "has not applied, seconds (0 when caught up)", value=lag["seconds"])


def create_app(settings: Settings, *, actions: OperatorActions | None = None, intake: Intake | None = None) -> FastAPI:
    """The app for `settings`. The pool opens on startup (after `check_reader`) and closes on shutdown.

    `actions` carries out operator actions (without it every action answers 503); `intake` adds
    `POST /uploads`. `tapeline.wiring.build_app` passes both.
    """
    from contextlib import asynccontextmanager

    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        check_reader(settings)
        pool = reader_pool(settings)
        pool.open(wait=True, timeout=15.0)
        state["pool"] = app.state.pool = pool
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
    flasher = FlashSigner.for_settings(settings)
    app.mount("/static/docs", StaticFiles(directory=str(Path(fastapi_offline.__file__).parent / "static")),
              name="docs-assets")
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    lag = LagCache(settings, settings.lag_cache_s)
    metrics = ApiMetrics(lambda: state["pool"], lag, providers=lambda conn: provider_overview(conn, settings))
    app.state.settings, app.state.metrics = settings, metrics
    if intake is not None:
        app.include_router(intake.router)  # POST /uploads: writes as the login role

    def db() -> Iterator[psycopg.Connection]:
        try:
            with state["pool"].connection() as conn:
                yield conn
        except PoolTimeout as exc:
            raise ServiceUnavailable(f"no database connection within 10 s: {exc}") from exc

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
                route = getattr(request.scope.get("route"), "path", "unmatched")
                metrics.requests.labels(route=route, method=request.method, status="500").inc()
                raise
        route = getattr(request.scope.get("route"), "path", "unmatched")
        metrics.requests.labels(route=route, method=request.method, status=str(response.status_code)).inc()
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
        """200 when a read-only connection answers, else 503 with the reason."""
        try:
            with state["pool"].connection(timeout=5.0) as conn:
                role = conn.execute(q("current_role")).fetchone()["role"]
        except (psycopg.Error, PoolTimeout) as exc:
            return JSONResponse({"status": "not_ready", "reason": str(exc)}, status_code=503)
        return JSONResponse({"status": "ready", "role": role})

    @app.get("/metrics", tags=["health"], response_class=Response)
    def prometheus() -> Response:
        """Prometheus text exposition: API requests and actions, and projection gauges."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- the read API ---------------------------------------------------------------------------

    def job_or_404(conn: psycopg.Connection, job_id: str) -> dict[str, Any]:
        row = read.job_row(conn, job_id)
        if row is None:
            raise HTTPException(404, f"no job {job_id!r} in the projections (not submitted, or intake not caught up)")
        return row

    @app.get("/api/jobs", tags=["jobs"], response_model=JobPage, responses=READS)
    def list_jobs(state_: State | None = Query(None, alias="state", description="Only jobs in this state"),
                  stage: Stage | None = Query(None, description="Only jobs whose current stage is this"),
                  priority: Priority | None = Query(None, description="Only jobs of this priority tier"),
                  since: datetime | None = Query(None, description="Last event at or after (ISO 8601; UTC if no zone)"),
                  until: datetime | None = Query(None, description="Last event before (ISO 8601; UTC if no zone)"),
                  limit: int = Query(50, ge=1, le=500, description="Page size"),
                  offset: int = Query(0, ge=0, le=PG_BIGINT_MAX, description="Jobs to skip"),
                  conn: psycopg.Connection = Depends(db)) -> JobPage:
        """Jobs, newest last event first, filtered by state, stage, priority and last-event broker time."""
        rows, total = read.jobs_page(conn, state=state_, stage=stage, priority=priority, since=_utc(since),
                                     until=_utc(until), limit=limit, offset=offset)
        return JobPage(jobs=[job_json(r) for r in rows], total=total, limit=limit, offset=offset)

    @app.get("/api/jobs/{job_id}", tags=["jobs"], response_model=JobDetail, responses=ONE)
    def get_job(job_id: str, conn: psycopg.Connection = Depends(db)) -> JobDetail:
        """One job with its attempts, stage durations and checkpoints; 404 for an unknown job."""
        row = job_or_404(conn, job_id)
        source = read.job_source(conn, job_id)
        return JobDetail(job=job_json(row), attempts=read.attempt_history(conn, job_id),
                         stage_durations=[_plain(r) for r in read.stage_durations(conn, job_id)],
                         checkpoints=read.checkpoints(conn, job_id), source=source,
                         diagnosis=read.job_diagnosis(conn, row, source))

    @app.get("/api/jobs/{job_id}/timeline", tags=["jobs"], responses=ONE)
    def get_timeline(job_id: str, conn: psycopg.Connection = Depends(db)) -> list[dict[str, Any]]:
        """Every event of the job in log order (applied, superseded and duplicate copies, with flags)."""
        rows = read.timeline(conn, job_id)
        if not rows:
            job_or_404(conn, job_id)
        return [_event_json(r) for r in rows]

    @app.get("/api/jobs/{job_id}/progress", tags=["jobs"], responses=ONE)
    def get_progress(job_id: str, conn: psycopg.Connection = Depends(db)) -> dict[str, Any]:
        """Heartbeat progress per attempt (`read.progress_series`) and the source's duration in
        seconds of media (the 100 % line of the chart)."""
        row = job_or_404(conn, job_id)
        return {"job_id": job_id, "state": row["state"], "source_duration_s": row["source_duration_s"],
                "series": read.progress_series(conn, job_id)}

    @app.get("/api/jobs/{job_id}/checkpoints", tags=["jobs"], responses=ONE)
    def get_checkpoints(job_id: str, conn: psycopg.Connection = Depends(db)) -> list[dict[str, Any]]:
        """The job's `CheckpointRecorded` evidence (empty until checkpointed transcoding writes it)."""
        job_or_404(conn, job_id)
        return read.checkpoints(conn, job_id)

    @app.get("/api/stalled", tags=["operations"], responses=answers(503))
    def get_stalled(conn: psycopg.Connection = Depends(db)) -> list[dict[str, Any]]:
        """Stalled attempts (lease_expired, no_progress, worker_exited), stalled handoffs, expected work
        missing, retries and hand-overs still waiting (`waiting`) and jobs in needs_review, each with
        `kind` and `since_s` (seconds; log clock, wall clock for reviews)."""
        return read.stalls(conn)

    @app.get("/api/dead-letters", tags=["operations"], responses=READS)
    def get_dead_letters(reason: str | None = Query(None, description="Only this error class"),
                         pending: bool = Query(False, description="Hide replayed dead letters"),
                         limit: int = Query(200, ge=1, le=1000),
                         conn: psycopg.Connection = Depends(db)) -> list[dict[str, Any]]:
        """Dead letters, newest first: id, kind (job | record | projection), job, error class, error,
        source position, replay record (`value_bytes`: size of the raw record, bytes)."""
        return [_letter_json(r) for r in read.dead_letters(conn, reason=reason, pending=pending, limit=limit)]

    @app.get("/api/dead-letters/{dead_letter_id:path}", tags=["operations"], responses=ONE)
    def get_dead_letter(dead_letter_id: str, conn: psycopg.Connection = Depends(db)) -> dict[str, Any]:
        """One dead letter with its raw key and value (base64); 404 for an unknown id."""
        row = read.dead_letter(conn, dead_letter_id)
        if row is None:
            raise HTTPException(404, f"no dead letter {dead_letter_id!r}")
        return _letter_json(row, raw=True)

    @app.get("/api/review", tags=["operations"], responses=answers(503))
    def get_review(conn: psycopg.Connection = Depends(db)) -> list[dict[str, Any]]:
        """Jobs in needs_review (a publish that could not be proven safe), with the reason."""
        return [job_json(r) for r in read.jobs_in_state(conn, "needs_review")]

    @app.get("/api/lag", tags=["operations"], responses=answers(503))
    def get_lag(conn: psycopg.Connection = Depends(db)) -> dict[str, Any]:
        """Projection lag: committed events and seconds the projection is behind the log end, in total
        and per partition behind (measured at most every `lag_cache_s` seconds); 503 without Kafka."""
        return lag.get(conn)

    @app.get("/api/providers", tags=["operations"], responses=answers(503))
    def get_providers(conn: psycopg.Connection = Depends(db)) -> list[dict[str, Any]]:
        """Publish providers: circuit breaker (state, cooldown until, failures, probe), posts in the
        per-minute and per-day quota windows against their limits, and the last deferral."""
        return provider_overview(conn, settings)

    @app.get("/api/overview", tags=["operations"], responses=answers(503))
    def get_overview(conn: psycopg.Connection = Depends(db)) -> dict[str, Any]:
        """What the overview page shows: jobs by state and by (stage, state), jobs created and ended per
        minute over the last hour (database clock), stall counts by kind, dead letters, projection lag
        (`{"error": ...}` when Kafka does not answer), and the 20 most recently updated jobs."""
        return overview(conn)

    def overview(conn: psycopg.Connection) -> dict[str, Any]:
        by_state = {s: 0 for s in STATES}
        by_stage: dict[str, dict[str, int]] = {}
        for row in read.jobs_by_state_and_stage(conn):
            by_state[row["state"]] = by_state.get(row["state"], 0) + row["n"]
            by_stage.setdefault(row["stage"], {})[row["state"]] = row["n"]
        stalls: dict[str, int] = {}
        for stall in read.stalls(conn):
            stalls[stall["kind"]] = stalls.get(stall["kind"], 0) + 1
        try:
            lag_doc = lag.get(conn)
        except TapelineError as exc:
            lag_doc = {"error": str(exc)}
        return {"jobs_by_state": by_state, "jobs_by_stage": by_stage,
                "throughput": read.throughput(conn, read.database_now(conn)), "stalls": stalls,
                "dead_letters": read.dead_letter_counts(conn), "projection_lag": lag_doc,
                "recent_jobs": [job_json(r) for r in read.recent_jobs(conn, 20)]}

    # -- actions --------------------------------------------------------------------------------

    def token_ok(presented: str | None) -> bool:
        expected = settings.admin_token.get_secret_value() if settings.admin_token else ""
        return bool(expected) and presented is not None and hmac.compare_digest(presented.encode(), expected.encode())

    def require_admin(request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not token_ok(presented.strip()):
            reason = ("actions are disabled: the server has no TAPELINE_ADMIN_TOKEN" if not settings.admin_token
                      else "missing or wrong admin token (Authorization: Bearer <TAPELINE_ADMIN_TOKEN>)")
            last = request.url.path.rsplit("/", 1)[-1]  # cancel | replay | resolve-review
            metrics.actions.labels(action=last.replace("-", "_"), result="unauthorized").inc()
            raise HTTPException(401, reason, headers={"WWW-Authenticate": "Bearer"})

    def admin_routes() -> list[APIRoute]:
        return [r for r in app.routes if isinstance(r, APIRoute)
                and any(d.dependency is require_admin for d in r.dependencies)]

    def admin_refusal(scope) -> Answer | None:
        """`require_admin`'s answer for a request to an action route, from its headers alone (the
        edge calls it before the body is read); None for other routes and for a good token."""
        if not any(route.matches(scope)[0] is Match.FULL for route in admin_routes()):
            return None
        try:
            require_admin(Request(scope))
        except HTTPException as exc:
            return edge_problem(exc.status_code, exc.detail, exc.headers)
        return None

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

    def wired() -> OperatorActions:
        if actions is None:
            raise HTTPException(503, "this server has no operator actions wired (see tapeline.wiring.build_app)")
        return actions

    def do_replay(dead_letter_id: str, operator: str, why: str, client: str) -> ActionResult:
        with state["pool"].connection() as conn:
            letter = read.dead_letter(conn, dead_letter_id)
        if letter is None:
            raise HTTPException(404, f"no dead letter {dead_letter_id!r}")
        if letter["kind"] != "job":
            raise HTTPException(409, f"dead letter {dead_letter_id} is an undecodable record ({letter['error']}); "
                                     "it has no job to replay")
        [outcome] = wired().replay_dead_letters([dead_letter_id], operator, why)
        _record("replay", outcome.replayed, job_id=outcome.job_id, operator=operator, client=client)
        return ActionResult(action="replay", job_id=outcome.job_id, done=outcome.replayed, detail=outcome.detail,
                            next_attempt=outcome.next_attempt)

    def do_cancel(job_id: str, operator: str, why: str, client: str) -> ActionResult:
        with state["pool"].connection() as conn:
            job_or_404(conn, job_id)
        try:
            detail = wired().cancel_job(job_id, operator, why)
        except NotCancellable as exc:
            raise HTTPException(409, str(exc)) from exc
        _record("cancel", True, job_id=job_id, operator=operator, client=client)
        return ActionResult(action="cancel", job_id=job_id, done=True, detail=detail)

    def do_resolve(job_id: str, body: ResolveRequest, client: str) -> ActionResult:
        with state["pool"].connection() as conn:
            row = job_or_404(conn, job_id)
        if row["state"] != "needs_review":
            raise HTTPException(409, f"job {job_id} is {row['state']}, not needs_review")
        try:
            detail = wired().resolve_review(job_id, body.operator, body.why, body.posted_ref)
        except NotReplayable as exc:
            raise HTTPException(409, str(exc)) from exc
        _record("resolve_review", True, job_id=job_id, operator=body.operator, client=client)
        return ActionResult(action="resolve_review", job_id=job_id, done=True, detail=detail)

    def _record(action: str, done: bool, **fields: Any) -> None:
        metrics.actions.labels(action=action, result="done" if done else "unchanged").inc()
        log.info("operator action", action=action, done=done, **fields)

    def client_of(request: Request) -> str:
        return request.client.host if request.client else "unknown"

    @app.post("/api/dead-letters/replay", tags=["actions"], response_model=ActionResult, responses=ACTIONS,
              dependencies=[Depends(require_admin)])
    def replay(body: ReplayRequest, request: Request) -> ActionResult:
        """Reopen a dead-lettered job with a fresh attempt budget (`JobReplayed` + the next attempt).
        Idempotent: `done` is false when it was already replayed. 401 without the token, 404 for an
        unknown id, 409 for an undecodable-record dead letter."""
        return do_replay(body.dead_letter_id, body.operator, body.why, client_of(request))

    @app.post("/api/jobs/{job_id}/cancel", tags=["actions"], response_model=ActionResult, responses=ACTIONS,
              dependencies=[Depends(require_admin)])
    def cancel(job_id: str, body: Action, request: Request) -> ActionResult:
        """Cancel a job that has not ended (`JobCancelled` with operator and reason). 401 without the
        token, 404 for an unknown job, 409 for an ended one."""
        return do_cancel(job_id, body.operator, body.why, client_of(request))

    @app.post("/api/jobs/{job_id}/resolve-review", tags=["actions"], response_model=ActionResult, responses=ACTIONS,
              dependencies=[Depends(require_admin)])
    def resolve(job_id: str, body: ResolveRequest, request: Request) -> ActionResult:
        """Resolve a job in needs_review: `posted_ref` records the post you found and completes the job;
        `not_posted` releases the claim marker and queues the next publish attempt. 401 without the
        token, 404 for an unknown job, 409 when it is not in needs_review."""
        return do_resolve(job_id, body, client_of(request))

    # -- the dashboard --------------------------------------------------------------------------

    def page(request: Request, template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
        flash = flasher.shown(request.query_params)  # only outcomes this server signed (FlashSigner)
        return templates.TemplateResponse(request, template, {"message": flash["msg"], "error": flash["err"],
                                                              **context}, status_code=status_code)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def overview_page(request: Request, conn: psycopg.Connection = Depends(db)) -> HTMLResponse:
        return page(request, "overview.html", data=overview(conn), states=STATES)

    @app.get("/jobs", response_class=HTMLResponse, include_in_schema=False)
    def jobs_list_page(request: Request, state_: State | None = Query(None, alias="state"),
                       stage: Stage | None = None, priority: Priority | None = None,
                       limit: int = Query(50, ge=1, le=500), offset: int = Query(0, ge=0, le=PG_BIGINT_MAX),
                       conn: psycopg.Connection = Depends(db)) -> HTMLResponse:
        rows, total = read.jobs_page(conn, state=state_, stage=stage, priority=priority, limit=limit, offset=offset)
        filters = {k: v for k, v in (("state", state_), ("stage", stage), ("priority", priority)) if v}
        return page(request, "jobs.html", jobs=[job_json(r) for r in rows], total=total, limit=limit, offset=offset,
                    filters=filters, query=urlencode(filters), states=STATES)

    @app.get("/jobs/{job_id}", response_class=HTMLResponse, include_in_schema=False)
    def job_page(request: Request, job_id: str, conn: psycopg.Connection = Depends(db)) -> HTMLResponse:
        row = read.job_row(conn, job_id)
        if row is None:
            return page(request, "not_found.html", 404, what=f"no job {job_id!r} in the projections")
        source = read.job_source(conn, job_id)
        return page(request, "job.html", job=job_json(row), attempts=read.attempt_history(conn, job_id),
                    events=[_event_json(r) for r in read.timeline(conn, job_id)],
                    checkpoints=read.checkpoints(conn, job_id), source=source,
                    diagnosis=read.job_diagnosis(conn, row, source), dead_letter_id=f"{job_id}/{row['attempt']}")

    @app.get("/stalled", response_class=HTMLResponse, include_in_schema=False)
    def stalled_page(request: Request, conn: psycopg.Connection = Depends(db)) -> HTMLResponse:
        return page(request, "stalled.html", stalls=read.stalls(conn))

    @app.get("/dead-letters", response_class=HTMLResponse, include_in_schema=False)
    def dead_letters_page(request: Request, conn: psycopg.Connection = Depends(db)) -> HTMLResponse:
        return page(request, "dead_letters.html", letters=[_letter_json(r) for r in read.dead_letters(conn, limit=200)])

    def form_action(request: Request, action: str, token: str, back: str, run) -> Response:
        if not token_ok(token):
            metrics.actions.labels(action=action, result="unauthorized").inc()
            reason = ("actions are disabled: the server has no TAPELINE_ADMIN_TOKEN" if not settings.admin_token
                      else "wrong admin token: nothing was changed")
            return page(request, "not_found.html", 401, what=reason, title="401 Unauthorized")
        try:
            result = run()
        except HTTPException as exc:
            return RedirectResponse(f"{back}?{flasher.query('err', str(exc.detail))}", status_code=303)
        except TapelineError as exc:
            return RedirectResponse(f"{back}?{flasher.query('err', str(exc))}", status_code=303)
        target = f"/jobs/{quote(result.job_id, safe='')}" if result.job_id else back
        return RedirectResponse(f"{target}?{flasher.query('msg', f'{result.action}: {result.detail}')}",
                                status_code=303)

    @app.post("/ui/dead-letters/replay", include_in_schema=False)
    def replay_form(request: Request, dead_letter_id: str = Form(..., max_length=ID_MAX, pattern=NUL_FREE), token: str = Form("", max_length=TOKEN_MAX, pattern=NUL_FREE),
                    operator: str = Form(..., min_length=1, max_length=OPERATOR_MAX, pattern=NUL_FREE),
                    why: str = Form(..., min_length=1, max_length=WHY_MAX, pattern=NUL_FREE),
                    anyway: str = Form("", max_length=8, pattern=NUL_FREE)) -> Response:
        """The dashboard's replay. A dead letter whose job would most likely fail the same way again
        (its diagnosis is permanent) is replayed only with `anyway` (the job page's "Replay anyway",
        under its warning); without it the answer says why and nothing is replayed. The CLI and the
        JSON API replay as asked."""
        def replay():
            letter_id = dead_letter_id.strip()
            if not anyway:
                with state["pool"].connection() as conn:
                    warning = read.replay_warning(conn, letter_id)
                if warning:
                    raise TapelineError(f"not replayed: it would most likely fail again ({warning}); "
                                        "its job page offers Replay anyway")
            return do_replay(letter_id, operator, why, client_of(request))

        return form_action(request, "replay", token, "/dead-letters", replay)

    @app.post("/ui/jobs/{job_id}/cancel", include_in_schema=False)
    def cancel_form(request: Request, job_id: str, token: str = Form("", max_length=TOKEN_MAX, pattern=NUL_FREE),
                    operator: str = Form(..., min_length=1, max_length=OPERATOR_MAX, pattern=NUL_FREE),
                    why: str = Form(..., min_length=1, max_length=WHY_MAX, pattern=NUL_FREE)) -> Response:
        return form_action(request, "cancel", token, f"/jobs/{quote(job_id, safe='')}",
                           lambda: do_cancel(job_id, operator, why, client_of(request)))

    @app.post("/ui/jobs/{job_id}/resolve-review", include_in_schema=False)
    def resolve_form(request: Request, job_id: str, token: str = Form("", max_length=TOKEN_MAX, pattern=NUL_FREE),
                     operator: str = Form(..., min_length=1, max_length=OPERATOR_MAX, pattern=NUL_FREE),
                     why: str = Form(..., min_length=1, max_length=WHY_MAX, pattern=NUL_FREE),
                     finding: Literal["posted", "not_posted"] = Form(...),
                     posted_ref: str = Form("", max_length=ID_MAX, pattern=NUL_FREE)) -> Response:
        back = f"/jobs/{quote(job_id, safe='')}"

        def run() -> ActionResult:
            try:
                ref = (posted_ref.strip() or None) if finding == "posted" else None
                body = ResolveRequest(operator=operator, why=why, posted_ref=ref, not_posted=finding == "not_posted")
            except ValueError as exc:
                raise HTTPException(422, str(exc)) from exc
            return do_resolve(job_id, body, client_of(request))
        return form_action(request, "resolve_review", token, back, run)

    return app


def _utc(value: datetime | None) -> datetime | None:
    """A filter time as UTC: a time without a zone is taken as UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=timezone.utc)

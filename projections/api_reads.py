"""The JSON read API under `/api` (`projections/api.py` includes `router`): jobs (filtered, paged),
one job with its attempts, stage durations, checkpoints, timeline and progress, stalls, dead letters,
jobs needing review, projection lag, providers and the overview. Every read uses the app's read-only
connection (`api_deps.db`); times are broker time (UTC, ISO 8601), durations seconds."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg
from fastapi import APIRouter, Depends, HTTPException, Query, Request

from domain.errors import TapelineError
from domain.policy.disclosure import public_dead_letter, public_view
from projections.api_deps import Web, bearer, db, job_or_404, token_ok, web
from projections.api_models import (ONE, PG_BIGINT_MAX, READS, STATES, JobDetail, JobPage, Priority, Stage, State,
                                    answers, as_utc, event_json, job_json, letter_json, plain)
from projections import presenter
from projections.provider_status import provider_overview
from projections import read_model as read

router = APIRouter()

WITHHELD = (" Without the admin token (`Authorization: Bearer`) fencing tokens and the sha256 and size of "
            "objects that are not public are null (`domain/policy/disclosure.py`).")
"""What every job read's description adds: the rule of `public_view`, in the API's own documentation."""


def admin(request: Request) -> bool:
    """True when the request carries the admin token (`Authorization: Bearer <TAPELINE_ADMIN_TOKEN>`):
    its reads answer in full, every other caller gets `public_view`. Never refuses: reads stay open."""
    return token_ok(web(request).settings, bearer(request))


def shown(request: Request, answer: Any) -> Any:
    """`answer` as this caller may see it: whole for the admin token, else its `public_view`."""
    return answer if admin(request) else public_view(answer)


@router.get("/api/jobs", tags=["jobs"], response_model=JobPage, responses=READS)
def list_jobs(state_: State | None = Query(None, alias="state", description="Only jobs in this state"),
              stage: Stage | None = Query(None, description="Only jobs whose current stage is this"),
              priority: Priority | None = Query(None, description="Only jobs of this priority tier"),
              since: datetime | None = Query(None, description="Last event at or after (ISO 8601; UTC if no zone)"),
              until: datetime | None = Query(None, description="Last event before (ISO 8601; UTC if no zone)"),
              limit: int = Query(50, ge=1, le=500, description="Page size"),
              offset: int = Query(0, ge=0, le=PG_BIGINT_MAX, description="Jobs to skip"),
              conn: psycopg.Connection = Depends(db)) -> JobPage:
    """Jobs, newest last event first, filtered by state, stage, priority and last-event broker time."""
    rows, total = read.jobs_page(conn, state=state_, stage=stage, priority=priority, since=as_utc(since),
                                 until=as_utc(until), limit=limit, offset=offset)
    return JobPage(jobs=[job_json(r) for r in rows], total=total, limit=limit, offset=offset)


@router.get("/api/jobs/{job_id}", tags=["jobs"], response_model=JobDetail, responses=ONE,
            description="One job with its attempts, stage durations and checkpoints; 404 for an unknown job." + WITHHELD)
def get_job(job_id: str, request: Request, conn: psycopg.Connection = Depends(db)) -> JobDetail:
    """One job with its attempts, stage durations and checkpoints; 404 for an unknown job."""
    row = job_or_404(conn, job_id)
    facts = read.job_facts(conn, row)  # the same facts as the job page and `tapeline status --json`
    return JobDetail(job=job_json(row), stage_durations=[plain(r) for r in read.stage_durations(conn, job_id)],
                     **{**facts, "checkpoints": shown(request, facts["checkpoints"])})


@router.get("/api/jobs/{job_id}/timeline", tags=["jobs"], responses=ONE,
            description="Every event of the job in log order (applied, superseded and duplicate copies, with "
                        "flags)." + WITHHELD)
def get_timeline(job_id: str, request: Request, conn: psycopg.Connection = Depends(db)) -> list[dict[str, Any]]:
    """Every event of the job in log order (applied, superseded and duplicate copies, with flags)."""
    rows = read.timeline(conn, job_id)
    if not rows:
        job_or_404(conn, job_id)
    return shown(request, [event_json(r) for r in rows])


@router.get("/api/jobs/{job_id}/progress", tags=["jobs"], responses=ONE)
def get_progress(job_id: str, request: Request, conn: psycopg.Connection = Depends(db)) -> dict[str, Any]:
    """Heartbeat progress per attempt (`read.progress_series`, each point with `media_s`: the media
    seconds it says are done, `presenter.heartbeat_media_s`) and the source's duration in seconds of
    media (the 100 % line of the chart)."""
    row = job_or_404(conn, job_id)
    series = presenter.with_media_s(read.progress_series(conn, job_id), row["source_duration_s"])
    return shown(request, {"job_id": job_id, "state": row["state"], "source_duration_s": row["source_duration_s"],
                           "series": series})


@router.get("/api/jobs/{job_id}/checkpoints", tags=["jobs"], responses=ONE,
            description="The job's `CheckpointRecorded` evidence (empty until checkpointed transcoding writes "
                        "it)." + WITHHELD)
def get_checkpoints(job_id: str, request: Request, conn: psycopg.Connection = Depends(db)) -> list[dict[str, Any]]:
    """The job's `CheckpointRecorded` evidence (empty until checkpointed transcoding writes it)."""
    job_or_404(conn, job_id)
    return shown(request, read.checkpoints(conn, job_id))


@router.get("/api/stalled", tags=["operations"], responses=answers(503))
def get_stalled(request: Request, conn: psycopg.Connection = Depends(db),
                context: Web = Depends(web)) -> list[dict[str, Any]]:
    """Stalled attempts (lease_expired, no_progress, worker_exited), stalled handoffs, expected work
    missing, retries and hand-overs still waiting (`waiting`) and jobs in needs_review, each with
    `kind` and `since_s` (seconds; log clock, wall clock for reviews); then attempts suspect before
    the verdict (`suspect`, with `allowance_s`, `remaining_s` and the tool's state) and attempt stalls
    judged in the last `TAPELINE_RECENT_STALLS_S` seconds with their `outcome` (`recent_stall`):
    `read.stall_list`."""
    return shown(request, read.stall_list(conn, context.settings.recent_stalls_s))


@router.get("/api/dead-letters", tags=["operations"], responses=READS)
def get_dead_letters(reason: str | None = Query(None, description="Only this error class"),
                     pending: bool = Query(False, description="Hide replayed dead letters"),
                     limit: int = Query(200, ge=1, le=1000),
                     conn: psycopg.Connection = Depends(db)) -> list[dict[str, Any]]:
    """Dead letters, newest first: id, kind (job | record | projection), job, error class, error,
    source position, replay record (`value_bytes`: size of the raw record, bytes)."""
    return [letter_json(r) for r in read.dead_letters(conn, reason=reason, pending=pending, limit=limit)]


@router.get("/api/dead-letters/{dead_letter_id:path}", tags=["operations"], responses=ONE,
            description="One dead letter; with the admin token (`Authorization: Bearer`) its raw key and value "
                        "(base64) and headers, without it those are null (`domain/policy/disclosure.py`); 404 for "
                        "an unknown id.")
def get_dead_letter(dead_letter_id: str, request: Request, conn: psycopg.Connection = Depends(db)) -> dict[str, Any]:
    """One dead letter; its raw key, value (base64) and headers for the admin token only; 404 for an
    unknown id."""
    row = read.dead_letter(conn, dead_letter_id)
    if row is None:
        raise HTTPException(404, f"no dead letter {dead_letter_id!r}")
    letter = letter_json(row, raw=True)
    return letter if admin(request) else public_dead_letter(letter)


@router.get("/api/review", tags=["operations"], responses=answers(503))
def get_review(conn: psycopg.Connection = Depends(db)) -> list[dict[str, Any]]:
    """Jobs in needs_review (a publish that could not be proven safe), with the reason."""
    return [job_json(r) for r in read.jobs_in_state(conn, "needs_review")]


@router.get("/api/lag", tags=["operations"], responses=answers(503))
def get_lag(conn: psycopg.Connection = Depends(db), context: Web = Depends(web)) -> dict[str, Any]:
    """Projection lag: committed events and seconds the projection is behind the log end, in total
    and per partition behind (measured at most every `lag_cache_s` seconds); 503 without Kafka."""
    return context.lag.get(conn)


@router.get("/api/providers", tags=["operations"], responses=answers(503))
def get_providers(conn: psycopg.Connection = Depends(db), context: Web = Depends(web)) -> list[dict[str, Any]]:
    """Publish providers: circuit breaker (state, cooldown until, failures, probe), posts in the
    per-minute and per-day quota windows against their limits, and the last deferral."""
    return provider_overview(conn, context.settings)


@router.get("/api/overview", tags=["operations"], responses=answers(503))
def get_overview(conn: psycopg.Connection = Depends(db), context: Web = Depends(web)) -> dict[str, Any]:
    """What the overview page shows: jobs by state and by (stage, state), jobs created and ended per
    minute over the last hour (database clock), stall counts by kind, dead letters, projection lag
    (`{"error": ...}` when Kafka does not answer), and the 20 most recently updated jobs."""
    return overview(conn, context)


def overview(conn: psycopg.Connection, context: Web) -> dict[str, Any]:
    """The overview (`GET /api/overview`, the dashboard's first page) read over `conn` (`suspect`: how
    many attempts `read.suspect_attempts` lists); the lag from
    `context.lag`, `{"error": ...}` in its place when it cannot be measured; `region_replication`,
    the Region replication panel (`projections/region_panel.py` `panel`), None when there is none."""
    by_state = {s: 0 for s in STATES}
    by_stage: dict[str, dict[str, int]] = {}
    for row in read.jobs_by_state_and_stage(conn):
        by_state[row["state"]] = by_state.get(row["state"], 0) + row["n"]
        by_stage.setdefault(row["stage"], {})[row["state"]] = row["n"]
    stalls: dict[str, int] = {}
    for stall in read.stalls(conn):
        stalls[stall["kind"]] = stalls.get(stall["kind"], 0) + 1
    try:
        lag_doc = context.lag.get(conn)
    except TapelineError as exc:
        lag_doc = {"error": str(exc)}
    return {"jobs_by_state": by_state, "jobs_by_stage": by_stage,
            "throughput": read.throughput(conn, read.database_now(conn)), "stalls": stalls,
            "suspect": len(read.suspect_attempts(conn)),  # before the verdict (issue 45)
            "dead_letters": read.dead_letter_counts(conn), "projection_lag": lag_doc,
            "recent_jobs": [job_json(r) for r in read.recent_jobs(conn, 20)],
            "region_replication": context.region.get() if context.region is not None else None}

"""The dashboard's pages (`projections/api.py` includes `router`): server-rendered HTML (Jinja2,
autoescaped, `projections/templates/`) that `static/dashboard.js` refreshes every few seconds from
the JSON API. Not in the OpenAPI document."""

from __future__ import annotations

from urllib.parse import urlencode

import psycopg
from fastapi import APIRouter, Depends, Form, Query, Request
from fastapi.responses import HTMLResponse

from projections.api_deps import Web, bearer, db, page, refusal_reason, token_ok, web
from projections.api_models import NUL_FREE, PG_BIGINT_MAX, STATES, TOKEN_MAX, Priority, Stage, State, event_json, job_json, letter_json
from projections.api_reads import overview
from projections import read_model as read

router = APIRouter()

PAGES: tuple[tuple[str, str], ...] = (
    ("/", "Overview: jobs by state and stage, jobs created and ended per minute, stalled count, dead letters "
          "pending, projection lag, recent jobs, the region replication panel"),
    ("/jobs", "Jobs: every job, newest first; filters `?state=`, `?stage=`, `?priority=`, paging `?limit=`, `?offset=`"),
    ("/jobs/{job_id}", "One job: its diagnosis, summary, source, progress per attempt, attempts, checkpoints, "
                       "timeline, and the replay, cancel and review forms"),
    ("/stalled", "Stalled: attempts, handoffs and uploads that stopped moving, retries waiting, jobs waiting "
                 "for review"),
    ("/dead-letters", "Dead letters: the 200 newest, with the replay, fail and dismiss forms"),
    ("/webhooks", "Webhooks: customer endpoints, enabled or why not, failing since when, deliveries by state"),
)
"""Every page of the dashboard (GET, HTML) and what it shows; `docs/operating.md` lists them from here
(`projections/doc_tables.py`) and `tests/unit/test_glossary.py` checks this list against `router`."""


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
def overview_page(request: Request, conn: psycopg.Connection = Depends(db),
                  context: Web = Depends(web)) -> HTMLResponse:
    """The overview: `api_reads.overview` as a page."""
    return page(request, "overview.html", data=overview(conn, context), states=STATES)


@router.get("/jobs", response_class=HTMLResponse, include_in_schema=False)
def jobs_list_page(request: Request, state_: State | None = Query(None, alias="state"),
                   stage: Stage | None = None, priority: Priority | None = None,
                   limit: int = Query(50, ge=1, le=500), offset: int = Query(0, ge=0, le=PG_BIGINT_MAX),
                   conn: psycopg.Connection = Depends(db)) -> HTMLResponse:
    """Jobs, one page, filtered like `GET /api/jobs` by state, stage and priority."""
    rows, total = read.jobs_page(conn, state=state_, stage=stage, priority=priority, limit=limit, offset=offset)
    filters = {k: v for k, v in (("state", state_), ("stage", stage), ("priority", priority)) if v}
    return page(request, "jobs.html", jobs=[job_json(r) for r in rows], total=total, limit=limit, offset=offset,
                filters=filters, query=urlencode(filters), states=STATES)


@router.get("/jobs/{job_id}", response_class=HTMLResponse, include_in_schema=False)
def job_page(request: Request, job_id: str, conn: psycopg.Connection = Depends(db)) -> HTMLResponse:
    """One job: attempts, timeline, checkpoints, source and diagnosis, with the action forms; 404 page
    for an unknown job."""
    row = read.job_row(conn, job_id)
    if row is None:
        return page(request, "not_found.html", 404, what=f"no job {job_id!r} in the projections")
    return page(request, "job.html", job=job_json(row), events=[event_json(r) for r in read.timeline(conn, job_id)],
                dead_letter_id=f"{job_id}/{row['attempt']}", **read.job_facts(conn, row))


@router.get("/stalled", response_class=HTMLResponse, include_in_schema=False)
def stalled_page(request: Request, conn: psycopg.Connection = Depends(db),
                 context: Web = Depends(web)) -> HTMLResponse:
    """Stalls, suspect attempts and recent stalls with their outcome (`read.stall_list`)."""
    return page(request, "stalled.html", stalls=read.stall_list(conn, context.settings.recent_stalls_s),
                recent_s=context.settings.recent_stalls_s)


@router.get("/dead-letters", response_class=HTMLResponse, include_in_schema=False)
def dead_letters_page(request: Request, conn: psycopg.Connection = Depends(db)) -> HTMLResponse:
    """The 200 newest dead letters, with the replay form."""
    return page(request, "dead_letters.html", letters=[letter_json(r) for r in read.dead_letters(conn, limit=200)])


@router.get("/webhooks", response_class=HTMLResponse, include_in_schema=False)
def webhooks_page(request: Request, context: Web = Depends(web)) -> HTMLResponse:
    """Customer webhook endpoints (`read.webhook_endpoints`): enabled or why not, failing since when,
    deliveries by state; never a secret. Read-only: `tapeline webhooks` and `/api/webhooks` change them.

    The same admin token as `GET /api/webhooks` (URLs often carry customers' tokens; issue 44 item
    4): listed with `Authorization: Bearer <TAPELINE_ADMIN_TOKEN>`, otherwise a 401 page with a
    token form that posts to `/ui/webhooks` (`webhooks_form`)."""
    return webhooks_listing(request, context, bearer(request))


@router.post("/ui/webhooks", response_class=HTMLResponse, include_in_schema=False)
def webhooks_form(request: Request, token: str = Form("", max_length=TOKEN_MAX, pattern=NUL_FREE),
                  context: Web = Depends(web)) -> HTMLResponse:
    """The `/webhooks` page for the admin token posted from its form (a form field, as the action
    forms carry it: never in a URL, so never in a log or the browser's history); 401 and the form
    again for a wrong or missing one."""
    return webhooks_listing(request, context, token or None)


def webhooks_listing(request: Request, context: Web, token: str | None) -> HTMLResponse:
    """The endpoints page when `token` is the admin token, else the 401 page with the token form
    and nothing read (no connection is taken before the token holds)."""
    if not token_ok(context.settings, token):
        return page(request, "webhooks.html", 401, endpoints=None, refused=refusal_reason(context.settings, token))
    with context.pool.connection() as conn:
        return page(request, "webhooks.html", endpoints=read.webhook_endpoints(conn))

"""The dashboard's active problems (issue 23 item 4): the conditions the alerts watch
(compose/alerts.yml), read from the projections and shown at the top of every page, each with a
count, plain words and links to the jobs concerned.

`active_problems` decides from facts and `now` (pure); `read_facts` gathers the facts from
PostgreSQL (tapeline.read and provider_status); `problems_now` is what the page renderer calls, and
`problems_router` serves the same as `GET /api/problems`, which static/dashboard.js polls to keep the
strip current between page loads.
Object storage over its limit is not shown: only the watchdog measures the bucket (its
`tapeline_storage_bytes` metric and the TapelineStorageFull alert), nothing records it in the database.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable
from urllib.parse import quote

import psycopg
import structlog
from fastapi import APIRouter

from domain.policy.stall import ATTEMPT_STALL_KINDS
from projections.provider_status import provider_overview
from tapeline import read
from tapeline.settings import Settings

log = structlog.get_logger("projections.problems")

SILENT_TICKS = 4
"""The log clock this many watchdog ticks behind the database clock counts as "not ticking"."""
SILENT_MIN_S = 20.0
"""...but never less than this many seconds (a busy machine delays a tick or two), seconds."""
JOB_LINKS = 5
"""Jobs linked by name on one problem line; the line's page link lists them all."""


@dataclass(frozen=True)
class Problem:
    """One line of the strip: `kind` (stable id, the CSS/test hook), `count`, `text` (plain words),
    `href` (the page listing everything concerned) and `jobs` (up to JOB_LINKS job ids to link)."""

    kind: str
    count: int
    text: str
    href: str
    jobs: tuple[str, ...] = field(default_factory=tuple)

    @property
    def job_links(self) -> list[tuple[str, str]]:
        """`[(job_id, "/jobs/<quoted id>")]` for the template."""
        return [(job, f"/jobs/{quote(job, safe='')}") for job in self.jobs]


def _jobs(items: list[dict[str, Any]]) -> tuple[str, ...]:
    seen: list[str] = []
    for item in items:
        job = item.get("job_id")
        if job and job not in seen:
            seen.append(job)
    return tuple(seen[:JOB_LINKS])


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def active_problems(stalls: list[dict[str, Any]], letters_pending: int, letters: list[dict[str, Any]],
                    providers: list[dict[str, Any]], log_clock: datetime | None, now: datetime, tick_s: float) -> list[Problem]:
    """The active problems, most urgent first; empty when all is well. Pure.

    Args:
        stalls: `tapeline.read.stalls` entries (kind, job_id, ...); kinds `waiting` and `needs_review`
            are not problems here (they wait for a backoff, a worker or a person by design).
        letters_pending: dead letters not yet replayed; letters: the newest of them
            (`tapeline.read.dead_letters(pending=True)`), each with `job_id` (None: a record naming no job).
        providers: `provider_overview` rows (provider, state).
        log_clock: the newest log clock of any partition (None: none yet); `now`: the database clock.
        tick_s: the watchdog's tick period, seconds; the log clock older than max(SILENT_TICKS x
            tick_s, SILENT_MIN_S) means no watchdog is ticking (or the projection is behind).
    """
    found: list[Problem] = []
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for stall in stalls:
        by_kind.setdefault(stall["kind"], []).append(stall)

    attempts = [s for kind in ATTEMPT_STALL_KINDS for s in by_kind.get(kind, [])]
    if attempts:
        found.append(Problem("stalled_attempts", len(attempts),
                             _plural(len(attempts), "attempt has", "attempts have") + " stalled (worker silent, "
                             "ffmpeg stuck or worker gone) and not been retried yet", "/stalled", _jobs(attempts)))
    silent_s = max(SILENT_TICKS * tick_s, SILENT_MIN_S)
    age_s = None if log_clock is None else (now - log_clock).total_seconds()
    if age_s is None or age_s > silent_s:
        found.append(Problem("watchdog_not_ticking", 1,
                             "no watchdog tick has reached the log yet: stalls and due retries are not acted on"
                             if age_s is None else
                             f"the log clock has not moved for {age_s:.0f} s: no watchdog is ticking (or the "
                             "projection is behind), so stalls and due retries are not acted on", "/stalled"))
    letters_n = letters_pending
    if letters_n:
        found.append(Problem("dead_letters", letters_n,
                             _plural(letters_n, "dead letter waits", "dead letters wait") + " for an operator "
                             "(replay once the cause is fixed)", "/dead-letters", _jobs(letters)))
    handoffs = by_kind.get("handoff", [])
    if handoffs:
        found.append(Problem("stalled_handoffs", len(handoffs),
                             _plural(len(handoffs), "queued stage", "queued stages") + " not picked up by any "
                             "worker in time", "/stalled", _jobs(handoffs)))
    missing = by_kind.get("expected_work_missing", [])
    if missing:
        found.append(Problem("expected_work_missing", len(missing),
                             _plural(len(missing), "upload has", "uploads have") + " not become a job",
                             "/stalled", _jobs(missing)))
    open_ = sorted(p["provider"] for p in providers if p.get("state") not in (None, "closed"))
    if open_:
        found.append(Problem("providers_open", len(open_),
                             _plural(len(open_), "publish provider is", "publish providers are") + " failing, "
                             f"circuit breaker open ({', '.join(open_)}): publishes to it wait",
                             "/jobs?stage=publish"))
    return found


def read_facts(conn: psycopg.Connection, settings: Settings) -> dict[str, Any]:
    """The inputs of `active_problems` from the projections (dict rows): stalls, the pending dead
    letters' count and newest 50, providers, the newest log clock and the database clock."""
    clock = read.log_clock_latest(conn)
    return {"stalls": read.stalls(conn), "letters_pending": read.dead_letter_counts(conn)["pending"],
            "letters": read.dead_letters(conn, pending=True, limit=50),
            "providers": provider_overview(conn, settings), "log_clock": clock["latest"], "now": clock["db_now"],
            "tick_s": settings.tick_s}


def problems_now(pool_getter: Callable[[], Any], settings: Settings) -> dict[str, Any]:
    """`{"problems": [Problem, ...], "error": None}` for the page being rendered, read with a
    connection of the read pool; `{"problems": [], "error": text}` when the projections cannot be
    read (the page itself still renders). Never raises for a database error."""
    try:
        with pool_getter().connection(timeout=5.0) as conn:
            return {"problems": active_problems(**read_facts(conn, settings)), "error": None}
    except Exception as exc:  # noqa: BLE001 - the strip must never take a page down
        log.warning("dashboard: active problems unreadable", error=str(exc))
        return {"problems": [], "error": f"active problems unreadable: {exc}"}


def problem_json(problem: Problem) -> dict[str, Any]:
    """One problem as JSON: kind, count, text, href and `jobs` `[{job_id, href}]`. Pure."""
    return {"kind": problem.kind, "count": problem.count, "text": problem.text, "href": problem.href,
            "jobs": [{"job_id": job, "href": href} for job, href in problem.job_links]}


def problems_router(pool_getter: Callable[[], Any], settings: Settings) -> APIRouter:
    """`GET /api/problems`: `{"problems": [problem_json, ...], "error": null | text}`, what the
    strip shows (200 even when the projections cannot be read: then `error` says why)."""
    router = APIRouter()

    @router.get("/api/problems", tags=["operations"])
    def get_problems() -> dict[str, Any]:
        """The active problems the dashboard's strip shows: stalled attempts, the watchdog not ticking,
        dead letters pending, stalled handoffs, uploads that never became jobs and open provider
        breakers, each with a count, plain words, the page listing them and up to five of the jobs."""
        found = problems_now(pool_getter, settings)
        return {"problems": [problem_json(p) for p in found["problems"]], "error": found["error"]}

    return router

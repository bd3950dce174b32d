"""The dashboard's active problems (issue 23 item 4): the conditions the alerts watch
(compose/alerts.yml), read from the projections and shown at the top of every page, each with a
count, plain words and links to the jobs concerned.

`active_problems` decides from facts and `now` (pure); `read_facts` gathers the facts from
PostgreSQL (projections.read_model and provider_status); `problems_now` is what the page renderer calls, and
`problems_router` serves the same as `GET /api/problems`, which static/dashboard.js polls to keep the
strip current between page loads.

Every alert of compose/alerts.yml has its line here (the alert waits its `for:`, the strip shows at
once), except two that are a rate of a line already shown: TapelineDeadLettersGrowing (the
`dead_letters` line's count) and TapelineStallsFrequent (stalls already retried: no job waits on an
operator). TapelineWatchdogBlind is the `projection_lagging` line's cause and effect (a watchdog is
blind while the projection is behind). The region B alerts (group `tapeline-region-b`) have no line:
region B is a standby, its figures come from its media replicator, not from these projections, and
the overview's Region replication panel shows them, marked past the same thresholds
(projections/region_panel.py). The thresholds below are the alerts' own (checked by
tests/unit/test_problems.py against compose/alerts.yml).
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
from projections import read_model as read
from tapeline.settings import Settings

log = structlog.get_logger("projections.problems")

SILENT_TICKS = 4
"""The log clock this many watchdog ticks behind the database clock counts as "not ticking"."""
SILENT_MIN_S = 20.0
"""...but never less than this many seconds (a busy machine delays a tick or two), seconds."""
JOB_LINKS = 5
"""Jobs linked by name on one problem line; the line's page link lists them all."""
ALERT_LINES: dict[str, str | None] = {
    "TapelineAttemptsStalled": "stalled_attempts", "TapelineHandoffStalled": "stalled_handoffs",
    "TapelineExpectedWorkMissing": "expected_work_missing", "TapelineDeadLettersPending": "dead_letters",
    "TapelineProjectionLagging": "projection_lagging", "TapelineStorageNearLimit": "storage_near_limit",
    "TapelineStorageFull": "storage_full", "TapelineProviderBreakerOpen": "providers_open",
    "TapelineWatchdogNotTicking": "watchdog_not_ticking", "TapelineWebhookEndpointsFailing": "webhook_endpoints_failing",
    "TapelineWebhookEndpointDisabled": "webhook_endpoints_disabled",
    # rates or causes of a line above (see the module docstring)
    "TapelineDeadLettersGrowing": None, "TapelineStallsFrequent": None, "TapelineWatchdogBlind": None,
    # region B: the overview's Region replication panel (see the module docstring)
    "TapelineRegionLagSeconds": None, "TapelineRegionLagEvents": None, "TapelineRegionObjectsPendingTooLong": None,
    "TapelineRegionMirrorHeartbeatStale": None, "TapelineRegionReplicatorDown": None,
    "TapelineRegionLagNotMeasured": None,
}
"""Each alert of compose/alerts.yml and the strip line that shows its condition (None: see above)."""
STORAGE_NEAR = 0.9
"""The bucket at this fraction of `storage_limit_bytes` is a problem (TapelineStorageNearLimit)."""
LAG_S = 60.0
"""The projection more than this many seconds behind the log is a problem (TapelineProjectionLagging)."""


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
                    providers: list[dict[str, Any]], log_clock: datetime | None, now: datetime, tick_s: float, *,
                    lag_s: float | None = None, storage: tuple[int, int] | None = None,
                    endpoints: list[dict[str, Any]] = ()) -> list[Problem]:
    """The active problems, most urgent first; empty when all is well. Pure.

    Args:
        stalls: `projections.read_model.stalls` entries (kind, job_id, ...); kinds `waiting` and `needs_review`
            are not problems here (they wait for a backoff, a worker or a person by design).
        letters_pending: dead letters not yet replayed; letters: the newest of them
            (`projections.read_model.dead_letters(pending=True)`), each with `job_id` (None: a record naming no job).
        providers: `provider_overview` rows (provider, state).
        log_clock: the newest log clock of any partition (None: none yet); `now`: the database clock.
        tick_s: the watchdog's tick period, seconds; the log clock older than max(SILENT_TICKS x
            tick_s, SILENT_MIN_S) means no watchdog is ticking (or the projection is behind).
        lag_s: age of the oldest committed event the projection has not applied, seconds (None:
            not measured); over LAG_S it is a problem.
        storage: (the bucket's bytes, storage_limit_bytes), None when no limit is set or it was not
            measured; at STORAGE_NEAR of the limit it is a problem, at the limit uploads are refused.
        endpoints: `webhook_endpoints_in_trouble` rows (endpoint_id, submitter, enabled,
            failing_since, jobs: the job ids of its deliveries not delivered since): enabled ones are
            failing without a success, disabled ones were disabled by the notifier for failing.
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
    if lag_s is not None and lag_s > LAG_S:
        found.append(Problem("projection_lagging", 1,
                             f"the projections are {lag_s:.0f} s behind the log: pages show an old state and the "
                             "watchdog judges no stall until they catch up", "/"))
    if storage is not None and storage[1] > 0 and storage[0] >= STORAGE_NEAR * storage[1]:
        used, limit = storage
        full = used >= limit
        found.append(Problem("storage_full" if full else "storage_near_limit", 1,
                             f"object storage is at {100 * used / limit:.0f} % of its budget "
                             f"({used} of {limit} bytes): "
                             + ("new uploads are refused (507) until space is freed or the limit raised" if full
                                else "at 100 % new uploads are refused"), "/"))
    for enabled, kind, what in ((True, "webhook_endpoints_failing", "failing every delivery"),
                                (False, "webhook_endpoints_disabled", "disabled after failing for too long")):
        group = [e for e in endpoints if bool(e["enabled"]) is enabled]
        if group:
            names = ", ".join(f"{e['endpoint_id']} of {e['submitter']}" for e in group[:JOB_LINKS])
            jobs = _jobs([{"job_id": job} for e in group for job in (e.get("jobs") or [])])
            found.append(Problem(kind, len(group),
                                 _plural(len(group), "customer webhook endpoint is", "customer webhook endpoints are")
                                 + f" {what} ({names}): its customers are not told about the jobs"
                                 + ("; `tapeline webhooks enable` resumes it" if not enabled else
                                    "; deliveries are retried for about a day"), "/webhooks", jobs))
    return found


@dataclass(frozen=True)
class Sources:
    """Where the facts that are not in the projections come from (`tapeline serve` wires both):
    `lag(conn)` measures the projection lag (`LagReport.as_dict()`: `seconds`, ...; Kafka), and
    `storage_bytes()` the bucket's bytes (S3, cached; None: no storage limit set). Either may raise:
    the strip then says that fact is unknown and shows the rest."""

    lag: Callable[[psycopg.Connection], dict[str, Any]] | None = None
    storage_bytes: Callable[[], int] | None = None


def read_facts(conn: psycopg.Connection, settings: Settings, sources: Sources = Sources()) -> tuple[dict[str, Any], list[str]]:
    """The inputs of `active_problems` (dict rows): stalls, the pending dead letters' count and
    newest 50, providers, the newest log clock and the database clock, webhook endpoints in trouble
    (from the projections), the projection lag and the bucket's bytes (from `sources`); and what
    could not be measured, in words (a failing source never hides the other facts)."""
    clock = read.log_clock_latest(conn)
    facts: dict[str, Any] = {
        "stalls": read.stalls(conn), "letters_pending": read.dead_letter_counts(conn)["pending"],
        "letters": read.dead_letters(conn, pending=True, limit=50),
        "providers": provider_overview(conn, settings), "log_clock": clock["latest"], "now": clock["db_now"],
        "tick_s": settings.tick_s, "endpoints": read.webhook_endpoints_in_trouble(conn, JOB_LINKS)}
    unknown: list[str] = []
    if sources.lag is not None:
        try:
            facts["lag_s"] = sources.lag(conn)["seconds"]
        except Exception as exc:  # noqa: BLE001 - one unmeasurable fact must not hide the others
            unknown.append(f"projection lag unmeasurable: {exc}")
    limit = settings.storage_limit_bytes
    if sources.storage_bytes is not None and limit is not None:
        try:
            facts["storage"] = (sources.storage_bytes(), limit)
        except Exception as exc:  # noqa: BLE001 - as above
            unknown.append(f"object storage unmeasurable: {exc}")
    return facts, unknown


def problems_now(pool_getter: Callable[[], Any], settings: Settings, sources: Sources = Sources()) -> dict[str, Any]:
    """`{"problems": [Problem, ...], "error": None | text}` for the page being rendered, read with a
    connection of the read pool; `error` says what could not be read or measured (with no problems
    when the projections themselves cannot be read: the page itself still renders). Never raises
    for a database, Kafka or S3 error."""
    try:
        with pool_getter().connection(timeout=5.0) as conn:
            facts, unknown = read_facts(conn, settings, sources)
            return {"problems": active_problems(**facts), "error": "; ".join(unknown) or None}
    except Exception as exc:  # noqa: BLE001 - the strip must never take a page down
        log.warning("dashboard: active problems unreadable", error=str(exc))
        return {"problems": [], "error": f"active problems unreadable: {exc}"}


def problem_json(problem: Problem) -> dict[str, Any]:
    """One problem as JSON: kind, count, text, href and `jobs` `[{job_id, href}]`. Pure."""
    return {"kind": problem.kind, "count": problem.count, "text": problem.text, "href": problem.href,
            "jobs": [{"job_id": job, "href": href} for job, href in problem.job_links]}


def problems_router(pool_getter: Callable[[], Any], settings: Settings, sources: Sources = Sources()) -> APIRouter:
    """`GET /api/problems`: `{"problems": [problem_json, ...], "error": null | text}`, what the
    strip shows (200 even when the projections cannot be read: then `error` says why)."""
    router = APIRouter()

    @router.get("/api/problems", tags=["operations"])
    def get_problems() -> dict[str, Any]:
        """The active problems the dashboard's strip shows: stalled attempts, the watchdog not ticking,
        dead letters pending, stalled handoffs, uploads that never became jobs, open provider breakers,
        the projection lagging, object storage near or at its limit, and customer webhook endpoints
        failing or disabled, each with a count, plain words, the page listing them and up to five of
        the jobs concerned."""
        found = problems_now(pool_getter, settings, sources)
        return {"problems": [problem_json(p) for p in found["problems"]], "error": found["error"]}

    return router

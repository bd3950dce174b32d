"""The read model: every query over the projections that the CLI (`cli/job_commands.py`,
`cli/operator_commands.py`), the read API and dashboard (`projections/api*.py`) and the region
failover read, on a read-only session (`open_reader`). Rows are shaped for display by pure
functions: `projections/presenter.py` (the job summary, percent done, the timeline's words),
`domain/policy/stall.py` the stalled rows. (The processors and the HTTP intake read through their
own job store sessions: the named queries of `projections/sql/queries.sql`.)"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg

from domain import pipeline
from domain.diagnosis import diagnose
from domain.policy.stall import StallThresholds, attempt_suspect
from domain.policy.tool_state import explain_tool_state, tool_evidence
from tapeline.postgres import connect, q
from domain.errors import ConfigurationError
from tapeline.rows import TierBacklog, letter_attempts, tier_backlogs  # noqa: F401 (pure; re-exported)
from tapeline.settings import Settings

class ProjectionMissing(ConfigurationError):
    """The projection schema holds no tables yet: never migrated, or its processors are starting and
    have not migrated it yet."""


def open_reader(settings: Settings) -> psycopg.Connection:
    """An autocommit connection (dict rows) to the projection schema. Raises `ProjectionMissing` (a
    `ConfigurationError`) when the schema holds no projection yet (never migrated, or missing), instead of failing later
    with `UndefinedTable` on the first read."""
    conn = connect(settings.database_url, schema=settings.db_schema, autocommit=True)
    conn.row_factory = psycopg.rows.dict_row
    if conn.execute(q("projection_missing")).fetchone()["missing"]:
        conn.close()
        raise ProjectionMissing(f"projection schema {settings.db_schema} has no tables yet: start the projector "
                                 "(`tapeline run`) or run `tapeline migrate`")
    return conn


def job_row(conn: psycopg.Connection, job_id: str) -> dict[str, Any] | None:
    """One job's `job_state` row with `checkpointed_s` (`with_checkpoints`), or None."""
    row = conn.execute(q("job_status"), {"job_id": job_id}).fetchone()
    return None if row is None else with_checkpoints(conn, [row])[0]


def with_checkpoints(conn: psycopg.Connection, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` (job_state rows), each with `checkpointed_s`: the media seconds its current stage holds
    in applied checkpoints (the least, over its renditions, of the end of the furthest segment;
    None without any), which `presenter.percent_done` counts as done. One query for all rows, and
    none when no row is in a stage that checkpoints while still active."""
    wanted = [r["job_id"] for r in rows if r["state"] in ("running", "queued", "retry_scheduled")
              and getattr(pipeline.BY_NAME.get(r["stage"]), "checkpoints", False)]
    done: dict[tuple[str, str], float] = {}
    if wanted:
        for c in conn.execute(q("checkpointed_media"), {"job_ids": wanted}).fetchall():
            key = (c["job_id"], c["stage"])
            done[key] = min(done.get(key, c["done_s"]), c["done_s"])
    return [{**r, "checkpointed_s": done.get((r["job_id"], r["stage"]))} for r in rows]


def timeline(conn: psycopg.Connection, job_id: str) -> list[dict[str, Any]]:
    """Every event of a job in log order with its attempt, broker time and evidence flags."""
    return conn.execute(q("job_timeline"), {"job_id": job_id}).fetchall()


def job_source(conn: psycopg.Connection, job_id: str, same_limit: int = 20) -> dict[str, Any] | None:
    """What the job was made from, for the job page and `/api/jobs/{id}` (None for an unknown job).

    Shape: filename, size_bytes, sha256 (the upload's, else the job row's), uploaded_at (ISO broker
    time), and from intake's probe (`JobAccepted.media`; None before intake ran): container, video_codec,
    audio_codec, width and height (px, coded), display (`WxH`, after rotation), rotation (deg), fps,
    frames, video_duration_s and audio_duration_s (each stream's own, s), bit_rate_bps, handling (what
    the transcode does about what is unusual); same_source: up to `same_limit` other jobs of the same
    sha256, newest first (job_id, state, stage, attempts, error_class, reason, created_at, completed_at).
    """
    row = conn.execute(q("job_source"), {"job_id": job_id}).fetchone()
    if row is None:
        return None
    sha256 = row["upload_sha256"] or row["source_sha256"]
    media = row["media"] or {}
    source: dict[str, Any] = {
        "filename": row["filename"], "size_bytes": row["upload_size_bytes"] or row["source_size_bytes"],
        "sha256": sha256, "uploaded_at": _iso(row["uploaded_at"]),
        "container": media.get("format_name"), "video_codec": media.get("video_codec"),
        "audio_codec": media.get("audio_codec"), "width": media.get("width"), "height": media.get("height"),
        "display": f"{media['display_width']}x{media['display_height']}" if media.get("display_width") else None,
        "rotation": media.get("rotation"), "fps": media.get("fps"), "frames": media.get("frames"),
        "video_duration_s": media.get("duration_s"), "audio_duration_s": media.get("audio_duration_s"),
        "bit_rate_bps": media.get("bit_rate_bps"), "handling": media.get("handling"),
    }
    same = conn.execute(q("jobs_with_source"), {"sha256": sha256, "job_id": job_id, "limit": same_limit}).fetchall() \
        if sha256 else []
    source["same_source"] = [{**r, "created_at": _iso(r["created_at"]), "completed_at": _iso(r["completed_at"])}
                             for r in same]
    return source


def job_diagnosis(conn: psycopg.Connection, row: dict[str, Any], source: dict[str, Any] | None = None,
                  now: datetime | None = None) -> dict[str, Any]:
    """The job's diagnosis (`domain.diagnosis.diagnose` over its row, its applied events and the other
    jobs of its source, `job_source`'s `same_source`) as a dict: summary, stall, permanent, why,
    action, same_source. `now`: the reader's clock (UTC), for ages."""
    if source is None:
        source = job_source(conn, row["job_id"]) or {}
    events = [e for e in timeline(conn, row["job_id"]) if e["applied"]]
    return diagnose(row, events, source.get("same_source", []), now or datetime.now(timezone.utc)).as_dict()


def replay_warning(conn: psycopg.Connection, dead_letter_id: str) -> str | None:
    """Why replaying this dead letter would most likely fail the same way again (the job's diagnosis
    calls it permanent), or None: not a job's dead letter, the job no longer dead-lettered, or a
    retry may pass."""
    letter = dead_letter(conn, dead_letter_id)
    row = job_row(conn, letter["job_id"]) if letter is not None and letter.get("job_id") else None
    if row is None or row["state"] != "dead_lettered":
        return None
    found = job_diagnosis(conn, row)
    return found["why"] if found["permanent"] else None


def recent_jobs(conn: psycopg.Connection, limit: int = 20) -> list[dict[str, Any]]:
    """The most recently updated jobs, with `checkpointed_s` (`with_checkpoints`)."""
    return with_checkpoints(conn, conn.execute(q("recent_jobs"), {"limit": limit}).fetchall())


def stalls(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """Every stalled attempt, stalled handoff, missing job, retry or hand-over still waiting, and job
    waiting in needs_review, as one list with a `kind` each.

    Each entry: kind, job_id, stage, attempt, last_progress_at (broker time, ISO), since_s (log clock),
    redrives (a handoff: times the watchdog re-sent its work item, since_s counting from the last;
    None for the other kinds), reason (why it waits, where known). A re-driven handoff stays listed
    until a worker claims it. Kind `waiting` (view `waiting_jobs`): an attempt that stalled or failed
    stays listed from its `RetryScheduled` until a worker claims the next attempt, with `attempt` the
    one that will run, `since_s` counted from the retry being scheduled (or the attempt queued) and
    `due_at` (ISO) the end of its backoff; past the handoff timeout it is a `handoff` instead.
    """
    found = []
    for row in conn.execute(q("stalled_attempts")).fetchall():
        found.append({"kind": row["kind"], "job_id": row["job_id"], "stage": row["stage"], "attempt": row["attempt"],
                      "worker": row["worker"], "last_progress_at": _iso(row["last_progress_at"]),
                      "progress_frames": row["progress_frames"], "since_s": round(row["since_s"] or 0.0, 3),
                      "redrives": None})
    for row in conn.execute(q("stalled_handoffs")).fetchall():
        found.append({"kind": "handoff", "job_id": row["job_id"], "stage": row["stage"], "attempt": row["attempt"],
                      "worker": None, "last_progress_at": _iso(row["queued_at"]), "progress_frames": None,
                      "since_s": round(row["since_s"], 3), "redrives": row["redrives"]})
    for row in conn.execute(q("expected_work_missing")).fetchall():
        found.append({"kind": "expected_work_missing", "job_id": row["job_id"], "stage": "intake", "attempt": 0,
                      "worker": None, "last_progress_at": _iso(row["uploaded_at"]), "progress_frames": None,
                      "since_s": round(row["since_s"], 3), "redrives": None})
    for row in conn.execute(q("waiting_jobs")).fetchall():
        due = row["retry_due_at"] if row["state"] == "retry_scheduled" else None
        found.append({"kind": "waiting", "job_id": row["job_id"], "stage": row["stage"],
                      "attempt": row["next_attempt"], "worker": None, "last_progress_at": _iso(row["waiting_since"]),
                      "progress_frames": None, "since_s": round(row["since_s"] or 0.0, 3), "redrives": None,
                      "reason": _waiting_reason(row), "due_at": _iso(due)})
    now = datetime.now(timezone.utc)  # waiting for a person: wall-clock age is what matters
    for row in jobs_in_state(conn, "needs_review"):
        since = row["completed_at"] or row["updated_at"]
        found.append({"kind": "needs_review", "job_id": row["job_id"], "stage": row["stage"],
                      "attempt": row["attempt"], "worker": None, "last_progress_at": _iso(since),
                      "progress_frames": None, "since_s": round((now - since).total_seconds(), 3),
                      "redrives": None, "reason": row["reason"]})
    return found


def suspect_attempts(conn: psycopg.Connection, job_id: str | None = None) -> list[dict[str, Any]]:
    """Running attempts not stalled yet but on their way (issue 45 item 1): the view
    `suspect_attempts` pre-selects, `domain/policy/stall.py` `attempt_suspect` decides with the
    thresholds the view carries (the stage's no-progress timeout, `stall_policy.suspect_fraction`).
    `job_id`: that job's only.

    Each entry, in `stalls`' shape: kind `suspect`, job_id, stage, attempt, worker,
    last_progress_at (ISO), progress_frames, since_s (seconds still, log clock), `suspect_of`
    (`no_progress`: counters still; `lease`: no heartbeat), `allowance_s`, `remaining_s` (seconds
    before the verdict), `reason` (e.g. "no progress for 95 s of the 120 s allowance", then what
    the tool's state says; for a silent worker, what it said at its last heartbeat), `tool_state` (the last heartbeat's `ToolState`, None without one) and
    `tool` (`explain_tool_state` of it)."""
    found = []
    for row in conn.execute(q("suspect_attempts")).fetchall():
        if job_id is not None and row["job_id"] != job_id:
            continue
        thresholds = StallThresholds(no_progress_timeout_s=row["no_progress_timeout_s"],
                                     suspect_fraction=row["suspect_fraction"])
        suspicion = attempt_suspect(leased_until=row["leased_until"], last_heartbeat_at=row["last_heartbeat_at"],
                                    progress_at=row["last_progress_at"], progress_grace_s=row["progress_grace_s"],
                                    now=row["log_now"], thresholds=thresholds)
        if suspicion is None:
            continue
        tool = explain_tool_state(row["tool_state"])
        if tool and suspicion.kind == "lease":  # the worker went silent: its tool's state is as old as its last word
            tool = f"at its last heartbeat {tool}"
        found.append({"kind": "suspect", "job_id": row["job_id"], "stage": row["stage"], "attempt": row["attempt"],
                      "worker": row["worker"], "last_progress_at": _iso(row["last_progress_at"]),
                      "progress_frames": row["progress_frames"], "since_s": round(suspicion.still_s, 3),
                      "redrives": None, "suspect_of": suspicion.kind, "allowance_s": round(suspicion.allowance_s, 3),
                      "remaining_s": round(suspicion.remaining_s, 3),
                      "reason": suspicion.words() + (f"; {tool}" if tool else ""),
                      "tool_state": row["tool_state"], "tool": tool})
    return found


def recent_stalls(conn: psycopg.Connection, window_s: float, job_id: str | None = None) -> list[dict[str, Any]]:
    """Attempt stalls the watchdog (or a rescuer, a failover) judged at most `window_s` seconds ago
    on the log clock (`TAPELINE_RECENT_STALLS_S`), newest first, so an operator arriving after the
    verdict still sees it (view `recent_attempt_stalls`). `job_id`: that job's only.

    Each entry, in `stalls`' shape: kind `recent_stall`, `stall_kind` (lease_expired, no_progress,
    worker_exited, region_lost), job_id, stage, attempt (the stalled one), `detected_at` (ISO: the
    verdict), since_s (seconds since the verdict), `still_s` (seconds still at the verdict),
    `outcome` ("retried as attempt 2", "dead-lettered: no attempts left"), `job_state`, `reason` (the
    stall, the outcome, the job now and what the tool's state says in one line), `tool_state` and
    `evidence` (`tool_evidence` lines)."""
    found = []
    for row in conn.execute(q("recent_attempt_stalls"), {"window_s": window_s}).fetchall():
        if job_id is not None and row["job_id"] != job_id:
            continue
        outcome = _stall_outcome(row)
        tool = explain_tool_state(row["tool_state"])
        reason = (f"{row['kind']} after {row['since_s'] or 0:.0f} s still: {outcome}; job now {row['job_state']}"
                  f" ({row['job_stage']} attempt {row['job_attempt']})" + (f"; {tool}" if tool else ""))
        found.append({"kind": "recent_stall", "stall_kind": row["kind"], "job_id": row["job_id"],
                      "stage": row["stage"], "attempt": row["attempt"], "worker": None,
                      "last_progress_at": None, "progress_frames": None, "detected_at": _iso(row["detected_at"]),
                      "since_s": round(row["age_s"] or 0.0, 3), "still_s": round(row["since_s"] or 0.0, 3),
                      "redrives": None, "outcome": outcome, "job_state": row["job_state"], "reason": reason,
                      "detail": row["detail"], "tool_state": row["tool_state"],
                      "evidence": tool_evidence(row["tool_state"])})
    return found


def _stall_outcome(row: dict[str, Any]) -> str:
    """What was done about a judged stall (a `recent_attempt_stalls` row), in words."""
    if row["acted_by"] == "RetryScheduled":
        return f"retried as attempt {row['next_attempt']}"
    if row["acted_by"] == "JobDeadLettered":
        return "dead-lettered: no attempts left"
    return "no retry recorded"


def stall_list(conn: psycopg.Connection, recent_s: float) -> list[dict[str, Any]]:
    """What `tapeline stalled`, `/api/stalled` and the Stalled page list: `stalls` (what is stalled
    or waiting now), then `suspect_attempts` (what the watchdog will judge next), then
    `recent_stalls` of the last `recent_s` seconds (what was judged, and done)."""
    return stalls(conn) + suspect_attempts(conn) + recent_stalls(conn, recent_s)


def job_stall_evidence(conn: psycopg.Connection, job_id: str) -> dict[str, Any] | None:
    """The evidence of the job's last attempt stall that carried a tool state (issue 45 item 2):
    stage, attempt, kind, detected_at (ISO), tool_state and `lines` (`tool_evidence`: what the
    state says, the last progress line, the last stderr lines); None when no stall carried one."""
    for row in reversed(timeline(conn, job_id)):
        payload = row.get("payload") or {}
        if row["event_type"] == "StallDetected" and row["applied"] and payload.get("tool_state"):
            return {"stage": row["stage"], "attempt": row["attempt"], "kind": payload.get("kind"),
                    "detected_at": _iso(row.get("broker_ts")), "tool_state": payload["tool_state"],
                    "lines": tool_evidence(payload["tool_state"])}
    return None


def _waiting_reason(row: dict[str, Any]) -> str:
    """One line for a `waiting_jobs` row: what it waits for, and why the previous attempt ended."""
    if row["state"] == "retry_scheduled":
        head = f"retry (attempt {row['next_attempt']}) waits for its backoff"
    else:
        head = f"attempt {row['next_attempt']} waits for a free worker"
    return f"{head}; before: {row['reason']}" if row["reason"] else head


def _iso(value) -> str | None:
    return value.isoformat() if value is not None else None


def dead_letters(conn: psycopg.Connection, reason: str | None = None, pending: bool = False,
                 limit: int = 1000) -> list[dict[str, Any]]:
    """Dead letters, newest first; `reason` filters on the error class, `pending` hides replayed and
    dismissed ones. `attempts` and `budget_attempts` as `letter_attempts` says."""
    rows = conn.execute(q("dead_letters_list"), {"reason": reason, "pending": pending, "limit": limit}).fetchall()
    return [letter_attempts(row) for row in rows]


def webhook_endpoints_in_trouble(conn: psycopg.Connection, jobs: int = 5) -> list[dict[str, Any]]:
    """Customer webhook endpoints failing without a success (enabled) or disabled by the notifier for
    failing (`failing_since` kept), oldest streak first: endpoint_id, submitter, enabled,
    failing_since, waiting (deliveries not delivered since the streak began) and `jobs` (up to
    `jobs` job ids of those deliveries, newest first). Never the secret."""
    return conn.execute(q("webhook_endpoints_in_trouble"), {"jobs": jobs}).fetchall()


def webhook_endpoints(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """Every webhook endpoint with its delivery counts (`webhook_endpoints_list`), never the secret."""
    return conn.execute(q("webhook_endpoints_list"), {"submitter": None}).fetchall()


def dead_letter(conn: psycopg.Connection, dead_letter_id: str) -> dict[str, Any] | None:
    """One dead letter, raw bytes included, or None; `attempts` as `letter_attempts` says."""
    row = conn.execute(q("dead_letter_by_id"), {"id": dead_letter_id}).fetchone()
    return letter_attempts(row) if row is not None else None


def jobs_in_state(conn: psycopg.Connection, state: str, limit: int = 1000) -> list[dict[str, Any]]:
    """Jobs in one state (e.g. needs_review), most recently updated first."""
    return with_checkpoints(conn, conn.execute(q("jobs_in_state"), {"state": state, "limit": limit}).fetchall())


def projection_lag(settings: Settings, conn: psycopg.Connection, timeout_s: float = 10.0):
    """The live projection's `tapeline.lag.LagReport`: events and seconds behind the log end, per
    partition (a short-lived read_committed consumer; raises `ServiceUnavailable` without Kafka)."""
    from tapeline.lag import lag_reader, measure

    consumer = lag_reader(settings)
    try:
        return measure(settings, conn, consumer, timeout_s=timeout_s)
    finally:
        consumer.close()


def attempts(conn: psycopg.Connection, job_id: str) -> list[dict[str, Any]]:
    """A job's attempts in log order (view `attempts`: worker, times, outcome, waste; broker time, seconds)."""
    return conn.execute(q("job_attempts"), {"job_id": job_id}).fetchall()


def attempt_history(conn: psycopg.Connection, job_id: str) -> list[dict[str, Any]]:
    """JSON-ready attempts of a job for `tapeline status JOB`, the API and the job page (one source for
    every count shown): stage, attempt, worker, outcome, error class, started_at / ended_at (broker
    time, ISO 8601 UTC), duration_s, wasted_s (net of the checkpoints a later attempt reused) and
    gross_wasted_s (seconds, 3 decimals), heartbeats (applied), segments (checkpoints written),
    reused_segments (of those, taken over by a later attempt); view `attempts`, migration 023."""
    return [{"stage": a["stage"], "attempt": a["attempt"], "worker": a["worker"], "outcome": a["outcome"],
             "error_class": a["error_class"], "started_at": _iso(a["started_at"]), "ended_at": _iso(a["ended_at"]),
             "duration_s": _round(a["duration_s"]), "wasted_s": _round(a["wasted_s"]),
             "gross_wasted_s": _round(a["gross_wasted_s"]), "heartbeats": a["heartbeats"],
             "segments": a["segments"], "reused_segments": a["reused_segments"]}
            for a in attempts(conn, job_id)]


def _round(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None


def stage_durations(conn: psycopg.Connection, job_id: str, now: datetime | None = None) -> list[dict[str, Any]]:
    """A job's queue wait, run time and attempts per stage (view `stage_durations`, seconds), each with
    `running`: whether an attempt of the stage runs now. The view counts only ended attempts; a
    running one's seconds so far (`now`, the reader's clock, UTC, less its broker-time start) are
    added to `run_s`, so a stage running for 30 s does not say it ran 0 s."""
    rows = conn.execute(q("job_stage_durations"), {"job_id": job_id}).fetchall()
    running = [a for a in attempts(conn, job_id) if a["outcome"] == "running" and a["started_at"] is not None]
    now = now or datetime.now(timezone.utc)
    out = []
    for row in rows:
        mine = [a for a in running if a["stage"] == row["stage"]]
        so_far = sum(max(0.0, (now - a["started_at"]).total_seconds()) for a in mine)
        out.append({**row, "run_s": round((row["run_s"] or 0.0) + so_far, 3), "running": bool(mine)})
    return out


def jobs_page(conn: psycopg.Connection, *, state: str | None = None, stage: str | None = None,
              priority: str | None = None, since: datetime | None = None, until: datetime | None = None,
              limit: int = 50, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """(one page of job rows, how many jobs match), newest last event first. `since`/`until` bound the
    broker time of the job's last applied event (`updated_at`, UTC), `until` exclusive; None: any."""
    params = {"state": state, "stage": stage, "priority": priority, "since": since, "until": until}
    rows = with_checkpoints(conn, conn.execute(q("jobs_page"), {**params, "limit": limit, "offset": offset}).fetchall())
    total = conn.execute(q("jobs_count"), params).fetchone()["n"]
    return rows, total


def jobs_by_state_and_stage(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """[{state, stage, n}] over every job."""
    return conn.execute(q("jobs_by_state_and_stage")).fetchall()


def throughput(conn: psycopg.Connection, now: datetime, minutes: int = 60) -> list[dict[str, Any]]:
    """Jobs created and ended per minute over the `minutes` minutes before `now` (broker time of the
    events, bucketed by UTC minute), oldest first, one entry per minute, zeros included:
    `{"minute": ISO, "created": n, "completed": n, "failed": n}` where failed counts every other end
    (failed, rejected, dead_lettered, needs_review, cancelled)."""
    end = now.replace(second=0, microsecond=0) + timedelta(minutes=1)
    start = end - timedelta(minutes=minutes)
    buckets = {start + timedelta(minutes=i): {"created": 0, "completed": 0, "failed": 0} for i in range(minutes)}
    window = {"since": start, "until": end}
    for row in conn.execute(q("jobs_created_by_minute"), window).fetchall():
        buckets[row["minute"]]["created"] += row["n"]
    for row in conn.execute(q("jobs_ended_by_minute"), window).fetchall():
        buckets[row["minute"]]["completed" if row["state"] == "completed" else "failed"] += row["n"]
    return [{"minute": minute.isoformat(), **counts} for minute, counts in sorted(buckets.items())]


def database_now(conn: psycopg.Connection) -> datetime:
    """The database's clock (UTC): the wall-clock "now" of throughput windows and ages of waits."""
    return conn.execute(q("database_now")).fetchone()["now"]


def progress_series(conn: psycopg.Connection, job_id: str) -> list[dict[str, Any]]:
    """Progress over time per attempt, for the job page's chart: one entry per (stage, attempt, claim
    token) that sent heartbeats, in log order, with `started_at` (broker time of its claim, ISO),
    `outcome` and `heartbeats` (applied ones: the attempts table's number; view `attempts`) and
    `points` (every heartbeat, late superseded ones flagged) [{at: ISO broker time, t_s: seconds since the claim,
    frames_done, frames_total, out_time_s: media seconds encoded, speed: x realtime, superseded}]."""
    claims = {(a["stage"], a["attempt"], a["claim_token"]): a for a in attempts(conn, job_id)}
    series: dict[tuple, dict[str, Any]] = {}
    for hb in conn.execute(q("job_heartbeats"), {"job_id": job_id}).fetchall():
        key = (hb["stage"], hb["attempt"], hb["claim_token"])
        claim = claims.get(key)
        if key not in series:
            series[key] = {"stage": hb["stage"], "attempt": hb["attempt"],
                           "started_at": _iso(claim["started_at"]) if claim else None,
                           "outcome": claim["outcome"] if claim else None,
                           "heartbeats": claim["heartbeats"] if claim else 0, "points": []}
        origin = claim["started_at"] if claim else None
        series[key]["points"].append({
            "at": _iso(hb["broker_ts"]),
            "t_s": round((hb["broker_ts"] - origin).total_seconds(), 3) if origin else None,
            "frames_done": hb["frames_done"], "frames_total": hb["frames_total"], "out_time_s": hb["out_time_s"],
            "speed": hb["speed"], "superseded": hb["superseded"]})
    return list(series.values())


def job_facts(conn: psycopg.Connection, row: dict[str, Any]) -> dict[str, Any]:
    """Everything the job page, `GET /api/jobs/{id}` and `tapeline status JOB --json` show about one job
    beside its summary (`presenter.job_summary`), read once in one place so no view holds a fact the
    others lack (issue 45 item 3; tests/integration/test_read_api.py compares the page and the JSON):
    `attempts` (`attempt_history`), `source` (`job_source`, with its `handling` note), `diagnosis`
    (`job_diagnosis`), `suspect` (the first of `suspect_attempts`, or None), `stall_evidence`
    (`job_stall_evidence`) and `checkpoints` (`checkpoints`, with each segment's `media_duration_s`)."""
    job_id = row["job_id"]
    source = job_source(conn, job_id)
    return {"attempts": attempt_history(conn, job_id), "source": source,
            "diagnosis": job_diagnosis(conn, row, source),
            "suspect": next(iter(suspect_attempts(conn, job_id)), None),
            "stall_evidence": job_stall_evidence(conn, job_id), "checkpoints": checkpoints(conn, job_id)}


def checkpoints(conn: psycopg.Connection, job_id: str) -> list[dict[str, Any]]:
    """A job's `CheckpointRecorded` evidence in log order: stage, attempt, broker_ts (ISO), applied,
    superseded, segment_index, rendition, object_key, sha256, frames, media_start_s and
    media_duration_s (seconds of media). Empty until checkpointed transcoding writes them."""
    return [{k: (_iso(v) if k == "broker_ts" else v) for k, v in row.items() if k != "claim_token"}
            for row in conn.execute(q("job_checkpoint_evidence"), {"job_id": job_id}).fetchall()]


def tier_backlog(conn: psycopg.Connection, window_s: float = 300.0) -> dict[str, TierBacklog]:
    """Every tier of `TIERS` (zeros for a tier with no jobs) -> its `TierBacklog`, completion
    rate measured over the last `window_s` seconds of the database clock (`tier_backlogs`)."""
    return tier_backlogs(conn.execute(q("tier_backlog"), {"window_s": window_s}).fetchall(), window_s)


def log_clock_latest(conn: psycopg.Connection) -> dict[str, datetime | None]:
    """`{"latest": the newest log clock of any partition (UTC; None before the first projected
    event), "db_now": the database's clock (UTC)}`. Without traffic the log clock moves only with the
    watchdog's ticks, so a latest far behind db_now means no watchdog ticks (or the projection lags)."""
    return dict(conn.execute(q("log_clock_latest")).fetchone())


def dead_letter_counts(conn: psycopg.Connection) -> dict[str, int]:
    """{"total": n, "pending": n neither replayed nor dismissed}."""
    return dict(conn.execute(q("dead_letter_counts")).fetchone())


"""Reads over the projections for the CLI (and later the read API)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import psycopg

from projections.fold import TERMINAL_STATES
from projections.sql import connect, q
from tapeline.settings import Settings

STAGE_SHARE = {"intake": (0.0, 0.05), "transcode": (0.05, 0.90), "publish": (0.90, 1.0)}
"""Share of the whole job each stage represents in `percent_done`."""


def open_reader(settings: Settings) -> psycopg.Connection:
    conn = connect(settings.database_url, schema=settings.db_schema, autocommit=True)
    conn.row_factory = psycopg.rows.dict_row
    return conn


def job_row(conn: psycopg.Connection, job_id: str) -> dict[str, Any] | None:
    return conn.execute(q("job_status"), {"job_id": job_id}).fetchone()


def percent_done(row: dict[str, Any]) -> float:
    """0-100: stages weighted by `STAGE_SHARE`, transcode progress from media seconds encoded."""
    if row["state"] in TERMINAL_STATES:
        return 100.0
    low, high = STAGE_SHARE.get(row["stage"], (0.0, 0.05))
    inside = 0.0
    if row["state"] == "running" and row["stage"] == "transcode" and row.get("source_duration_s"):
        inside = min(1.0, (row.get("progress_out_time_s") or 0.0) / row["source_duration_s"])
    return round(100.0 * (low + (high - low) * inside), 1)


def job_summary(row: dict[str, Any]) -> dict[str, Any]:
    """The JSON object `tapeline submit --json` and `status --json` print for one job."""
    summary: dict[str, Any] = {"job_id": row["job_id"], "state": row["state"], "stage": row["stage"],
                               "attempts": row["attempts"], "source_duration_s": row["source_duration_s"]}
    if row["state"] != "completed":
        summary["error_class"] = row["error_class"]
        summary["reason"] = row["reason"]
    summary["master_url"] = row["master_url"]
    summary["outputs"] = [{"name": r["name"], "width": r["width"], "height": r["height"], "url": r.get("url")}
                          for r in (row["renditions"] or [])]
    summary["percent"] = percent_done(row)
    summary["leased_until"] = row["leased_until"].isoformat() if row["leased_until"] else None
    summary["progress_frames"] = row["progress_frames"]
    summary["updated_at"] = row["updated_at"].isoformat()
    return summary


def timeline(conn: psycopg.Connection, job_id: str) -> list[dict[str, Any]]:
    """Every event of a job in log order with its attempt, broker time and evidence flags."""
    return conn.execute(q("job_timeline"), {"job_id": job_id}).fetchall()


def recent_jobs(conn: psycopg.Connection, limit: int = 20) -> list[dict[str, Any]]:
    return conn.execute(q("recent_jobs"), {"limit": limit}).fetchall()


def stalls(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """Every stalled attempt, stalled handoff, missing job and job waiting in needs_review, as one
    list with a `kind` each.

    Each entry: kind, job_id, stage, attempt, last_progress_at (broker time, ISO), since_s (log clock).
    """
    found = []
    for row in conn.execute(q("stalled_attempts")).fetchall():
        found.append({"kind": row["kind"], "job_id": row["job_id"], "stage": row["stage"], "attempt": row["attempt"],
                      "worker": row["worker"], "last_progress_at": _iso(row["last_progress_at"]),
                      "progress_frames": row["progress_frames"], "since_s": round(row["since_s"] or 0.0, 3)})
    for row in conn.execute(q("stalled_handoffs")).fetchall():
        found.append({"kind": "handoff", "job_id": row["job_id"], "stage": row["stage"], "attempt": row["attempt"],
                      "worker": None, "last_progress_at": _iso(row["queued_at"]), "progress_frames": None,
                      "since_s": round(row["since_s"], 3)})
    for row in conn.execute(q("expected_work_missing")).fetchall():
        found.append({"kind": "expected_work_missing", "job_id": row["job_id"], "stage": "intake", "attempt": 0,
                      "worker": None, "last_progress_at": _iso(row["uploaded_at"]), "progress_frames": None,
                      "since_s": round(row["since_s"], 3)})
    now = datetime.now(timezone.utc)  # waiting for a person: wall-clock age is what matters
    for row in jobs_in_state(conn, "needs_review"):
        since = row["completed_at"] or row["updated_at"]
        found.append({"kind": "needs_review", "job_id": row["job_id"], "stage": row["stage"],
                      "attempt": row["attempt"], "worker": None, "last_progress_at": _iso(since),
                      "progress_frames": None, "since_s": round((now - since).total_seconds(), 3),
                      "reason": row["reason"]})
    return found


def _iso(value) -> str | None:
    return value.isoformat() if value is not None else None


def dead_letters(conn: psycopg.Connection, reason: str | None = None, pending: bool = False,
                 limit: int = 1000) -> list[dict[str, Any]]:
    """Dead letters, newest first; `reason` filters on the error class, `pending` hides replayed ones."""
    return conn.execute(q("dead_letters_list"), {"reason": reason, "pending": pending, "limit": limit}).fetchall()


def dead_letter(conn: psycopg.Connection, dead_letter_id: str) -> dict[str, Any] | None:
    """One dead letter, raw bytes included, or None."""
    return conn.execute(q("dead_letter_by_id"), {"id": dead_letter_id}).fetchone()


def jobs_in_state(conn: psycopg.Connection, state: str, limit: int = 1000) -> list[dict[str, Any]]:
    """Jobs in one state (e.g. needs_review), most recently updated first."""
    return conn.execute(q("jobs_in_state"), {"state": state, "limit": limit}).fetchall()


def projection_lag(settings: Settings, conn: psycopg.Connection, timeout_s: float = 10.0):
    """The live projection's `projections.lag.LagReport`: events and seconds behind the log end, per
    partition (a short-lived read_committed consumer; raises `ServiceUnavailable` without Kafka)."""
    from confluent_kafka import KafkaException

    from projections.lag import lag_reader, measure
    from tapeline.errors import ServiceUnavailable

    consumer = lag_reader(settings)
    try:
        return measure(settings, conn, consumer, timeout_s=timeout_s)
    except KafkaException as exc:
        raise ServiceUnavailable(f"Kafka at {settings.kafka_bootstrap} did not answer: {exc}") from exc
    finally:
        consumer.close()


def attempts(conn: psycopg.Connection, job_id: str) -> list[dict[str, Any]]:
    """A job's attempts in log order (view `attempts`: worker, times, outcome, waste; broker time, seconds)."""
    return conn.execute(q("job_attempts"), {"job_id": job_id}).fetchall()


def attempt_history(conn: psycopg.Connection, job_id: str) -> list[dict[str, Any]]:
    """JSON-ready attempts of a job for `tapeline status JOB`: stage, attempt, worker, outcome, error class,
    started_at / ended_at (broker time, ISO 8601 UTC), duration_s and wasted_s (seconds, 3 decimals)."""
    return [{"stage": a["stage"], "attempt": a["attempt"], "worker": a["worker"], "outcome": a["outcome"],
             "error_class": a["error_class"], "started_at": _iso(a["started_at"]), "ended_at": _iso(a["ended_at"]),
             "duration_s": _round(a["duration_s"]), "wasted_s": _round(a["wasted_s"]), "heartbeats": a["heartbeats"],
             "segments": a["segments"]}
            for a in attempts(conn, job_id)]


def _round(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None


def stage_durations(conn: psycopg.Connection, job_id: str) -> list[dict[str, Any]]:
    """A job's queue wait, run time and attempts per stage (view `stage_durations`, seconds)."""
    return conn.execute(q("job_stage_durations"), {"job_id": job_id}).fetchall()

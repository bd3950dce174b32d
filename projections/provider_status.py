"""What `tapeline status` and `GET /api/providers` show about publish providers (migration 014).

One row per provider seen: its circuit breaker (`provider_state`, closed when it never changed),
the posts counted against its quotas in the per-minute and per-day windows (reservations of
`provider_calls`, plus projected `Published` events of jobs without one) beside the configured
limits, and its last `PublishDeferred` (`provider_waits`).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import psycopg

from tapeline.postgres import q
from tapeline.settings import Settings


def provider_overview(conn: psycopg.Connection, settings: Settings) -> list[dict[str, Any]]:
    """`[{provider, state, until, failures, probe_job, reason, http_status, version, changed_at,
    posts_minute, quota_minute, window_minute_s, posts_day, quota_day, window_day_s, last_wait,
    last_wait_until, last_wait_window, deferrals}]`, times as ISO strings (UTC), windows in seconds,
    quotas None when unset. `conn` has dict rows."""
    rows = conn.execute(q("provider_overview"), {"minute_s": settings.webhook_quota_window_s,
                                                 "day_s": settings.webhook_daily_window_s}).fetchall()
    found = []
    for row in rows:
        item = {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in row.items()}
        limits = (settings.webhook_quota, settings.webhook_daily_quota) if row["provider"] == "webhook" else (None, None)
        item.update(quota_minute=limits[0], window_minute_s=settings.webhook_quota_window_s,
                    quota_day=limits[1], window_day_s=settings.webhook_daily_window_s)
        found.append(item)
    return found


def _clock(iso: str) -> str:
    """`2026-11-29T12:00:05.123456+00:00` -> `12:00:05.123` (UTC, milliseconds). Pure."""
    return datetime.fromisoformat(iso).astimezone(timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def describe(item: dict[str, Any]) -> str:
    """One line for the terminal: state, cooldown, posts against quotas, last wait. Pure."""
    state = item["state"]
    if state == "open":
        state += f" until {_clock(item['until'])} UTC ({item['failures']} failure(s), HTTP {item['http_status'] or '-'})"
    elif state == "half_open":
        state += f": probe by job {item['probe_job']} until {_clock(item['until'])} UTC"

    def quota(posts: int, limit: int | None, window_s: float) -> str:
        return f"{posts}/{limit if limit is not None else '-'} per {window_s:g} s"

    line = (f"{item['provider']}: {state}; posts {quota(item['posts_minute'], item['quota_minute'], item['window_minute_s'])}, "
            f"{quota(item['posts_day'], item['quota_day'], item['window_day_s'])}")
    if item["last_wait"]:
        line += (f"; {item['deferrals']} deferral(s), last: {item['last_wait']}"
                 f"{' (' + item['last_wait_window'] + ')' if item['last_wait_window'] else ''} until "
                 f"{_clock(item['last_wait_until'])} UTC")
    return line

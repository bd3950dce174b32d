"""The dashboard's Region replication panel (overview page, `GET /api/overview` `region_replication`):
how far region B, the standby (docs/regions.md), is behind region A.

**Where the figures come from: the media replicator's own measurement**, read from its health port
(`GET http://<replicator_health_address>/health/deep`, its `region_replication` section:
regions/monitor.py). The replicator runs in region B and already measures the lag every
`replicate_measure_every_s` seconds for its Prometheus gauges, so the panel shows exactly what the
alerts see, and a page costs one small HTTP GET on the loopback (cached `CACHE_S` seconds, at most
`FETCH_TIMEOUT_S`), never a scan of region A's log (which `tapeline region status` does, seconds
long) nor a connection to region B's PostgreSQL. What it cannot say: anything while the replicator
is down. Then the panel says region B is not running (or its replicator is not), which is what an
operator needs to know first, when region B is set up (`region_b_set_up`: a `region_b_*` address is
configured, or region B's local stack home holds a `stack.json`). A one-region install (nothing of
region B set up, nothing answering) is no alarm: the panel says so in one neutral line
(`one_region`).

`panel` (pure) turns the section into what the template and static/dashboard.js show: a state, one
sentence and rows, each marked `over` past the threshold of its alert in compose/alerts.yml (the same
numbers: tests/unit/test_region_panel.py checks them). `RegionPanelSource` fetches and caches it.
With `replicate_health_port` 0, or region B not mirroring region A (`region_b_mirror` false), there is
no panel.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from tapeline.home import HomePaths
from tapeline.settings import Settings

LAG_S = 300.0
"""Region B's log more than this many seconds behind (A's clock) is marked (TapelineRegionLagSeconds)."""
LAG_EVENTS = 10000
"""More than this many committed events behind, summed over topics, is marked (TapelineRegionLagEvents)."""
PENDING_S = 1800.0
"""The oldest pending object older than this, seconds, is marked (TapelineRegionObjectsPendingTooLong)."""
HEARTBEAT_S = 120.0
"""The mirror's newest heartbeat in B older than this, seconds, is marked (TapelineRegionMirrorHeartbeatStale)."""
MEASURED_S = 300.0
"""The last whole measurement older than this, seconds, is marked (TapelineRegionLagNotMeasured)."""
FETCH_TIMEOUT_S = 1.0
"""Longest the panel waits for the replicator's /health/deep, seconds."""
CACHE_S = 5.0
"""How long one answer (or one failure) of the replicator is reused, seconds."""


def _at(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


def _age_s(text: str | None, now: datetime) -> float | None:
    at = _at(text)
    return None if at is None else max(0.0, (now - at).total_seconds())


def _row(name: str, value: str, over: bool = False) -> dict[str, Any]:
    return {"name": name, "value": value, "over": over}


def region_b_set_up(settings: Settings) -> bool:
    """Whether `settings` (region A's) say a region B exists: one of its addresses or its home is
    configured (`region_b_kafka_bootstrap`, `region_b_database_url`, `region_b_s3_endpoint`,
    `region_b_home`), or region B's local stack home (`Settings.for_region("b").home`) holds a
    `stack.json` (`tapeline stack up --region b` ran there). Reads one file's existence."""
    if any((settings.region_b_kafka_bootstrap, settings.region_b_database_url, settings.region_b_s3_endpoint,
            settings.region_b_home)):
        return True
    return HomePaths(Path(settings.for_region("b").home)).state.exists()


def panel(section: dict[str, Any] | None, error: str | None, address: str, now: datetime,
          set_up: bool = True) -> dict[str, Any]:
    """The panel from the replicator's `region_replication` section (None with `error` when it did not
    answer at `address`), ages at `now` (UTC); `set_up`: whether region B is set up at all
    (`region_b_set_up`). Pure.

    Returns `{"state", "text", "rows", "address"}`: `state` is `one_region` (nothing answers and no
    region B is set up: a neutral line, no alarm), `not_running` (region B is set up, its replicator
    does not answer), `not_measured` (it answers, no measurement yet) or `measured`; `rows` are
    `{"name", "value", "over"}` (`over`: past its alert's threshold), empty unless measured.
    """
    base = {"address": address, "rows": []}
    if section is None and not set_up:
        return {**base, "state": "one_region",
                "text": "one region: no region B is set up (no region_b_* address, no region B stack home), so "
                        "nothing is replicated; `tapeline stack up --region b` adds one"}
    if section is None:
        return {**base, "state": "not_running",
                "text": f"region B is not running (or its media replicator is not): no replicator answers at "
                        f"{address} ({error or 'no answer'}); start it with `tapeline stack up --region b`"}
    if section.get("measured_at") is None:
        return {**base, "state": "not_measured",
                "text": f"region B's replicator answers; its first measurement (every {section.get('every_s', 0):g} s) "
                        "is not done yet"}
    rows = []
    lag = section.get("lag")
    if lag is None:
        rows += [_row("events behind", "not measured", True), _row("seconds behind", "not measured", True)]
    else:
        events, seconds = lag["events_behind"], lag["seconds_behind"]
        rows.append(_row("events behind", f"{events}{'' if lag['exact'] else ' (at most)'}", events > LAG_EVENTS))
        rows.append(_row("seconds behind", "unknown" if seconds is None else f"{seconds:.0f} s",
                         seconds is not None and seconds > LAG_S))
    objects = section.get("objects")
    if objects is None:
        rows.append(_row("objects pending", "not measured", True))
    else:
        oldest = _age_s(objects.get("oldest_pending_named_at"), now)
        value = f"{objects['pending']}{'' if objects['exact'] else ' (at least)'}"
        if oldest is not None:
            value += f", oldest {oldest:.0f} s"
        rows.append(_row("objects pending", value, oldest is not None and oldest > PENDING_S))
        rows.append(_row("objects replicated", str(objects["replicated"])))
    heartbeat = _age_s(section.get("heartbeat_at"), now)
    rows.append(_row("mirror heartbeat", "none seen" if heartbeat is None else f"{heartbeat:.0f} s ago",
                     heartbeat is None or heartbeat > HEARTBEAT_S))
    complete = _age_s(section.get("complete_at"), now)
    measured = _at(section["measured_at"])
    rows.append(_row("measured", f"{measured:%Y-%m-%d %H:%M:%S} UTC"
                     + ("" if complete is None else f" (whole {complete:.0f} s ago)"),
                     complete is None or complete > MEASURED_S))
    over = [r["name"] for r in rows if r["over"]]
    text = ("region B is behind region A within its alerts' thresholds" if not over
            else "past an alert's threshold: " + ", ".join(over))
    if section.get("errors"):
        text += "; not measured: " + "; ".join(section["errors"])
    return {**base, "state": "measured", "text": text, "rows": rows}


class RegionPanelSource:
    """Fetches the replicator's `region_replication` section and builds the `panel`, reusing one
    answer (or failure) for `cache_s` seconds; thread-safe. `get()` never raises."""

    def __init__(self, address: str, cache_s: float = CACHE_S, timeout_s: float = FETCH_TIMEOUT_S,
                 set_up: Callable[[], bool] = lambda: True) -> None:
        self.address, self.cache_s, self.timeout_s, self.set_up = address, cache_s, timeout_s, set_up
        self._lock = threading.Lock()
        self._fetched: tuple[dict[str, Any] | None, str | None, bool] = (None, None, True)
        self._at = -float("inf")

    @classmethod
    def for_settings(cls, settings: Settings) -> "RegionPanelSource | None":
        """The source for `settings` (region A's), None when there is no panel (module docstring)."""
        address = settings.replicator_health_address
        return (cls(address, set_up=lambda: region_b_set_up(settings))
                if address and settings.region_b_mirror else None)

    def _fetch(self) -> tuple[dict[str, Any] | None, str | None]:
        try:
            with urllib.request.urlopen(f"http://{self.address}/health/deep", timeout=self.timeout_s) as resp:
                doc = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return None, str(getattr(exc, "reason", exc))
        section = doc.get("region_replication") if isinstance(doc, dict) else None
        if section is None:
            return None, f"{self.address} answers but is not the media replicator (no region_replication)"
        return section, None

    def get(self, now: datetime | None = None) -> dict[str, Any]:
        """The panel (`panel`), from an answer at most `cache_s` seconds old."""
        with self._lock:
            if time.monotonic() - self._at >= self.cache_s:
                self._fetched, self._at = (*self._fetch(), self.set_up()), time.monotonic()
            section, error, set_up = self._fetched
        return panel(section, error, self.address, now or datetime.now(timezone.utc), set_up)

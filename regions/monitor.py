"""Region B's replication lag as Prometheus metrics (docs/regions.md "Lag", docs/operating.md "Metrics").

The media replicator (`tapeline region replicate`, which runs in region B and knows both regions)
measures, every `replicate_measure_every_s` seconds in a background thread of its own (copying never
waits on it), what `tapeline region status` shows, with the same code: the log's lag
(`regions/measure.py` `measure_region_lag`, arithmetic `regions/mirror_lag.py`), the media
objects (`regions/object_audit.py` `measure_objects`) and the mirror's newest heartbeat in B
(`regions/mirror.py` `newest_heartbeat_ms`). Each measurement is bounded by
`replicate_measure_timeout_s` and the measurement's budget of A's offsets (200,000, as `region
status`).

It publishes them on the replicator's health port (`replicate_health_port`, `tapeline/health.py`):

- as gauges (`RegionGauges`, names below, units in the names) on `/metrics`, which Prometheus scrapes
  (compose/alerts.yml's region rules read them);
- as the `region_replication` section of `/health/deep` (`region_section`, JSON), which the
  dashboard's Region replication panel reads (projections/region_panel.py).

`region_section` and `RegionGauges.publish` are pure (no I/O); `measure_sample` does the reads and
`RegionMonitor` runs it periodically.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from domain.replication import ObjectTotals
from regions.mirror_lag import RegionLag
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.region_monitor")

SCAN_LIMIT = 200_000
"""Offsets of region A read per measurement, at most (`measure_region_lag`'s and `region status`'s budget)."""


@dataclass(frozen=True)
class RegionSample:
    """One measurement: `lag` (None: the log's lag could not be measured), `objects` and
    `objects_exact` (None: not measured; False: the unread tail was not read whole), `heartbeat_at`
    (broker time in B of the newest mirror heartbeat; None: none found or B's Kafka did not answer),
    `errors` (what could not be measured, in words), all read at `measured_at` (UTC)."""

    measured_at: datetime
    lag: RegionLag | None
    objects: ObjectTotals | None
    objects_exact: bool | None
    heartbeat_at: datetime | None
    errors: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Both the log's lag and the objects were measured."""
        return self.lag is not None and self.objects is not None


def _iso(at: datetime | None) -> str | None:
    return None if at is None else at.isoformat()


def region_section(sample: RegionSample | None, last_complete_at: datetime | None, every_s: float) -> dict[str, Any]:
    """The `region_replication` section of the replicator's `/health/deep` (JSON-ready; pure).

    `measured_at`: the last measurement (None: none yet); `complete_at`: the last one that measured
    both the log and the objects (what `tapeline_region_lag_measured_timestamp_seconds` says);
    `every_s`: the measurement period, seconds; `lag`: `RegionLag.as_dict()` (events and seconds
    behind, per topic; None when not measured); `objects`: `ObjectTotals.as_dict` at `measured_at`
    plus `exact` and `oldest_pending_named_at` (None when not measured); `heartbeat_at`: the newest
    mirror heartbeat in B (ISO, B's broker time; None: none found); `errors`: what was not measured.
    """
    if sample is None:
        return {"measured_at": None, "complete_at": _iso(last_complete_at), "every_s": every_s, "lag": None,
                "objects": None, "heartbeat_at": None, "errors": []}
    objects = None
    if sample.objects is not None:
        objects = {**sample.objects.as_dict(sample.measured_at), "exact": sample.objects_exact,
                   "oldest_pending_named_at": _iso(sample.objects.oldest_pending_named_at)}
    return {"measured_at": sample.measured_at.isoformat(), "complete_at": _iso(last_complete_at), "every_s": every_s,
            "lag": None if sample.lag is None else sample.lag.as_dict(), "objects": objects,
            "heartbeat_at": _iso(sample.heartbeat_at), "errors": list(sample.errors)}


class RegionGauges:
    """The region replication metrics on `registry` (the replicator's `HealthState.registry`).

    Gauges set from each measurement keep the last value measured; the two ages are computed when
    scraped, from the times measured, so they keep growing while nothing newer is measured.
    """

    def __init__(self, registry: CollectorRegistry, clock=time.time) -> None:
        """`clock`: seconds since the epoch (the ages' now; a test passes its own)."""
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._heartbeat_s: float | None = None
        self._oldest_pending_s: float | None = None
        self._topics: set[str] = set()
        self.events = Gauge("tapeline_region_lag_events", "Region B: committed events of region A not yet in B, per "
                            "mirrored topic (events; their sum is the total; an upper bound while "
                            "tapeline_region_lag_exact is 0)", ["topic"], registry=registry)
        self.seconds = Gauge("tapeline_region_lag_seconds", "Region B: how far B's copy of a mirrored topic is behind "
                             "A, on A's clock: A's newest committed record's time minus that of the newest record B "
                             "holds, seconds (the largest partition's)", ["topic"], registry=registry)
        self.exact = Gauge("tapeline_region_lag_exact", "Region B: 1 when every partition of A was counted within the "
                           "measurement's budget, 0 when some events-behind figures are upper bounds", registry=registry)
        self.pending = Gauge("tapeline_region_objects_pending", "Region B: media objects B's mirrored log names that B's "
                             "store does not hold with their recorded sha256 (objects)", registry=registry)
        self.pending_bytes = Gauge("tapeline_region_objects_pending_bytes", "Region B: bytes of the pending objects "
                                   "whose size the log states (bytes)", registry=registry)
        self.replicated = Gauge("tapeline_region_objects_replicated", "Region B: media objects copied to B's store and "
                                "verified (objects)", registry=registry)
        self.oldest_pending = Gauge("tapeline_region_objects_pending_oldest_seconds", "Region B: seconds since the "
                                    "record naming the oldest pending object reached B (0 when none is pending)",
                                    registry=registry)
        self.oldest_pending.set_function(self._oldest_pending_age)
        self.heartbeat_age = Gauge("tapeline_region_mirror_heartbeat_age_seconds", "Region B: seconds since the newest "
                                   "MirrorMaker 2 heartbeat seen in B (since this process started while none was "
                                   "seen)", registry=registry)
        self.heartbeat_age.set_function(self._heartbeat_age)
        self.measured = Gauge("tapeline_region_lag_measured_timestamp_seconds", "Region B: when the lag (events, "
                              "seconds and objects) was last measured whole, seconds since the epoch (0: not yet)",
                              registry=registry)
        self.measurements = Counter("tapeline_region_lag_measurements", "Region B: lag measurements made, by result "
                                    "(complete | failed: the log's lag or the objects not measured)", ["result"],
                                    registry=registry)
        for result in ("complete", "failed"):
            self.measurements.labels(result=result)

    def _oldest_pending_age(self) -> float:
        with self._lock:
            return 0.0 if self._oldest_pending_s is None else max(0.0, self._clock() - self._oldest_pending_s)

    def _heartbeat_age(self) -> float:
        with self._lock:
            since = self._started if self._heartbeat_s is None else self._heartbeat_s
        return max(0.0, self._clock() - since)

    def publish(self, sample: RegionSample) -> None:
        """Set the gauges from `sample` (no I/O). What `sample` did not measure keeps its last value;
        a topic no longer measured loses its series; the measured timestamp moves only when the
        sample is complete."""
        if sample.lag is not None:
            topics = sample.lag.by_topic()
            for gone in self._topics - set(topics):  # removed, not cleared: a scrape never sees an empty set
                self.events.remove(gone)
                self.seconds.remove(gone)
            self._topics = set(topics)
            for topic, row in topics.items():
                self.events.labels(topic=topic).set(row["events_behind"])
                # unknown seconds (a partition not counted): the last known value is not kept, NaN says so
                self.seconds.labels(topic=topic).set(float("nan") if row["seconds_behind"] is None
                                                     else row["seconds_behind"])
            self.exact.set(1 if sample.lag.exact else 0)
        if sample.objects is not None:
            self.pending.set(sample.objects.pending)
            self.pending_bytes.set(sample.objects.pending_bytes)
            self.replicated.set(sample.objects.replicated)
            with self._lock:
                named_at = sample.objects.oldest_pending_named_at
                self._oldest_pending_s = None if named_at is None else named_at.timestamp()
        if sample.heartbeat_at is not None:
            with self._lock:
                self._heartbeat_s = max(self._heartbeat_s or 0.0, sample.heartbeat_at.timestamp())
        if sample.complete:
            self.measured.set(sample.measured_at.timestamp())
        self.measurements.labels(result="complete" if sample.complete else "failed").inc()


def measure_sample(source: Settings, target: Settings, *, timeout_s: float, scan_limit: int = SCAN_LIMIT) -> RegionSample:
    """Measure region B (`target`) against region A (`source`) once, with the code `region status`
    uses. A part that cannot be measured (a region's Kafka or B's PostgreSQL not answering) is None,
    and said in `errors`; never raises for an unreachable service."""
    from regions.measure import measure_region_lag
    from regions.object_audit import measure_objects
    from regions.mirror import mirrored_topics, newest_heartbeat_ms

    now = datetime.now(timezone.utc)
    errors: list[str] = []
    lag = objects = exact = None
    try:
        lag = measure_region_lag(source, target, mirrored_topics(source), scan_limit=scan_limit, timeout_s=timeout_s,
                                 now=now)
    except Exception as exc:  # noqa: BLE001 - a cluster that does not answer: said, not raised
        errors.append(f"log lag not measured: {type(exc).__name__}: {exc}"[:500])
    try:
        objects, exact = measure_objects(target, scan_limit=scan_limit, timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - as above
        errors.append(f"objects not measured: {type(exc).__name__}: {exc}"[:500])
    newest_ms = newest_heartbeat_ms(target, timeout_s=min(timeout_s, 5.0))
    heartbeat_at = None if newest_ms is None else datetime.fromtimestamp(newest_ms / 1000.0, timezone.utc)
    return RegionSample(now, lag, objects, exact, heartbeat_at, errors)


class RegionMonitor:
    """Measures every `every_s` seconds in a daemon thread and publishes to `gauges` and to `health`'s
    `region_replication` section, until `stop` is set."""

    SECTION = "region_replication"

    def __init__(self, source: Settings, target: Settings, health: Any, *, every_s: float, timeout_s: float) -> None:
        """`health`: a `tapeline.health.HealthState`; the gauges go on its registry."""
        self.source, self.target, self.health = source, target, health
        self.every_s, self.timeout_s = every_s, timeout_s
        self.gauges = RegionGauges(health.registry)
        self._last_complete: datetime | None = None
        self.thread: threading.Thread | None = None
        health.set_section(self.SECTION, region_section(None, None, every_s))

    def measure_once(self) -> RegionSample:
        """One measurement, published."""
        sample = measure_sample(self.source, self.target, timeout_s=self.timeout_s)
        self.gauges.publish(sample)
        if sample.complete:
            self._last_complete = sample.measured_at
        self.health.set_section(self.SECTION, region_section(sample, self._last_complete, self.every_s))
        if sample.errors:
            log.warning("region lag not measured whole", errors=sample.errors)
        return sample

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.measure_once()
            except Exception as exc:  # noqa: BLE001 - the measurement must never stop the replicator
                log.warning("region lag measurement failed", error=f"{type(exc).__name__}: {exc}"[:500])
            stop.wait(max(0.0, self.every_s - (time.monotonic() - started)))

    def start(self, stop: threading.Event) -> "RegionMonitor":
        self.thread = threading.Thread(target=self._loop, args=(stop,), name="tapeline-region-lag", daemon=True)
        self.thread.start()
        return self

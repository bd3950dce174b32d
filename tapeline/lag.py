"""Projection lag: how far a projection is behind the end of the log, per partition, in events and seconds.

Definitions, for each partition of each topic the projection reads (`<prefix>.jobs`, `<prefix>.uploads`, `<prefix>.dlq`,
and any other topic it has stored offsets for):

- log end: the partition's last stable offset (LSO), the end a `read_committed` reader can reach;
- stored: `projector_offsets.next_offset`, the first offset the projection has not applied (the log
  start when there is no row yet);
- `offsets` = max(0, LSO - stored). Transaction markers (one per committed or aborted transaction)
  and aborted records take offsets too, so this overstates the events behind;
- `events`: the committed records in [stored, LSO), counted by reading them read_committed (markers
  and aborted records are not delivered). Reading is bounded by `scan_limit` offsets per
  measurement: a partition that does not fit is not read past its first record and reports
  `events = offsets` with `exact = False` (an upper bound);
- `seconds` = now - broker time (LogAppendTime) of the oldest committed record not yet applied, 0
  when nothing is behind: how long that record has been waiting. `now` is the measuring machine's
  UTC clock; lag is a monitoring figure, not a decision, so unlike leases it may use a machine clock
  (NTP keeps it within milliseconds of the broker's on one host).

`measure` is what `tapeline status` prints; `LagObserver` runs it in a thread of the projector
process every few seconds and feeds the Prometheus gauges `tapeline_projection_lag_events` and
`tapeline_projection_lag_seconds` (labels topic, partition) of the process's `/metrics`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import psycopg
import structlog

from tapeline.postgres import connect, q
from domain.errors import ServiceUnavailable
from tapeline import kafka_scan
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.projector.lag")


@dataclass(frozen=True)
class PartitionLag:
    """Lag of one partition (see the module docstring for each definition)."""

    topic: str
    partition: int
    log_end: int  # last stable offset
    stored: int  # next offset the projection will apply
    offsets: int  # log_end - stored, markers included
    events: int  # committed records not yet applied (exact unless `exact` is False)
    seconds: float  # age of the oldest record not yet applied, seconds; 0 when none
    oldest_unapplied_at: datetime | None  # its broker time, UTC
    exact: bool = True


@dataclass(frozen=True)
class LagReport:
    """Every partition's lag at `measured_at` (UTC)."""

    measured_at: datetime
    partitions: list[PartitionLag] = field(default_factory=list)

    @property
    def events(self) -> int:
        """Events behind, summed over partitions."""
        return sum(p.events for p in self.partitions)

    @property
    def seconds(self) -> float:
        """The largest `seconds` of any partition: the oldest record not yet applied, anywhere."""
        return max((p.seconds for p in self.partitions), default=0.0)

    @property
    def exact(self) -> bool:
        return all(p.exact for p in self.partitions)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: totals and the partitions that are behind (`tapeline status --json`)."""
        return {"events": self.events, "seconds": round(self.seconds, 3), "exact": self.exact,
                "offsets": sum(p.offsets for p in self.partitions), "measured_at": self.measured_at.isoformat(),
                "partitions_behind": [
                    {"topic": p.topic, "partition": p.partition, "events": p.events, "offsets": p.offsets,
                     "seconds": round(p.seconds, 3), "exact": p.exact, "log_end": p.log_end, "stored": p.stored,
                     "oldest_unapplied_at": p.oldest_unapplied_at.isoformat() if p.oldest_unapplied_at else None}
                    for p in self.partitions if p.offsets > 0]}


def lag_reader(settings: Settings) -> Any:
    """The read_committed, assign-only consumer `measure` reads with (reusable across measurements)."""
    return kafka_scan.committed_reader(settings, "lag",
                                       **{"max.partition.fetch.bytes": 256 * 1024,  # small reads: it lives beside the projector
                                          "queued.max.messages.kbytes": 4096})


def measure(settings: Settings, conn: psycopg.Connection, consumer: Any, *, projection: str = "main",
            topics: list[str] | None = None, scan_limit: int = 10_000, timeout_s: float = 10.0,
            now: datetime | None = None) -> LagReport:
    """The lag of `projection` (stored offsets read on `conn`, in its schema) against the log.

    `consumer` is a read_committed consumer (`lag_reader`); it is reassigned here. `scan_limit`
    bounds the offsets read to count events exactly; `timeout_s` bounds the whole reading, seconds
    (a partition not finished in time reports its offsets as events, `exact` False). `now` defaults
    to the current UTC time, taken after reading. Raises `ServiceUnavailable` when Kafka does not
    answer (or a topic is missing).
    """
    try:
        return _measure(settings, conn, consumer, projection, topics, scan_limit, timeout_s, now)
    except ServiceUnavailable as exc:
        raise ServiceUnavailable(f"Kafka at {settings.kafka_bootstrap} did not answer: {exc}") from exc


def _measure(settings: Settings, conn: psycopg.Connection, consumer: Any, projection: str, topics: list[str] | None,
             scan_limit: int, timeout_s: float, now: datetime | None) -> LagReport:
    stored = {(r["topic"], r["partition"]): r["next_offset"] for r in _rows(conn, projection)}
    wanted = list(dict.fromkeys((topics or [settings.jobs_topic, settings.uploads_topic, settings.dlq_topic]) +
                                sorted({topic for topic, _ in stored})))
    span = kafka_scan.bounds(consumer, wanted, start_at=stored, timeout_s=timeout_s)  # stored (or log start) to LSO
    ends = {position: (span.start[position], span.stop[position]) for position in span.stop}
    behind = {tp: (start, end) for tp, (start, end) in ends.items() if end > start}
    counts, oldest, full = _scan(consumer, behind, scan_limit, timeout_s)
    moment = now or datetime.now(timezone.utc)
    report = []
    for (topic, partition), (start, end) in sorted(ends.items()):
        offsets = max(0, end - start)
        key = (topic, partition)
        exact = offsets == 0 or key in full
        events = counts.get(key, 0) if exact else offsets
        first = oldest.get(key)
        seconds = max(0.0, (moment - first).total_seconds()) if first is not None and events else 0.0
        report.append(PartitionLag(topic, partition, end, start, offsets, events, seconds, first if events else None,
                                   exact))
    return LagReport(moment, report)


def _rows(conn: psycopg.Connection, projection: str) -> list[dict[str, Any]]:
    cursor = conn.cursor(row_factory=psycopg.rows.dict_row)
    return cursor.execute(q("offsets_of_projection"), {"projection": projection}).fetchall()


def _scan(consumer: Any, behind: dict[tuple[str, int], tuple[int, int]], scan_limit: int,
          timeout_s: float) -> tuple[dict, dict, set]:
    """Read [start, end) of each partition: (records counted, broker time of the first, partitions read fully).

    Partitions are read whole while they fit in `scan_limit` offsets (smallest first); the others
    only up to their first record, for its broker time.
    """
    counts: dict[tuple[str, int], int] = {}
    oldest: dict[tuple[str, int], datetime] = {}
    whole = kafka_scan.within_budget(behind, scan_limit)

    def take(message: Any) -> bool:
        key = (message.topic(), message.partition())
        counts[key] = counts.get(key, 0) + 1
        if key not in oldest:
            oldest[key] = datetime.fromtimestamp(kafka_scan.broker_millis(message) / 1000.0, tz=timezone.utc)
        return key in whole

    finished = kafka_scan.scan(consumer, behind, take, timeout_s)
    return counts, oldest, whole & finished


class LagObserver:
    """Measures the projection's lag every `interval_s` seconds in a daemon thread and publishes it to
    `health` (gauges and `/health/deep`). Own consumer and connection: never blocks the projector."""

    def __init__(self, settings: Settings, health: Any, projection: str = "main", interval_s: float = 5.0) -> None:
        self.settings, self.health, self.projection, self.interval_s = settings, health, projection, interval_s
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tapeline-projection-lag", daemon=True)
        self.last: LagReport | None = None

    def start(self) -> "LagObserver":
        self.thread.start()
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(timeout_s)

    def _run(self) -> None:
        consumer, conn = None, None
        try:
            consumer = lag_reader(self.settings)
            conn = connect(self.settings.database_url, schema=self.settings.db_schema, autocommit=True)
            while not self.stop_event.is_set():
                try:
                    self.last = measure(self.settings, conn, consumer, projection=self.projection,
                                        timeout_s=5.0)
                    self.health.set_projection_lag(self.last)
                except Exception as exc:  # a failed measurement is logged and retried; it must not stop the projector
                    log.warning("projection lag not measured", error=f"{type(exc).__name__}: {exc}")
                self.stop_event.wait(self.interval_s)
        except Exception as exc:  # cannot even connect: the projector runs on without a lag figure
            log.warning("projection lag observer stopped", error=f"{type(exc).__name__}: {exc}")
        finally:
            if consumer is not None:
                consumer.close()
            if conn is not None:
                conn.close()

"""Health and metrics of one processor process over HTTP (docs/design.md "Operating the platform").

`HealthState` is what a processor updates (thread-safe; every processor holds one, served or not,
so processors built directly in tests need nothing). `HealthServer` serves it:

- `GET /health/live`  -> 200 `{"status": "live"}` while the process runs;
- `GET /health/ready` -> 200 `{"status": "ready"}`, or 503 `{"status": "not_ready", "reason": ...}`
  while warming up (the loop has not started; the projector has not reached the end of every
  partition once), after the worker was fenced (until its next claim), or while draining (stop
  requested);
- `GET /health/deep`  -> JSON: role, instance, current attempt and its approximate lease left,
  last progress, jobs processed, last job at, uptime, ffmpeg version, projector lag (events and
  seconds behind the log end, measured by `tapeline.lag.LagObserver`), and the sections a process
  publishes (`set_section`: the media replicator's `region_replication`);
- `GET /metrics`      -> Prometheus text exposition of this process's own registry.

Server choice: the standard library's `ThreadingHTTPServer` in a daemon thread, with
prometheus-client (already a dependency) for the exposition. FastAPI and uvicorn are not
dependencies of the processors, and uvicorn run from a thread needs its signal handling disabled
and its own event loop, for five fixed GET routes; the read API of `tapeline serve` is where
FastAPI belongs.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from datetime import datetime, timezone
from functools import lru_cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from domain.codec import default_codec
from domain.policy.stall import STALL_KINDS


@lru_cache(maxsize=1)
def ffmpeg_version() -> str | None:
    """First line of `ffmpeg -version` (cached for the life of the process), or None without ffmpeg."""
    try:
        done = subprocess.run(["ffmpeg", "-version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


STAGE_BUCKETS_S = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)
"""Histogram buckets of `tapeline_stage_duration_seconds`: a short clip to an hour-long encode."""


def _utc_iso(ts: float | None) -> str | None:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat() if ts is not None else None


class HealthState:
    """One process's readiness, current attempt, progress and metrics. Every method is thread-safe
    and cheap; nothing here talks to Kafka, PostgreSQL or S3."""

    def __init__(self, role: str, instance: str | None = None) -> None:
        self.role, self.instance = role, instance or os.uname().nodename
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._ready = False
        self._draining = False
        self._fenced: str | None = None
        self._refused: str | None = None
        self._attempt: dict[str, Any] | None = None
        self._lease_renewed = 0.0  # monotonic time of the claim or the last heartbeat sent
        self._progress: dict[str, Any] | None = None
        self._jobs = 0
        self._last_job_at: float | None = None
        self._lag: int | None = None
        self._lag_checked = 0.0
        self.registry = CollectorRegistry(auto_describe=True)
        # Counters are declared without `_total`: prometheus-client appends it in the exposition.
        self.events_produced = Counter("tapeline_events_produced", "Events handed to a producer (aborted "
                                       "transactions included)", ["event_type"], registry=self.registry)
        self.events_consumed = Counter("tapeline_events_consumed", "Records consumed, by topic and event type "
                                       "(read from the writer schema's fingerprint; `undecodable` when unknown)",
                                       ["topic", "event_type"], registry=self.registry)
        self.attempts = Counter("tapeline_attempts", "Attempts finished by this process: outcome succeeded | failed | "
                                "yielded | fenced; error_class of a failure (empty otherwise)",
                                ["stage", "outcome", "error_class"], registry=self.registry)
        self.stage_duration = Histogram("tapeline_stage_duration_seconds", "Claim to committed completion of one "
                                        "attempt, seconds", ["stage", "outcome"], buckets=STAGE_BUCKETS_S,
                                        registry=self.registry)
        self.stalls = Counter("tapeline_stalls_detected", "Watchdog: stalls it committed a StallDetected for, by kind",
                              ["kind"], registry=self.registry)
        for kind in STALL_KINDS:
            self.stalls.labels(kind=kind)
        self.watchdog_ticks = Counter("tapeline_watchdog_ticks", "Watchdog: ticks run, by result (judged | blind: "
                                      "the projection was not caught up)", ["result"], registry=self.registry)
        self.watchdog_decisions = Counter("tapeline_watchdog_decisions", "Watchdog: run_once verdicts committed",
                                          ["verdict"], registry=self.registry)
        self.lease_age = Gauge("tapeline_lease_age_seconds", "Seconds since the running attempt's claim or last "
                               "committed heartbeat (worker monotonic clock; 0 when idle)", registry=self.registry)
        self.lease_age.set_function(lambda: self._lease_times()[0])
        self.lease_remaining = Gauge("tapeline_lease_remaining_seconds", "Approximate lease left of the running "
                                     "attempt (lease minus lease age; 0 when idle)", registry=self.registry)
        self.lease_remaining.set_function(lambda: self._lease_times()[1])
        self.ffmpeg_speed = Gauge("tapeline_ffmpeg_speed_ratio", "Last ffmpeg speed (x realtime)",
                                  registry=self.registry)
        self.jobs_processed = Counter("tapeline_jobs_processed", "Work items (intake: uploads) processed",
                                      ["role"], registry=self.registry)
        self.jobs_processed.labels(role=role)
        self.uptime = Gauge("tapeline_uptime_seconds", "Seconds since this process started", registry=self.registry)
        self.uptime.set_function(lambda: time.monotonic() - self._started)
        self.storage_bytes = Gauge("tapeline_storage_bytes", "Watchdog: the bucket's total bytes at its last "
                                   "measurement (only while storage_limit_bytes is set)", registry=self.registry)
        self.storage_limit_bytes = Gauge("tapeline_storage_limit_bytes", "Watchdog: storage_limit_bytes, the "
                                         "object storage budget (only while set)", registry=self.registry)
        self._projection_lag: dict[str, Any] | None = None
        self._sections: dict[str, Any] = {}
        self._cleanup: dict[str, Any] | None = None
        self.objects_removed = Counter("tapeline_cleanup_objects", "Watchdog cleanup: objects removed and multipart "
                                       "uploads aborted", ["action"], registry=self.registry)
        self.projection_lag_events = Gauge(
            "tapeline_projection_lag_events", "Projector: committed records between its stored offset and the last "
            "stable offset (offsets, transaction markers included, where too many to count)", ["topic", "partition"],
            registry=self.registry)
        self.projection_lag_seconds = Gauge(
            "tapeline_projection_lag_seconds", "Projector: seconds since the broker appended the oldest record it has "
            "not applied (0 when caught up)", ["topic", "partition"], registry=self.registry)
        self.webhook_posts = Counter("tapeline_webhook_posts", "Notifier: webhook POSTs made, by outcome "
                                     "(delivered | failed)", ["outcome"], registry=self.registry)
        self.webhook_post_seconds = Histogram("tapeline_webhook_post_seconds", "Notifier: one webhook POST, seconds",
                                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                              registry=self.registry)
        self.webhook_deliveries = Gauge("tapeline_webhook_deliveries", "Notifier: deliveries by state (pending | "
                                        "retry_scheduled | delivered | dead_lettered)", ["state"],
                                        registry=self.registry)
        self.webhook_endpoints_failing = Gauge("tapeline_webhook_endpoints_failing", "Notifier: enabled endpoints "
                                               "whose deliveries fail without a success since", registry=self.registry)
        self.webhook_endpoints_disabled = Gauge("tapeline_webhook_endpoints_disabled", "Notifier: endpoints "
                                                "disabled (by the notifier after failing too long, or by an operator)",
                                                registry=self.registry)
        self.webhook_endpoints_disabled_failing = Gauge(
            "tapeline_webhook_endpoints_disabled_failing", "Notifier: endpoints it disabled after failing for "
            "notify_disable_after_s, until enabled or removed", registry=self.registry)

    # Readiness.
    def mark_ready(self) -> None:
        with self._lock:
            self._ready = True

    def mark_draining(self) -> None:
        with self._lock:
            self._draining = True

    def mark_fenced(self, reason: str = "fenced") -> None:
        """A newer owner exists; not ready until the next claim (`set_attempt`) clears it."""
        with self._lock:
            self._fenced = reason

    def mark_refused(self, reason: str) -> None:
        """The cluster refused this process (`domain.errors.KafkaAccessRefused`: a certificate, password
        or ACL): not ready, with `reason`, for good (a new process must be started with other settings)."""
        with self._lock:
            self._refused = reason

    @property
    def is_ready(self) -> bool:
        return self.readiness()[0]

    def readiness(self) -> tuple[bool, str | None]:
        """(ready, reason when not)."""
        with self._lock:
            if self._refused:
                return False, self._refused
            if self._draining:
                return False, "draining: stop requested"
            if self._fenced:
                return False, self._fenced
            if not self._ready:
                return False, "warming up"
            return True, None

    # The current attempt.
    def set_attempt(self, job_id: str, stage: str, attempt: int, claim_token: str | None, lease_s: float) -> None:
        with self._lock:
            self._attempt = {"job_id": job_id, "stage": stage, "attempt": attempt, "claim_token": claim_token,
                             "lease_s": lease_s}
            self._lease_renewed = time.monotonic()
            self._progress = None
            self._fenced = None

    def lease_renewed(self) -> None:
        """A heartbeat was committed: the lease runs from now."""
        with self._lock:
            self._lease_renewed = time.monotonic()

    def _lease_times(self) -> tuple[float, float]:
        """(age, remaining) of the running attempt's lease, seconds; (0, 0) when idle."""
        with self._lock:
            if self._attempt is None:
                return 0.0, 0.0
            age = time.monotonic() - self._lease_renewed
            return age, max(0.0, self._attempt["lease_s"] - age)

    def clear_attempt(self) -> None:
        with self._lock:
            self._attempt = None

    def record_progress(self, frames: int, out_time_s: float, speed: float | None = None) -> None:
        with self._lock:
            self._progress = {"frames": frames, "out_time_s": out_time_s, "speed": speed, "at": time.time()}
        if speed is not None:
            self.ffmpeg_speed.set(speed)

    def job_done(self) -> None:
        with self._lock:
            self._jobs += 1
            self._last_job_at = time.time()
        self.jobs_processed.labels(role=self.role).inc()

    # Metric helpers.
    def produced(self, event_type: str) -> None:
        self.events_produced.labels(event_type=event_type).inc()

    def consumed(self, topic: str, event_type: str = "undecodable", count: int = 1) -> None:
        self.events_consumed.labels(topic=topic, event_type=event_type).inc(count)

    def consumed_messages(self, messages: Iterable[Any]) -> None:
        """Count Kafka messages (anything with `.topic()` and `.value()`) by topic and event type."""
        codec = default_codec()
        counts: dict[tuple[str, str], int] = {}
        for message in messages:
            key = (message.topic(), codec.event_type_of(message.value()) or "undecodable")
            counts[key] = counts.get(key, 0) + 1
        for (topic, event_type), count in counts.items():
            self.consumed(topic, event_type, count)

    def consumed_record(self, record: Any) -> None:
        """Count one record read through the event-log port (anything with `.topic` and `.value`
        attributes: `tapeline.ports.Record`) by topic and event type."""
        self.consumed(record.topic, default_codec().event_type_of(record.value) or "undecodable", 1)

    def count_attempt(self, stage: str, outcome: str, error_class: str = "",
                      duration_s: float | None = None) -> None:
        """outcome: succeeded | failed (the attempt's failure was committed; `error_class` says why) |
        yielded (handed over on shutdown) | fenced (nothing committed). `duration_s`, claim to
        completion, goes to the stage duration histogram."""
        self.attempts.labels(stage=stage, outcome=outcome, error_class=error_class).inc()
        if duration_s is not None:
            self.stage_duration.labels(stage=stage, outcome=outcome).observe(duration_s)

    def stall_detected(self, kind: str) -> None:
        self.stalls.labels(kind=kind).inc()

    def observe_lag(self, reader: Any, every_s: float = 5.0) -> None:
        """Projector: records behind, summed over the assignment (`reader.records_behind()`, a
        `tapeline.ports.AssignedReader`: cached high watermark minus position; approximate, transaction
        markers count). Refreshed at most every `every_s` seconds."""
        now = time.monotonic()
        if now - self._lag_checked < every_s:
            return
        self._lag_checked = now
        try:
            total = reader.records_behind()
        except Exception:  # lag is best-effort; the loop must never fail on it
            return
        with self._lock:
            self._lag = total

    def set_projection_lag(self, report: Any) -> None:
        """Projector: publish a `tapeline.lag.LagReport` (per-partition events and seconds behind the
        log end) to the lag gauges and `/health/deep`."""
        for p in report.partitions:
            labels = {"topic": p.topic, "partition": str(p.partition)}
            self.projection_lag_events.labels(**labels).set(p.events)
            self.projection_lag_seconds.labels(**labels).set(p.seconds)
        with self._lock:
            self._projection_lag = {"events": report.events, "seconds": round(report.seconds, 3),
                                    "exact": report.exact, "measured_at": report.measured_at.isoformat()}

    def set_cleanup(self, totals: dict[str, int], removed: int, aborted: int) -> None:
        """Watchdog: the cleanup totals since start (for `/health/deep`) and this tick's removals."""
        self.objects_removed.labels(action="removed").inc(removed)
        self.objects_removed.labels(action="aborted").inc(aborted)
        with self._lock:
            self._cleanup = dict(totals)

    def set_section(self, name: str, doc: Any) -> None:
        """Publish `doc` (JSON-ready) under `name` in `/health/deep`, replacing the previous one (the media
        replicator's `region_replication`, regions/monitor.py)."""
        with self._lock:
            self._sections[name] = doc

    def deep(self) -> dict[str, Any]:
        """The `/health/deep` document."""
        ready, reason = self.readiness()
        with self._lock:
            attempt = dict(self._attempt) if self._attempt else None
            if attempt:
                attempt["lease_left_s_approx"] = round(attempt["lease_s"] - (time.monotonic() - self._lease_renewed), 1)
            progress = dict(self._progress) if self._progress else None
            if progress:
                progress["at"] = _utc_iso(progress["at"])
            doc = {"role": self.role, "instance": self.instance, "pid": os.getpid(), "ready": ready, "reason": reason,
                   "current": attempt,
                   "lease_clock": "approximate: lease minus time since claim or last heartbeat, worker monotonic "
                                  "clock; the broker-time lease in the projection is authoritative",
                   "last_progress": progress, "jobs_processed": self._jobs, "last_job_at": _utc_iso(self._last_job_at),
                   "uptime_s": round(time.monotonic() - self._started, 3)}
            if self.role == "projector":
                doc["lag_records_approx"] = self._lag
                doc["projection_lag"] = self._projection_lag  # events and seconds behind, see tapeline/lag.py
            if self._cleanup is not None:
                doc["cleanup"] = self._cleanup  # watchdog: objects removed, multipart aborted, deferred, errors
            doc.update(self._sections)
        doc["ffmpeg_version"] = ffmpeg_version()
        return doc

    def metrics(self) -> bytes:
        return generate_latest(self.registry)


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def do_GET(self) -> None:  # the stdlib's name
        state = self.server.state
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/health/live":
            self._json(200, {"status": "live"})
        elif path == "/health/ready":
            ready, reason = state.readiness()
            if ready:
                self._json(200, {"status": "ready"})
            else:
                self._json(503, {"status": "not_ready", "reason": reason})
        elif path == "/health/deep":
            self._json(200, state.deep())
        elif path == "/metrics":
            self._send(200, CONTENT_TYPE_LATEST, state.metrics())
        else:
            self._json(404, {"error": f"no route {path!r}; try /health/live, /health/ready, /health/deep, /metrics"})

    def _json(self, code: int, body: dict[str, Any]) -> None:
        self._send(code, "application/json", json.dumps(body).encode())

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds would flood the logs
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], state: HealthState) -> None:
        self.state = state
        super().__init__(address, _Handler)


class HealthServer:
    """Serves a `HealthState` on `host:port` from a daemon thread (port 0: an ephemeral port, see `.port`)."""

    def __init__(self, state: HealthState, host: str = "127.0.0.1", port: int = 0) -> None:
        self.state = state
        self.httpd = _Server((host, port), state)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="tapeline-health", daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def start(self) -> "HealthServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

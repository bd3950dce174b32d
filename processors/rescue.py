"""Rescue at the speed of the crash: retry the attempt of a worker process that died, at once.

The lease covers a worker that stops answering (a dead host, a partition, a stopped process). A
worker that died on a host that survives is known dead at once by whoever watches it: the
supervisor of `tapeline run --role all` sees its child exit, and a worker restarted by systemd or
Kubernetes under its stable name finds what an earlier incarnation held (`tapeline/holdings.py`).
Either calls `Rescuer.rescue`, which

1. builds a transactional producer with the dead attempt's transactional id
   (`{app}.{stage}.{job_id}`): `init_transactions` fences the dead incarnation's producer and aborts
   a transaction it left open (so the lifecycle log's last stable offset moves on at once);
2. reads the job's row once the projection caught up with its partition; only when that row still
   shows the very claim running (same stage, attempt and claim token) does it go on;
3. lets the watchdog's rule decide (`processors.watchdog.run_once` with a stalled-attempt row of
   kind `worker_exited`): `StallDetected(worker_exited)` with the exit status, then within the
   attempt budget `RetryScheduled` + `StageQueued` + `WorkItem` at once (error class
   `worker_lost`), else `JobDeadLettered`;
4. commits those events in one transaction of that producer.

The events carry the same dedup keys the watchdog would write for that attempt, so a watchdog that
judged the same attempt at the same moment changes nothing twice. Consumer groups: workers leave
their group while busy (`processors/worker.py`, Step 5), so a dead busy worker holds no partition
and no static membership (`group.instance.id`) is needed; an idle worker's partitions move after
`kafka_session_timeout_ms`.
"""

from __future__ import annotations

import os
import signal
import threading
from datetime import datetime
from typing import Any

import structlog

from processors.runtime import AttemptIdentity, Runtime, transact
from processors.claim import attempt_transactional_id
from processors.watchdog import Verdict, run_once
from domain.errors import Fenced, ServiceUnavailable
from domain.policy.stall import stalled_row
from tapeline import holdings
from tapeline.holdings import Holding
from tapeline.ports import Clock, EventLog, EventLogError, JobStore
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.rescue")


def exit_detail(returncode: int | None) -> str:
    """How a process ended, for `StallDetected.detail`: `killed by SIGKILL`, `exited with code 1`."""
    if returncode is None:
        return "exited"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def worker_exited_row(job: dict[str, Any] | None, holding: Holding, detail: str, now: datetime) -> dict[str, Any] | None:
    """The stalled-attempt row (`stalled_attempts` shape, kind `worker_exited`) that `run_once`
    judges for `holding`, or None when the projected `job` no longer shows that claim running (it
    ended, was superseded, or never got projected). Pure; `since_s` is seconds since the attempt's
    last progress (else its last heartbeat) by `now`, 0 when it has neither."""
    if job is None or job["state"] != "running" or (job["stage"], job["attempt"]) != (holding.stage, holding.attempt) \
            or job.get("claim_token") != holding.claim_token:
        return None
    return stalled_row(job, "worker_exited", f"worker process {holding.pid} {detail}", now)


class Rescuer:
    """Rescues the holdings of dead worker processes, one at a time (thread-safe). Holds one
    `Runtime` (a projection reader and a last-stable-offset reader), built on the first rescue."""

    def __init__(self, settings: Settings, role: str = "rescuer", runtime: Runtime | None = None, *,
                 clock: Clock, events: EventLog | None = None, jobs: JobStore | None = None) -> None:
        """`runtime`: a processor's own (it then stays open on `close`); else one is built on first
        use over `events` and `jobs` (the Kafka and PostgreSQL adapters for `role` when not given),
        and closed by `close`. `clock`: what judges the time since the attempt's last progress, and
        stamps the events."""
        self.settings, self.role, self.clock = settings, role, clock
        self._events, self._jobs = events, jobs
        self._runtime, self._owns_runtime = runtime, runtime is None
        self._lock = threading.Lock()

    def rescue(self, holding: Holding, detail: str) -> str:
        """Retry `holding`'s attempt now (see the module). Returns the verdict: `retry`,
        `dead_letter`, or `ignore` (the projection no longer shows that claim running). Raises
        `ServiceUnavailable` when Kafka or the projection cannot answer (the lease path still holds)."""
        with self._lock:
            if self._runtime is None:
                self._runtime = Runtime(self.settings, self.role, events=self._events, jobs=self._jobs)
            runtime = self._runtime
            producer = runtime.events.transactional_producer(holding.transactional_id)  # fences the dead one
            job = runtime.job_row(holding.job_id)
            row = worker_exited_row(job, holding, detail, self.clock.now())
            if row is None:
                log.info("nothing to rescue: the attempt is no longer running", job_id=holding.job_id,
                         stage=holding.stage, attempt=holding.attempt)
                return Verdict.IGNORE.value
            result = run_once([row], [], [], {holding.job_id: job}, self.settings, runtime.recorded_by, clock=self.clock)
            transact(producer, lambda: runtime.produce(producer, result.outgoing), name="rescue")
            verdict = next(v for v, n in result.counts.items() if n)
            log.warning("attempt of a dead worker rescued", job_id=holding.job_id, stage=holding.stage,
                        attempt=holding.attempt, pid=holding.pid, detail=detail, verdict=verdict)
            return verdict

    def close(self) -> None:
        with self._lock:
            if self._runtime is not None and self._owns_runtime:
                self._runtime.close()
                self._runtime = None


def record_holding(settings: Settings, identity: AttemptIdentity) -> None:
    """With a stable `worker_name`: note on disk the attempt this process now holds (`identity`), so
    that whoever sees it die retries the attempt at once (`tapeline/holdings.py`)."""
    name = settings.worker_name
    if name:
        holdings.record(settings, name, Holding(
            pid=os.getpid(), job_id=identity.job_id, stage=identity.stage, attempt=identity.attempt,
            claim_token=identity.claim_token,
            transactional_id=attempt_transactional_id(settings, identity.stage, identity.job_id)))


def release_holding(settings: Settings) -> None:
    """This process holds no attempt any more (nothing to do without a `worker_name`)."""
    if settings.worker_name:
        holdings.release(settings, settings.worker_name, os.getpid())


def rescue_earlier_incarnations(settings: Settings, stage: str, runtime: Runtime, clock: Clock) -> None:
    """A worker restarted under its stable name (systemd, Kubernetes) retries at once what an
    earlier incarnation of that name held when it died, instead of leaving it to its lease.
    A rescue that cannot be made now (Kafka or the projection not answering) is left to the lease."""
    name = settings.worker_name
    if not name:
        return
    for holding in holdings.left_by_earlier_incarnations(settings, name, os.getpid()):
        try:
            Rescuer(settings, stage, runtime=runtime, clock=clock).rescue(holding, "died (found by its restarted worker)")
        except (ServiceUnavailable, EventLogError, Fenced) as exc:
            log.warning("could not rescue an earlier incarnation's attempt; its lease will", error=str(exc),
                        job_id=holding.job_id, attempt=holding.attempt)
            continue
        holdings.release(settings, name, holding.pid)

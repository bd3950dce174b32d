"""`tapeline region failover --to R`: move the job history to region R (docs/regions.md "Failover").

The steps, in order (each timed from the command's start, `FailoverReport.steps`):

1. `target_answers`: region R's Kafka and PostgreSQL answer (else `FailoverError`, nothing changed);
   its topics exist (`ensure_topics`, with `<prefix>.regions`).
2. `fenced`: a `RegionFailedOver` with the next region epoch is written to R's `<prefix>.regions`,
   and to the region left behind when its Kafka answers (a planned switch). From here on the left
   region's processors stop at their next check (`regions/authority.py`) and write nothing;
   a left region that comes back reads the fence from R. Run again after a crash, the command finds
   R already active and goes on with the steps below (each is idempotent).
3. `drained` (planned switch only): the left region's processors have stopped writing (`_wait_left_quiet`:
   its detached supervisor gone, its end offsets still for two region check intervals), then the
   mirror into R has copied every committed record of the left region (events behind 0,
   `regions/measure.py`), each waited for up to `drain_timeout_s`.
4. `mirror_stopped`: MirrorMaker 2 and the media replicator of R are stopped (R's own writes must
   not be mixed with the left region's, and the left region's objects are no longer reachable).
5. `projections_caught_up`: R's PostgreSQL is migrated and a projector folds R's log until it has
   applied everything (`tapeline/lag.py` events behind 0).
6. `lost_attempts_requeued`: every job R's projection shows `running` held an attempt in the left
   region: `domain/regions.py` `region_lost_row` and the watchdog's rule (`run_once`) write
   `StallDetected(region_lost)` + `RetryScheduled` + `StageQueued` + `WorkItem` in one transaction, so
   the next attempt starts in R at once, resumes from the checkpoints R holds, and uses no attempt.
   Jobs queued, waiting for a retry or between stages need nothing: their work items and
   retries are in R's log. A publish attempt that starts again reconciles first (provider lookup by
   idempotency key; `needs_review` when a post cannot be proven either way).
   `customers_told`: every job in flight (`domain/regions.py` `DELAYED_STATES`) gets a `JobDelayed`
   (one per job and epoch: a second run of the command adds none), which R's notifier sends to the
   job's submitter as `job.delayed`.
7. `processors_started`: R's `tapeline run --role all` in the background (pid and log under R's home;
   `tapeline stack down --region b` stops it), unless `start_processors` is False.
8. `accepting_uploads`: R's intake reports ready on its health port: an upload submitted to R is
   taken from here on.

Region B's consumer groups start from the beginning of its log (the mirror does not translate group
offsets into them): every work item and upload is read again and dropped by the workers' and the
intake's reconciliation (a job that exists, an attempt that is stale), never acted on twice.
"""

from __future__ import annotations

import getpass
import os
import socket
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable

import psycopg
import structlog

from domain import events as ev
from domain.errors import ServiceUnavailable, TapelineError
from domain.regions import DELAYED_STATES, delayed_event, failover_event, region_lost_row
from tapeline.clock import system_clock
from regions.authority import new_failover_id, read_regions, unanswered, write_region_record
from regions.processes import Processes, ProjectorThread
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.failover")


class FailoverError(TapelineError):
    """The failover could not start or finish a step; the message says which and why. Steps already
    done stay done; running the command again goes on from where it stopped."""


@dataclass
class FailoverReport:
    """What a failover did: its record, whether the left region answered (`planned`), each step's
    seconds from the command's start, and the jobs whose attempt was lost with the left region."""

    failover_id: str
    from_region: str
    to_region: str
    epoch: int
    planned: bool
    resumed: bool = False  # the target was already active: an earlier run's failover finished here
    steps: dict[str, float] = field(default_factory=dict)
    lost_attempts: list[dict[str, Any]] = field(default_factory=list)
    delayed_jobs: int = 0
    processors_pid: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"failover_id": self.failover_id, "from_region": self.from_region, "to_region": self.to_region,
                "epoch": self.epoch, "planned": self.planned, "resumed": self.resumed,
                "steps_s": {name: round(s, 3) for name, s in self.steps.items()},
                "lost_attempts": self.lost_attempts, "delayed_jobs": self.delayed_jobs,
                "processors_pid": self.processors_pid}


def _operator() -> str:
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except Exception:  # no user name in a container
        return f"uid {os.getuid()}@{socket.gethostname()}"


def fail_over(regions: dict[str, Settings], to: str, why: str, *, processes: Processes, operator: str | None = None,
              drain_timeout_s: float = 60.0, start_processors: bool = True, accept_timeout_s: float = 120.0,
              say: Callable[[str], None] = lambda _line: None) -> FailoverReport:
    """Move the job history to region `to` (see the module for the steps). `regions`: `{"a": region
    A's settings, "b": region B's}`; `processes`: the roof's projector, runtime and background
    processors (`regions/processes.py`). `say` gets one line per step. Raises `FailoverError` (with
    the step) when a step cannot be done, `ValueError` for an unknown region or an empty reason."""

    started = time.monotonic()
    if to not in regions:
        raise ValueError(f"unknown region {to!r}: {', '.join(regions)}")
    target = regions[to]
    left = next(name for name in regions if name != to)
    source = regions[left]

    def step(name: str, line: str) -> None:
        report.steps[name] = time.monotonic() - started
        say(f"{report.steps[name]:7.2f} s  {line}")

    why_not = unanswered(target)
    if why_not is not None:
        raise FailoverError(why_not)
    from tapeline.kafka_topics import ensure_topics

    ensure_topics(target)
    view = read_regions(regions)
    planned = left not in view.unreachable
    current = view.authority
    if current.active == to and current.record is not None:
        record, resumed = current.record, True
    elif current.active == to:
        raise FailoverError(f"region {to} already holds the job history (epoch {current.epoch}); nothing to fail over")
    else:
        record = failover_event(current, to, reason=why, operator=operator or _operator(), planned=planned,
                                recorded_by=f"failover@{socket.gethostname()}:{os.getpid()}",
                                failover_id=new_failover_id(), stamp=system_clock.stamp())
        resumed = False
    report = FailoverReport(record.correlation_id, record.from_region, to, record.epoch, planned, resumed)
    step("target_answers", f"region {to} answers (Kafka {target.kafka_bootstrap_servers})"
                           + (f"; region {left} answers too: a planned switch" if planned
                              else f"; region {left} does not answer"))

    try:
        write_region_record(target, record)
    except ServiceUnavailable as exc:
        raise FailoverError(f"fence not written to region {to}: {exc}") from exc
    if planned:
        try:
            ensure_topics(source, timeout_s=10.0)  # a region set up before <prefix>.regions existed
            write_region_record(source, record)
        except (ServiceUnavailable, TapelineError) as exc:
            log.warning("fence not written to the region left; it reads it from the target", error=str(exc))
    step("fenced", f"region {left} fenced: region {to} holds the job history from epoch {record.epoch}"
                   + (" (resumed: recorded by an earlier run)" if resumed else ""))

    if planned:
        _wait_left_quiet(processes, source, drain_timeout_s)  # failback (issue 25 item 6): its last writes come before the drain
        behind = _drain(source, target, drain_timeout_s)
        step("drained", "the mirror copied every committed record" if behind == 0
             else f"not drained within {drain_timeout_s:g} s: {behind} events behind")

    from tapeline.home import home_paths
    from regions.mirror import down_mirror
    from regions.replicator_process import down_replicator

    paths = home_paths(target)
    down_mirror(paths, None)
    down_replicator(paths, None)
    step("mirror_stopped", f"mirror and media replicator into region {to} stopped")

    from tapeline.postgres import migrate

    migrate(target.database_url, target.db_schema, target.reader_role)
    with ProjectorThread(processes, target):
        _wait_caught_up(target, timeout_s=max(60.0, accept_timeout_s))
        step("projections_caught_up", f"region {to}'s projections applied its whole log")
        report.lost_attempts = _requeue_lost_attempts(processes, target, record)
        _wait_caught_up(target, timeout_s=max(60.0, accept_timeout_s))
        step("lost_attempts_requeued", f"{len(report.lost_attempts)} attempt(s) lost with region {left} queued again "
                                       "(region_lost: no attempt used)")
        report.delayed_jobs = _tell_delayed(processes, target, record)
        _wait_caught_up(target, timeout_s=max(60.0, accept_timeout_s))
    step("customers_told", f"{report.delayed_jobs} job(s) in flight delayed: their submitters are told (job.delayed)")

    if start_processors:
        report.processors_pid = start_region_processors(processes, target)
        step("processors_started", f"region {to}'s processors running (pid {report.processors_pid}, log "
                                   f"{target.home / 'logs' / 'run.log'})")
        _wait_intake_ready(processes, target, accept_timeout_s)
        step("accepting_uploads", f"region {to}'s intake is ready: it accepts uploads")
    return report


def _wait_left_quiet(processes: Processes, source: Settings, timeout_s: float) -> bool:
    """A planned switch: wait until the fenced region's processors have stopped writing (their guard
    sees the fence within `region_check_interval_s`, then they stop gracefully), so the drain cannot
    measure 0 before their last transaction commits: its detached supervisor (this machine's) has
    exited, and the end offsets of its mirrored topics have not moved for two check intervals.
    Returns False when `timeout_s` passed first (the drain goes on; the report's drained line says
    what it found)."""
    from regions.mirror import mirrored_topics
    from tapeline import kafka_scan

    deadline = time.monotonic() + timeout_s
    while processes.running_pid(source) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    settle_s = 2 * source.region_check_interval_s
    # High watermarks, not last stable offsets: a write inside a transaction still open moves them too.
    client = kafka_scan.committed_reader(source, "failover-quiet", **{"isolation.level": "read_uncommitted"})
    try:
        def ends() -> tuple[int, ...]:
            found = kafka_scan.existing_topics(client, 10)
            return tuple(kafka_scan.offsets(client, topic, p, 10)[1]
                         for topic in mirrored_topics(source) if topic in found for p in range(found[topic]))

        last, since = ends(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = ends()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= settle_s:
                return True
    except Exception as exc:  # the region left stopped answering: nothing more comes from it
        log.warning("region left not watched for quiet", error=str(exc))
        return True
    finally:
        client.close()
    return False


def _drain(source: Settings, target: Settings, timeout_s: float) -> int:
    """Wait until the mirror has copied every committed record of `source` (events behind 0);
    returns the events still behind when `timeout_s` passed (0: drained)."""
    from regions.measure import measure_region_lag
    from regions.mirror import mirrored_topics

    deadline = time.monotonic() + timeout_s
    behind = -1
    while True:
        try:
            behind = measure_region_lag(source, target, mirrored_topics(source),
                                        timeout_s=min(30.0, timeout_s)).events_behind
        except Exception as exc:  # the left region stopped answering meanwhile
            log.warning("drain measurement failed", error=str(exc))
        if behind == 0 or time.monotonic() >= deadline:
            return max(behind, 0) if behind >= 0 else -1
        time.sleep(1.0)


def _wait_caught_up(settings: Settings, timeout_s: float) -> None:
    """Until the projection has applied every committed record of its topics. Raises FailoverError
    after `timeout_s`."""
    from projections.read_model import projection_lag

    deadline = time.monotonic() + timeout_s
    last = None
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            try:
                last = projection_lag(settings, conn, timeout_s=10.0)
                if last.events == 0 and last.exact:
                    return
            except (ServiceUnavailable, psycopg.Error) as exc:
                log.warning("projection lag not measured", error=str(exc))
            time.sleep(0.5)
    raise FailoverError(f"region {settings.region}'s projections did not catch up within {timeout_s:g} s"
                        + (f" ({last.events} events behind)" if last is not None else ""))


def _jobs_in(target: Settings, states: tuple[str, ...]) -> list[dict[str, Any]]:
    """The jobs of `target`'s projection in any of `states`."""
    from projections.read_model import jobs_in_state
    from psycopg.rows import dict_row

    with psycopg.connect(target.database_url, autocommit=True, row_factory=dict_row) as conn:
        return [job for state in states for job in jobs_in_state(conn, state, limit=1_000_000)]


def _commit(processes: Processes, target: Settings, name: str,
            outgoing_of: Callable[[str], list[tuple[str, ev.Event]]]) -> int:
    """Write what `outgoing_of(recorded_by)` returns (`(topic, event)` pairs) to `target`'s log in
    one transaction of the failover's producer (crash points `<name>.*`); returns how many events."""
    from processors.runtime import transact

    runtime = processes.build_runtime(target, "failover")
    try:
        outgoing = outgoing_of(runtime.recorded_by)
        if outgoing:
            producer = runtime.events.transactional_producer(f"{target.app_name}.failover")
            transact(producer, lambda: runtime.produce(producer, outgoing), name=name)
    finally:
        runtime.close()
    return len(outgoing)


def _requeue_lost_attempts(processes: Processes, target: Settings, record: ev.RegionFailedOver) -> list[dict[str, Any]]:
    """`StallDetected(region_lost)` and the retry for every job running in `target`'s projection, in
    one transaction; returns `[{job_id, stage, attempt}]` of the attempts lost."""
    from processors.watchdog import run_once

    running = _jobs_in(target, ("running",))
    now = system_clock.now()
    rows = [row for job in running if (row := region_lost_row(job, record, now)) is not None]
    if rows:
        _commit(processes, target, "failover", lambda recorded_by: list(run_once(
            rows, [], [], {job["job_id"]: job for job in running}, target, recorded_by, clock=system_clock).outgoing))
    return [{"job_id": r["job_id"], "stage": r["stage"], "attempt": r["attempt"]} for r in rows]


def _tell_delayed(processes: Processes, target: Settings, record: ev.RegionFailedOver) -> int:
    """A `JobDelayed` for every job in flight in `target`'s projection, in one transaction (the
    notifier of `target` sends each as `job.delayed`); returns how many were written. Written again
    by a second run of the same failover, each is a duplicate of its dedup key and is dropped."""
    in_flight = _jobs_in(target, DELAYED_STATES)
    return _commit(processes, target, "failover.delayed", lambda recorded_by: [
        (target.jobs_topic, event) for job in in_flight
        if (event := delayed_event(job, record, recorded_by=recorded_by, stamp=system_clock.stamp())) is not None])


def start_region_processors(processes: Processes, target: Settings) -> int:
    """Start `tapeline run --role all` of region `target.region` in the background (the environment's
    settings with TAPELINE_REGION set); returns its pid (a running one is reused)."""
    env = {**os.environ, "TAPELINE_REGION": target.region}
    env.pop("TAPELINE_HEALTH_PORT", None)  # its children get theirs from its (derived) health port base
    return processes.start_all(target, env)


def intake_health_url(processes: Processes, target: Settings) -> str:
    """Where region `target`'s intake child answers `/health/ready`."""
    return f"http://127.0.0.1:{processes.health_port(target, 'intake')}/health/ready"


def _wait_intake_ready(processes: Processes, target: Settings, timeout_s: float) -> None:
    url = intake_health_url(processes, target)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise FailoverError(f"region {target.region}'s intake did not report ready at {url} within {timeout_s:g} s "
                        f"(see {target.home / 'logs' / 'run.log'})")

"""The watchdog: advances the log clock, reads the stall views, and re-drives what stopped moving.

Leader election: a PostgreSQL advisory lock per deployment (app name and schema) held on the
watchdog's own dedicated connection; the transactional id `<app>.watchdog` is fixed, so a new
leader's `init_transactions` fences the old one.

One tick (`Watchdog.tick`), after the numbered protocol:
  Step 1. produce a `WatchdogTick` to every partition of the lifecycle log (one transaction); the
          broker stamps each, which advances that partition's log clock;
  Step 2. wait until the projector has applied every partition past the tick; while it has not,
          judge nothing (never declare stalls while blind);
  Step 3. read `stalled_attempts`, the `stalled_handoffs` due for a re-drive, `expected_work_missing`,
          `due_retries` and the affected jobs;
  Step 4. `run_once` (pure) decides: retry as the next attempt, dispatch a due retry, dead-letter,
          re-drive, report;
  Step 5. commit the decided events in one transaction. Every event has a dedup key, so a repeated
          tick or a second watchdog changes nothing;
  Step 6. cleanup (`domain/policy/cleanup.py`, at most every `cleanup_interval_s`): list the next page of the sweep, read the rows of its
          jobs, `plan_cleanup` (pure) decides, remove at most `cleanup_max_deletes` objects. A
          storage failure here is logged and retried next tick; it never stops the stall work.
Between ticks it waits the tick period (`tick_s`), or less when a lease, a no-progress allowance
or a scheduled retry ends sooner (`next_wake_s`): a crashed host's attempt is judged when its lease
ends, not up to a period later.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import Enum
from typing import Any

import structlog

from domain.policy.cleanup import SWEPT_PREFIXES, CleanupPlan, job_ids_of, plan_cleanup, retention_under_pressure
from domain.policy.retry import Action, retry_decision, retry_scheduled, stall_error_class
from domain.policy.stall import (LogOutage, attempt_deadline, attempt_stall, excused_by_outage, handoff_redrive_due,
                                 next_wake_s, work_missing)
from processors.runtime import Outgoing, Runtime, transact
from domain.lifecycle import FREE_STALL_KINDS, attempts_used
from domain import events as ev
from domain import pipeline
from domain.errors import Fenced, ServiceUnavailable, StorageError
from tapeline.health import HealthState
from tapeline.objects import StorageGauge
from tapeline.ports import Clock, EventLog, EventLogError, JobStore, ObjectStorage, WriterFenced
from tapeline.settings import Settings

JUDGED_ELSEWHERE = frozenset({"worker_exited", "region_lost"})
"""Stall kinds whose candidate row comes already judged (a supervisor saw the process die; a failover
lost the attempt's region): the stall rule's clock is not asked."""

log = structlog.get_logger("tapeline.watchdog")
WATCHDOG_LOCK = 0x7A9E_0010
"""First key of the advisory lock the watchdog leader holds (0001 migrations, 0003 projector); the
second is `hashtext` of `leader_key(settings)`: one leader per deployment, not per database."""


def leader_key(settings: Settings) -> str:
    """What names a deployment for the leader lock: its app name (its transactional ids) and the
    schema of its projections. Two deployments sharing a database each get their own leader (a
    single key let the first one's watchdog stand the other's by for good: its stalls went unseen)."""
    return f"{settings.app_name}:{settings.db_schema}"


SLOW_TICK_S = 5.0
"""A tick's transaction that took longer than this, seconds, was held back by the log (a healthy one
takes milliseconds): the watchdog counts the stretch as a log outage (`LogOutage`)."""


class Verdict(str, Enum):
    RETRY = "retry"
    DISPATCH = "dispatch"
    DEAD_LETTER = "dead_letter"
    REDRIVE = "redrive"
    REPORT = "report"
    IGNORE = "ignore"


@dataclass
class RunResult:
    """What one `run_once` decided: counts per verdict and the events to commit."""

    counts: dict[str, int] = field(default_factory=lambda: {v.value: 0 for v in Verdict})
    outgoing: list[Outgoing] = field(default_factory=list)

    def count(self, verdict: Verdict) -> None:
        self.counts[verdict.value] += 1


def _work_item(job: dict[str, Any], stage: str, attempt: int, common: dict[str, Any], clock: Clock) -> ev.WorkItem:
    """The work item of `stage` attempt `attempt`, rebuilt from the job's projected row, stamped by `clock`.

    What a stage's item carries beyond the source and the ladder is what its declaration `needs`
    (`domain/pipeline.py`): `inputs` (the outputs earlier stages handed on, `job_state.outputs`),
    `audio_playlist_key`, `x264_preset`. A stage that makes the renditions (it needs the preset)
    gets the ladder without playlist keys or URLs. An unknown stage gets no extras."""
    declared = pipeline.BY_NAME.get(stage)
    needs = declared.needs if declared is not None else frozenset()
    ladder = [ev.Rendition(**r) for r in (job.get("ladder") or [])]
    inputs = [ev.OutputFile(**o) for o in (job.get("outputs") or [])] if "inputs" in needs else []
    if "x264_preset" in needs:
        ladder = [r.model_copy(update={"playlist_key": None, "url": None}) for r in ladder]
    return ev.WorkItem.new(clock.stamp(), stage=stage, attempt=attempt, tier=job.get("priority") or "standard",
                           source_key=job.get("source_key") or "", inputs=inputs, renditions=ladder,
                           audio_playlist_key=job.get("audio_playlist_key") if "audio_playlist_key" in needs else None,
                           media_duration_s=job.get("source_duration_s"),
                           x264_preset=job.get("x264_preset") if "x264_preset" in needs else None,
                           degraded=bool(job.get("degraded")), pipeline_stages=job.get("pipeline_stages") or [], **common)


def _tool_state(seen: dict[str, Any] | None) -> ev.ToolState | None:
    """The `ToolState` of a stalled row's `tool_state` (its JSON), fields it does not know left out;
    None without one."""
    if not seen or not seen.get("tool"):
        return None
    return ev.ToolState(**{k: v for k, v in seen.items() if k in ev.ToolState.model_fields})


def queue_attempt(job: dict[str, Any], stage: str, attempt: int, common: dict[str, Any],
                  settings: Settings, *, clock: Clock) -> list[Outgoing]:
    """`StageQueued` + `WorkItem` of `stage` attempt `attempt` on the job's tier (the watchdog's
    retries and re-drives, and an operator's replay), stamped by `clock`."""
    tier = job.get("priority") or "standard"
    return [(settings.jobs_topic, ev.StageQueued.new(clock.stamp(), stage=stage, attempt=attempt, tier=tier,
                                                     work_topic=settings.work_topic(stage, tier), **common)),
            (settings.work_topic(stage, tier), _work_item(job, stage, attempt, common, clock))]


def run_once(stalled: list[dict[str, Any]], handoffs: list[dict[str, Any]], missing: list[dict[str, Any]],
             jobs: dict[str, dict[str, Any]], settings: Settings, recorded_by: str,
             due: list[dict[str, Any]] = (), *, clock: Clock, outage: LogOutage | None = None) -> RunResult:
    """Classify every stall and build the events that act on it. Pure: rows in, events out, each
    event stamped by `clock` (its time and event id; the verdicts never read it).

    The rows are the views' candidates, each with `log_now` (its log clock); the stall rule
    (`domain/policy/stall.py`, thresholds from `settings.stall_thresholds(stage)`: a stage may
    declare its own no-progress timeout) decides each one, so a candidate the rule does not call
    stalled (a heartbeat arrived meanwhile) is ignored.

    - a stalled attempt (lease_expired | no_progress | worker_exited, from `processors/rescue.py` |
      region_lost, from `regions/failover.py`, which gives its attempt back): `StallDetected` (with the
      `tool_state` of the attempt's last heartbeat, when the row has one) then, within the attempt
      budget (yields do not count), `RetryScheduled` + `StageQueued` + `WorkItem` for the next
      attempt at once (error class by the stall's kind: `stall_error_class`, worker_lost or
      progress_stalled); out of budget, `JobDeadLettered` on the lifecycle log
      and the same event on the dead-letter topic;
    - a due retry (`RetryScheduled` whose time has come on the log clock): `StageQueued` + `WorkItem`
      of the next attempt, once (dedup keys);
    - a stalled handoff: `StallDetected(handoff)` and the same attempt's work item again;
    - expected work missing: `StallDetected(expected_work_missing)` (reported once);
    - an attempt stall whose deadline fell after `outage` began is not judged until one lease after
      the log came back (`excused_by_outage`).
    """
    result = RunResult()
    jobs_topic = settings.jobs_topic
    thresholds = settings.stall_thresholds()
    for row in stalled:
        stage_thresholds = settings.stall_thresholds(row["stage"])  # the stage's no-progress timeout
        job = jobs.get(row["job_id"])
        if job is None or job["state"] != "running" or (job["stage"], job["attempt"]) != (row["stage"], row["attempt"]):
            result.count(Verdict.IGNORE)
            continue
        if row["kind"] in JUDGED_ELSEWHERE:  # a supervisor, a restarted worker, a failover: no clock to judge
            kind, since_s = row["kind"], float(row.get("since_s") or 0.0)
        else:  # the view selected a candidate; the stall rule decides (domain/policy/stall.py)
            verdict = attempt_stall(leased_until=row.get("leased_until"), last_heartbeat_at=row.get("last_heartbeat_at"),
                                    progress_at=row.get("last_progress_at"),
                                    progress_grace_s=job.get("progress_grace_s"), now=row["log_now"],
                                    thresholds=stage_thresholds)
            if verdict is None:
                result.count(Verdict.IGNORE)
                continue
            deadline = row.get("leased_until") if verdict.kind == "lease_expired" else \
                row["last_progress_at"] + timedelta(seconds=stage_thresholds.no_progress_timeout_s
                                                    + (job.get("progress_grace_s") or 0.0))
            if excused_by_outage(deadline, outage, row["log_now"], settings.lease_s):
                result.count(Verdict.IGNORE)  # judged one lease after the log came back
                continue
            kind, since_s = verdict.kind, verdict.since_s
        stage, attempt = row["stage"], row["attempt"]
        common = dict(job_id=row["job_id"], recorded_by=recorded_by, correlation_id=job["upload_id"])
        detail = row.get("detail") or (f"lease ended {row['leased_until']:%H:%M:%S.%f}" if kind == "lease_expired"
                                       else f"frames stuck at {row['progress_frames']}")
        seen = row.get("tool_state")  # the last heartbeat's ToolState (view stalled_attempts, migration 032)
        result.outgoing.append((jobs_topic, ev.StallDetected.new(clock.stamp(),
            stage=stage, attempt=attempt, kind=kind, stalled_attempt=attempt,
            last_progress_at=row["last_progress_at"], since_s=since_s, detail=detail,
            tool_state=_tool_state(seen), **common)))
        used = attempts_used(job, attempt) - (1 if kind in FREE_STALL_KINDS else 0)  # given back: no budget used
        error_class = stall_error_class(kind)
        decision = retry_decision(error_class, used, settings.retry_policy())
        if decision.action is Action.RETRY:
            nxt = attempt + 1
            result.outgoing.append((jobs_topic, retry_scheduled(decision.delay_s, clock.stamp(), stage=stage, attempt=attempt,
                                                                next_attempt=nxt, error_class=error_class, **common)))
            if decision.delay_s <= 0:  # a stall is retried at once (docs/design.md)
                result.outgoing += queue_attempt(job, stage, nxt, common, settings, clock=clock)
            result.count(Verdict.RETRY)
        else:
            dead = ev.JobDeadLettered.new(clock.stamp(), 
                stage=stage, attempt=attempt, error_class=error_class,
                reason=f"attempt {attempt} stalled ({kind}) and no attempts are left", attempts=used,
                evidence=f"{jobs_topic} partition {row['log_partition']}",
                claim_token=job.get("claim_token"),  # the stalled attempt's claim: it ends that attempt only
                **common)
            result.outgoing += [(jobs_topic, dead), (settings.dlq_topic, dead)]  # the fact + its dead-letter record
            result.count(Verdict.DEAD_LETTER)
    for row in due:
        job = jobs.get(row["job_id"])
        if job is None or job["state"] != "retry_scheduled" or job.get("retry_next_attempt") != row["retry_next_attempt"]:
            result.count(Verdict.IGNORE)
            continue
        common = dict(job_id=row["job_id"], recorded_by=recorded_by, correlation_id=job["upload_id"])
        result.outgoing += queue_attempt(job, row["stage"], row["retry_next_attempt"], common, settings, clock=clock)
        result.count(Verdict.DISPATCH)
    for row in handoffs:
        job = jobs.get(row["job_id"])
        if job is None or job["state"] != "queued" or (job["stage"], job["attempt"]) != (row["stage"], row["attempt"]) \
                or not handoff_redrive_due(queued_at=row.get("queued_at"), now=row["log_now"], thresholds=thresholds):
            result.count(Verdict.IGNORE)
            continue
        common = dict(job_id=row["job_id"], recorded_by=recorded_by, correlation_id=job["upload_id"])
        result.outgoing += [
            (jobs_topic, ev.StallDetected.new(clock.stamp(), stage=row["stage"], attempt=row["attempt"], kind="handoff",
                                              stalled_attempt=row["attempt"], since_s=float(row["since_s"]),
                                              detail=f"queued, not claimed (re-drive {row['redrives'] + 1})",
                                              sequence=f"handoff-{row['redrives']}", **common)),
            (settings.work_topic(row["stage"], job.get("priority") or "standard"),
             _work_item(job, row["stage"], row["attempt"], common, clock)),
        ]
        result.count(Verdict.REDRIVE)
    for row in missing:
        if not work_missing(uploaded_at=row["uploaded_at"], has_job=False, now=row["log_now"], thresholds=thresholds):
            result.count(Verdict.IGNORE)
            continue
        result.outgoing.append((jobs_topic, ev.StallDetected.new(clock.stamp(), 
            job_id=row["job_id"], stage="intake", attempt=0, recorded_by=recorded_by, correlation_id=row["upload_id"],
            kind="expected_work_missing", stalled_attempt=0, since_s=float(row["since_s"]),
            detail=f"upload {row['upload_id']} has no job")))
        result.count(Verdict.REPORT)
    return result


class Watchdog:
    """The watchdog process: leader election, ticks, and `run_once` on a caught-up projection."""

    def __init__(self, settings: Settings, *, leader: JobStore, jobs: JobStore, events: EventLog,
                 storage: ObjectStorage, clock: Clock, health: HealthState | None = None) -> None:
        """The adapters (`cli/wiring.py` `build_processor`): `leader`, a job store of its own whose
        session holds the leader lock; `jobs`, the one it reads the projection through; `events`, the
        lifecycle log; `storage`, the bucket the cleanup sweeps; `clock`, what its events are stamped
        with. It closes `leader`, `jobs` and `events` when `run` ends."""
        self.settings = settings
        self.leader, self.jobs, self.events, self.store, self.clock = leader, jobs, events, storage, clock
        self.ticks = 0
        self.processed = 0
        self.last_result: RunResult | None = None
        self.due_in_s: list[float] = []  # deadlines after the last tick's log clock, seconds (`next_wake_s`)
        self.refused_since: float | None = None  # monotonic: when the log began refusing (or holding) ticks
        self.outage: LogOutage | None = None  # the last such stretch, in log time (`excused_by_outage`)
        self.writer_broken = False  # the client declared the ticks' writer unusable: `run` replaces it
        self.health = health or HealthState("watchdog", settings.instance_id)  # `tapeline run` serves it
        self.gauge: StorageGauge | None = None  # the bucket's bytes, when a storage limit is set
        self.storage_pressure = False
        self.sweep_prefix, self.sweep_token = 0, None  # where the orphan sweep resumes (in memory)
        self.cleanup_totals = {"objects_removed": 0, "multipart_aborted": 0, "deferred": 0, "errors": 0}
        self.last_cleanup: CleanupPlan | None = None
        self.next_cleanup_at = 0.0  # monotonic: cleanup runs at most every `cleanup_interval_s`

    def run(self, stop: threading.Event) -> None:
        settings = self.settings
        leader = self.leader  # dedicated: the advisory lock lives in its session
        leader.open()  # PostgreSQL answers (else this raises) before the watchdog says it is ready
        self.health.mark_ready()  # a standby waiting for the lock is healthy too
        try:
            while not stop.is_set():
                if leader.one("watchdog_try_leader", {"lock_class": WATCHDOG_LOCK, "key": leader_key(settings)})["got"]:
                    break
                stop.wait(settings.tick_s)
            if stop.is_set():
                return
            log.info("watchdog is the leader")
            runtime = Runtime(settings, "watchdog", health=self.health, stop=stop, events=self.events, jobs=self.jobs)
            writer_id = f"{settings.app_name}.watchdog"
            producer = self.events.transactional_producer(writer_id)
            self.jobs.run("set_stall_policy", {
                "no_progress_timeout_s": settings.no_progress_timeout_s,
                "handoff_timeout_s": settings.handoff_timeout_s, "intake_timeout_s": settings.intake_timeout_s,
                "suspect_fraction": settings.suspect_fraction})
            declared = pipeline.declared_no_progress()
            self.jobs.run("set_stage_stall_policy", {"stages": list(declared), "no_progress_s": list(declared.values())})
            try:
                while not stop.is_set():
                    started = time.monotonic()
                    leader.run("session_alive")  # still holding the session (and so the lock)
                    self.tick(runtime, producer)
                    if self.writer_broken:
                        producer = self.new_writer(producer, writer_id)
                    stop.wait(next_wake_s(tick_s=settings.tick_s, elapsed_s=time.monotonic() - started,
                                          due_in_s=self.due_in_s))
            finally:
                runtime.close()
        finally:
            leader.close()

    def new_writer(self, broken, writer_id: str):
        """A writer for the ticks in place of `broken` (see `tick`), made once the leader's session
        still answers (else this raises and the watchdog stops): the leader lock makes this watchdog
        the transactional id's only owner, so the new writer fences nothing but the broken one. While the log cannot give one (`ServiceUnavailable`) it returns `broken`, and the next
        tick, refused again, asks again."""
        self.leader.run("session_alive")  # still the leader: the new writer fences no other watchdog
        try:
            writer = self.events.transactional_producer(writer_id)
        except ServiceUnavailable as exc:
            log.warning("no new writer for the watchdog yet; the next tick tries again", error=str(exc))
            return broken
        self.writer_broken = False
        log.warning("the watchdog's writer was replaced (the client declared it unusable, or the coordinator fenced its epoch)")
        return writer

    def tick(self, runtime: Runtime, producer) -> RunResult | None:
        """Steps 1-5 once. Returns what was decided, or None when the projection was not caught up."""
        settings, jobs_topic = self.settings, self.settings.jobs_topic
        self.ticks += 1
        # Steps 1 and 2. The log refusing a call (a partition without a leader while a broker is
        # replaced, a coordinator moving) makes the tick blind, never the watchdog exit: it judges
        # nothing it cannot see caught up, and tries again next tick (a fenced writer still stops).
        sequence = time.time_ns() // 1_000_000
        tried_at = time.monotonic()
        try:
            partitions = runtime.partitions(jobs_topic)
            # Step 1
            transact(producer, lambda: [runtime.produce_to(producer, jobs_topic, p, ev.WatchdogTick.new(self.clock.stamp(),
                job_id=f"tick:{p}", stage="watchdog", attempt=0, recorded_by=runtime.recorded_by,
                correlation_id="watchdog", partition=p, sequence=sequence)) for p in range(partitions)],
                     name="watchdog.tick")
            if time.monotonic() - tried_at > SLOW_TICK_S and self.refused_since is None:
                self.refused_since = tried_at  # the log held the tick back: an outage as much as a refusal
            # Step 2
            for p in range(partitions):
                runtime.wait_caught_up(p, max(2.0, settings.tick_s * 4))
        except (ServiceUnavailable, EventLogError, Fenced) as exc:
            if isinstance(exc, Fenced):
                if not isinstance(exc.__cause__, WriterFenced):
                    raise
                # Not a newer watchdog (the leader lock keeps every other one from ticking) but the
                # outage's mark on the writer: the client's fatal INVALID_TXN_STATE after an abort
                # that followed a record's timeout, or the coordinator's epoch bump when it aborted a
                # tick that outlived `transaction.timeout.ms` (reported as `_FENCED`). Exiting here
                # made the supervisor restart the watchdog mid-outage, and it forgot how long the
                # log had refused it (`outage`). `run` replaces the writer while it holds the lock.
                self.writer_broken = True
            if isinstance(exc, (EventLogError, Fenced)) and self.refused_since is None:
                self.refused_since = tried_at
            log.warning("projection not caught up: judging nothing this tick", error=str(exc))
            self.health.watchdog_ticks.labels(result="blind").inc()
            return None
        # Step 3
        db = runtime.jobs
        if self.refused_since is not None:  # the log accepts writes again: remember the outage
            newest = db.one("log_clock_newest")["now"]
            refused_s = time.monotonic() - self.refused_since
            self.outage = LogOutage(began_at=newest - timedelta(seconds=refused_s), ended_at=newest)
            self.refused_since = None
            log.warning("the log refused the watchdog's ticks; attempt stalls whose deadline fell after that are "
                        "judged one lease after it came back", refused_s=round(refused_s, 1), until=str(newest))
        stalled = db.all("stalled_attempts")
        handoffs = db.all("handoffs_due")  # not those re-driven less than a timeout ago
        missing = db.all("expected_work_unreported")  # each reported once; listed until solved
        due = db.all("due_retries")
        ids = list({r["job_id"] for r in stalled + handoffs + due})
        jobs = {r["job_id"]: r for r in db.all("job_state_by_ids", {"job_ids": ids})} if ids else {}
        # Step 4
        result = run_once(stalled, handoffs, missing, jobs, settings, runtime.recorded_by, due=due, clock=self.clock,
                          outage=self.outage)
        self.due_in_s = deadlines_in_s(db, settings)
        # Step 5
        if result.outgoing:
            transact(producer, lambda: runtime.produce(producer, result.outgoing), name="watchdog.act")
            self.processed += len(stalled) + len(handoffs) + len(missing) + len(due)
            log.info("watchdog acted", **result.counts)
            for _, event in result.outgoing:
                if isinstance(event, ev.StallDetected):
                    self.health.stall_detected(event.kind)
            for verdict, count in result.counts.items():
                if count and verdict != Verdict.IGNORE.value:
                    self.health.watchdog_decisions.labels(verdict=verdict).inc(count)
        self.health.watchdog_ticks.labels(result="judged").inc()
        self.last_result = result
        # Step 6
        if settings.cleanup_max_deletes > 0 and time.monotonic() >= self.next_cleanup_at:
            self.next_cleanup_at = time.monotonic() + settings.cleanup_interval_s
            try:
                self.cleanup(db)
            except StorageError as exc:
                self.cleanup_totals["errors"] += 1
                log.warning("cleanup failed: retried next tick", error=str(exc))
        return result

    def cleanup(self, db: JobStore) -> CleanupPlan | None:
        """Step 6: one page of the sweep (prefixes `work/`, `markers/`, `uploads/` in turn, resumed
        where the last tick stopped), planned by `plan_cleanup` and performed within the cap. A page
        with removals left over (the cap) is listed again next tick."""
        settings = self.settings
        now = db.one("log_clock_oldest")["now"]
        if now is None:
            return None
        store = self.store
        if settings.storage_limit_bytes is not None:  # storage guard: shorter retention while over the limit
            self.gauge = self.gauge or StorageGauge(settings, store)
            self.storage_pressure = self.gauge.over_limit()
            self.health.storage_bytes.set(self.gauge.bytes())  # cached: the measurement over_limit just made
            self.health.storage_limit_bytes.set(settings.storage_limit_bytes)
            settings = retention_under_pressure(settings, self.storage_pressure)
        prefix = SWEPT_PREFIXES[self.sweep_prefix]
        starting_pass = self.sweep_prefix == 0 and self.sweep_token is None
        objects, next_token = store.list_page(prefix, self.sweep_token, settings.cleanup_page_keys)
        multipart = store.list_multipart(settings.cleanup_page_keys) if starting_pass else []
        ids = sorted(job_ids_of(o.key for o in objects))
        jobs = {r["job_id"]: r for r in db.all("job_state_by_ids", {"job_ids": ids})} if ids else {}
        referenced = {r["key"] for r in db.all("referenced_object_keys", {"job_ids": ids})} \
            if ids else set()
        plan = plan_cleanup(objects, jobs, referenced, now, settings, multipart)
        for upload in plan.abort:
            store.abort_multipart(upload.key, upload.upload_id)
        for i in range(0, len(plan.delete), 1000):
            store.delete_many(plan.delete[i:i + 1000])
        if not plan.deferred:  # else: the same page again next tick
            self.sweep_token = next_token
            if next_token is None:
                self.sweep_prefix = (self.sweep_prefix + 1) % len(SWEPT_PREFIXES)
        totals = self.cleanup_totals
        totals["objects_removed"] += len(plan.delete)
        totals["multipart_aborted"] += len(plan.abort)
        totals["deferred"] = plan.deferred
        if plan.delete or plan.abort:
            log.info("cleanup removed objects", prefix=prefix, removed=len(plan.delete), aborted=len(plan.abort),
                     deferred=plan.deferred, **{k: v for k, v in plan.counts.items() if v})
        health = getattr(self, "health", None)  # set by `run_role` (its absence there means "ready once running")
        if health is not None:
            health.set_cleanup(totals, removed=len(plan.delete), aborted=len(plan.abort))
        self.last_cleanup = plan
        return plan


def deadlines_in_s(db: JobStore, settings: Settings) -> list[float]:
    """Seconds after each partition's log clock until the next stall deadlines and the next due
    retry (`domain/policy/stall.py` `attempt_deadline`): when the watchdog should look again."""
    found = []
    for row in db.all("running_attempt_deadlines"):
        end = attempt_deadline(leased_until=row["leased_until"], progress_at=row["progress_at"],
                               progress_grace_s=row["progress_grace_s"],
                               thresholds=settings.stall_thresholds(row["stage"]))
        if end is not None:
            found.append((end - row["log_now"]).total_seconds())
    retry = db.one("next_retry_due_in")["due_in_s"]
    return found + ([retry] if retry is not None else [])


def log_clock(jobs: JobStore) -> dict[int, datetime]:
    """The log clock of every partition (the `log_clock` operation): partition -> broker time."""
    return {r["partition"]: r["now"] for r in jobs.all("log_clock")}

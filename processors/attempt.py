"""One claimed attempt of a stage: its identity, its fenced transactional producer, heartbeats
(also from a keep-alive thread while nothing reports progress) and the ownership checks made before
every side effect. Built by `StageWorker.claim` (processors/worker.py, over processors/claim.py); stages use it through
`work(attempt)`."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

import structlog

from domain import events as ev
from domain.errors import Fenced, ServiceUnavailable
from tapeline.ports import EventLogError, WriterFenced
from domain.policy.claim_rules import superseded_reason
from processors.runtime import AttemptIdentity, Outgoing, Runtime, transact
from processors.claim import attempt_transactional_id
from tapeline.partitioner import partition_for


log = structlog.get_logger("tapeline.attempt")

RECORD_RETRY_MIN_S = 300.0
"""`Attempt.record` tries for at least this long, seconds, before it gives up (the worker then exits
and the attempt is rescued as `worker_exited`)."""


class Attempt:
    """One claimed attempt: its identity, its fenced producer and a heartbeat sequence."""

    def __init__(self, runtime: Runtime, identity: AttemptIdentity, producer, item: ev.WorkItem,
                 uncounted: int = 0) -> None:
        self.runtime, self.identity, self.producer, self.item = runtime, identity, producer, item
        # Attempt numbers that do not count against the budget: graceful yields, and every attempt
        # before the last operator replay (fold.attempts_used).
        self.uncounted = uncounted
        self.heartbeats = 0
        self.last_heartbeat = time.monotonic()
        self.heartbeat_failures = 0
        """Heartbeats the log refused (each tried again at the next call)."""
        self.claimed_at = time.monotonic()  # for the stage duration histogram
        self._transacting = threading.RLock()  # one transaction at a time on the producer (`keepalive`)

    def send(self, outgoing: list[Outgoing], point: str | None = None) -> None:
        """Commit `outgoing` in one transaction on the attempt's producer. Raises `Fenced`.
        `point`: the transaction's crash-point name (default `{stage}.{first event type}`)."""
        with self._transacting:
            try:
                transact(self.producer, lambda: self.runtime.produce(self.producer, outgoing),
                         name=point or f"{self.identity.stage}.{outgoing[0][1].event_type if outgoing else 'empty'}")
            except Fenced as exc:
                if not isinstance(exc.__cause__, WriterFenced):
                    raise
                self.renew_writer(exc)
                raise EventLogError(f"the attempt's writer was unusable and is replaced; nothing written: {exc}") from exc

    def renew_writer(self, broken: Exception) -> None:
        """Replace the attempt's writer after it was fenced or the client declared it unusable
        (`WriterFenced`, `WriterBroken`), once a caught-up projection shows this attempt still owns
        the job: the new writer, with the same transactional id, fences whatever held it. A fence is
        not always a newer owner: the transaction coordinator bumps the producer epoch when it aborts
        a transaction that outlived `transaction.timeout.ms` (a broker outage longer than that), and
        librdkafka reports the old epoch as `_FENCED`; a second worker's claim of the same work item
        fences the owner too, then drops the item. A newer owner's claim follows the stall or
        operator event that ended this attempt in the log, so the caught-up projection shows it.
        Raises `Fenced` (another owner) or `EventLogError` (ownership cannot be checked yet, or no
        new writer: the next `send` tries again)."""
        identity, settings = self.identity, self.runtime.settings
        try:
            partition = partition_for(identity.job_id, self.runtime.partitions(settings.jobs_topic))
            self.runtime.wait_caught_up(partition, min(10.0, settings.caught_up_timeout_s))
        except (ServiceUnavailable, EventLogError) as exc:
            raise EventLogError(f"writer unusable ({broken}); ownership not checkable yet: {exc}") from exc
        self.check_still_owner()
        try:
            self.producer = self.runtime.events.transactional_producer(
                attempt_transactional_id(settings, identity.stage, identity.job_id))
        except ServiceUnavailable as exc:
            raise EventLogError(f"writer unusable ({broken}); no new one yet: {exc}") from exc
        log.warning("attempt writer replaced after the client declared it unusable", job_id=identity.job_id,
                    attempt=identity.attempt, error=str(broken))

    def record(self, outgoing: list[Outgoing], retry_for_s: float | None = None) -> None:
        """`send` events the attempt must not lose (a checkpoint, a publish intent or result, the
        outcome), again and again while the log refuses them (a partition or the transaction
        coordinator without a leader during an election, or the whole cluster below
        `min.insync.replicas`), for up to `retry_for_s` seconds (default: twice the lease, at least
        `RECORD_RETRY_MIN_S`; the watchdog does not judge a lease that ended during a log outage
        until one lease after it, `domain.policy.stall.excused_by_outage`), so a broker outage
        never costs an attempt. Before each new try it
        reconciles: once the projection has caught up with the job's partition, events already
        recorded (a commit whose answer was lost) are not written twice, and an attempt no longer
        the job's owner stops with `Fenced`. Heartbeats use `send` (a refused one is simply tried
        again at the next beat).

        Raises:
            Fenced: a newer owner (the writer's or the projection's word).
            EventLogError: still refused after `retry_for_s` seconds.
        """
        if not outgoing:
            return
        lease_s = self.runtime.settings.lease_s
        give_up_at = time.monotonic() + (max(2 * lease_s, RECORD_RETRY_MIN_S) if retry_for_s is None else retry_for_s)
        pause_s = 0.5
        while True:
            try:
                self.send(outgoing)
                return
            except EventLogError as exc:
                refused = exc
            while True:  # reconcile before writing the same events again
                if time.monotonic() >= give_up_at:
                    raise refused
                log.warning("attempt events not written; trying again", job_id=self.identity.job_id,
                            attempt=self.identity.attempt, error=str(refused), retry_in_s=pause_s)
                time.sleep(pause_s)
                pause_s = min(pause_s * 2, 4.0)
                recorded = self.events_recorded(outgoing)
                if recorded is True:
                    log.info("attempt events were recorded after all", job_id=self.identity.job_id)
                    return
                if recorded is False:
                    break

    def events_recorded(self, outgoing: list[Outgoing]) -> bool | None:
        """Whether the first event of `outgoing` is in the projection, read once the projector has
        caught up with the job's partition (so a committed transaction is seen); None while that
        cannot be told (the log or the projection does not answer). Raises `Fenced` when the
        projection shows another owner."""
        identity, settings = self.identity, self.runtime.settings
        try:
            partition = partition_for(identity.job_id, self.runtime.partitions(settings.jobs_topic))
            self.runtime.wait_caught_up(partition, min(10.0, settings.caught_up_timeout_s))
            found = self.runtime.jobs.one("event_recorded", {"job_id": identity.job_id,
                                                             "event_id": outgoing[0][1].event_id})
        except (ServiceUnavailable, EventLogError) as exc:
            log.info("cannot tell yet whether the attempt events were recorded", error=str(exc))
            return None
        if found and found["recorded"]:
            return True
        self.check_still_owner()
        return False

    @contextlib.contextmanager
    def keepalive(self, frames_done: int, out_time_s: float, frames_total: int | None,
                  progress_grace_s: float | None = None) -> Iterator[None]:
        """Heartbeats from a thread of their own while the caller works with nothing to report
        heartbeats from: before ffmpeg starts, the source's download and probe; after it ended, the
        last segments' uploads, the checks of every rendition (ffprobe) and the playlists' uploads.
        Without them those phases had to fit in one lease: under load the second did not, and a
        healthy attempt was declared stalled and run again. `progress_grace_s`: seconds the
        no-progress timeout grows by meanwhile (`Heartbeat.progress_grace_s`; e.g. a large download).

        Every heartbeat reports `frames_done` / `out_time_s` (the encode's final figures), so the
        no-progress timeout still bounds the phase: a check that hangs is caught by it, as a hung
        ffmpeg is. The caller may `send` meanwhile (one transaction at a time). A `Fenced` (or any
        other error) of a heartbeat stops the thread and is raised here when the block ends.
        """
        stop, failures = threading.Event(), []
        interval_s = self.runtime.settings.heartbeat_s / 4

        def beat() -> None:
            while not stop.wait(interval_s):
                try:
                    with self._transacting:
                        self.heartbeat(frames_done, out_time_s, None, frames_total, progress_grace_s=progress_grace_s)
                except Exception as exc:  # noqa: BLE001 - raised in the caller's thread below
                    failures.append(exc)
                    return

        thread = threading.Thread(target=beat, name=f"keepalive-{self.identity.job_id}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
        if failures:
            raise failures[0]

    def event(self, cls: type[ev.Event], **fields: Any) -> ev.Event:
        return self.identity.event(cls, **fields)

    def heartbeat(self, frames_done: int, out_time_s: float, speed: float | None, frames_total: int | None,
                  progress_grace_s: float | None = None, point: str | None = None,
                  tool_state: ev.ToolState | None = None) -> None:
        """Emit a `Heartbeat` if the heartbeat interval has passed (monotonic clock). `progress_grace_s`:
        seconds the no-progress timeout is extended by while ffmpeg seeks silently (`Heartbeat`);
        `point`: the transaction's crash-point name (`send`); `tool_state`: what the worker last saw
        of its tool's process (`processors/media.py` `ToolWatch`), carried by the heartbeat."""
        if time.monotonic() - self.last_heartbeat < self.runtime.settings.heartbeat_s:
            return
        self.heartbeats += 1
        started = time.monotonic()
        try:
            self.send([(self.runtime.settings.jobs_topic, self.identity.event(
                ev.Heartbeat, sequence=self.heartbeats, frames_done=frames_done, frames_total=frames_total,
                out_time_s=out_time_s, speed=speed, progress_grace_s=progress_grace_s, tool_state=tool_state))],
                point=point)
        except WriterFenced:
            raise
        except EventLogError as exc:
            # The log refused this one (a partition or the transaction coordinator without a leader
            # while a broker is replaced): the attempt goes on and the next call tries again, since
            # `last_heartbeat` did not move. Only the lease bounds how long heartbeats may fail; a
            # newer owner still stops it (`Fenced` from `transact`, or `check_still_owner`).
            self.heartbeat_failures += 1
            log.warning("heartbeat not written; the next one tries again", job_id=self.identity.job_id,
                        attempt=self.identity.attempt, failures=self.heartbeat_failures, error=str(exc))
            return
        self.last_heartbeat = started
        self.check_still_owner()

    def prove_ownership(self) -> None:
        """Right before an external side effect: a heartbeat in a transaction on the attempt's fenced
        producer (a newer attempt's `init_transactions` makes it fail with `Fenced`), then the
        projection check. A paused zombie that wakes up here stops before acting. Written with
        `record`, which tries again while the log refuses it: with `send`, one refusal during a
        broker outage failed the publish attempt after it had claimed the post, and its retry could
        only end in `needs_review` (seen in CI with two of three brokers down)."""
        self.heartbeats += 1
        self.last_heartbeat = time.monotonic()
        self.record([(self.runtime.settings.jobs_topic, self.identity.event(
            ev.Heartbeat, sequence=self.heartbeats, frames_done=0, frames_total=None, out_time_s=0.0, speed=None))])
        self.check_still_owner()

    def check_still_owner(self) -> None:
        """Raise `Fenced` when the projection shows a newer attempt or an ended job (the watchdog
        declared this attempt stalled, or an operator acted): stop, kill ffmpeg, commit nothing.
        Reads the projection without waiting for it to catch up: late news is still news."""
        identity = self.identity
        row = self.runtime.jobs.one("job_status", {"job_id": identity.job_id})
        reason = superseded_reason(row, identity.stage, identity.attempt, identity.claim_token)
        if reason is not None:
            raise Fenced(f"attempt {identity.attempt} no longer owns job {identity.job_id}: {reason}")
        self.runtime.health.lease_renewed()

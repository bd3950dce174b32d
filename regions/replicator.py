"""`tapeline region replicate`: the media replicator from region A to region B (docs/regions.md
"Media replication", issue 25 item 3).

It follows region B's mirrored log (region B's Kafka, `read_committed`, the lifecycle topic and the
uploads topic, every partition assigned, no consumer group), and for each record:

1. decodes it and asks `domain/replication.py` `objects_named` which objects it names (an
   undecodable record names none: the projector dead-letters it, the replicator moves on);
2. for each object not yet replicated with the same sha256, copies it from region A's store to
   region B's, verified (`regions/media_copy.py` `copy_object`), and records the outcome in region
   B's PostgreSQL at once (`region_objects`: replicated, or pending with the reason);
3. when every object of the record is replicated or recorded as pending, advances the partition's
   progress (`region_replication_progress.next_offset`).

A store that does not answer keeps the replicator on the record (`after_failure`: WAIT, backoff);
an object missing in A or not matching its sha256 is parked as pending and retried from the table
when due. A kill -9 loses at most the object being copied: its row is not written, so it is copied
again (B already holding the same bytes is read back and recorded `written = false`); objects
already recorded are skipped. One replicator at a time: a PostgreSQL session lock.
"""

from __future__ import annotations

import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg
import structlog

from domain import events as ev
from domain.codec import decode
from domain.errors import DecodeError, SchemaError, ServiceUnavailable
from domain.replication import NamedObject, Verdict, after_failure, objects_named, retry_delay_s
from tapeline import kafka, kafka_scan
from tapeline.clock import Clock, system_clock
from tapeline.crashpoints import crash_point
from regions.media_copy import Copied, CopyFailed, copy_object
from tapeline.objectstore import ObjectStore
from tapeline.postgres import connect, migrate, q
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.replicator")

REPLICATOR_LOCK = 0x7A9E_0025
"""Advisory lock key of the one replicator of a region B database (issue 25)."""
RETRY_SCAN_S = 1.0
"""How often the replicator looks for pending objects due for another try, seconds."""
DUE_BATCH = 50
"""Pending objects tried per scan, at most."""


def replicator_dir(target: Settings) -> Path:
    """The replicator's directory under region B's home: its spool, and (started by the stack) its log
    and pid file."""
    return Path(target.home).resolve() / "replicator"


def followed_topics(target: Settings) -> list[str]:
    """The mirrored topics whose records name objects: the lifecycle topic and the uploads topic."""
    return [target.jobs_topic, target.uploads_topic]


def broker_time(message: Any) -> datetime:
    """A record's broker timestamp in region B (its arrival: B's topics are LogAppendTime), UTC."""
    return datetime.fromtimestamp(message.timestamp()[1] / 1000.0, timezone.utc)


UNDECODABLE = "undecodable"
"""The event type `named_in` gives a record that does not decode as an event."""


def named_in(message: Any) -> tuple[str, list[NamedObject]]:
    """(event type, the objects it names) of a record of region B's log; (`UNDECODABLE`, []) for a
    record that does not decode as an event (the projector dead-letters those). Logs nothing."""
    try:
        event = ev.Event.from_decoded(decode(message.value(), topic=message.topic(), partition=message.partition(),
                                             offset=message.offset()))
    except (DecodeError, SchemaError):
        return UNDECODABLE, []
    return event.event_type, objects_named(event)


class Replicator:
    """The loop (module docstring) for region A's settings `source` and region B's `target`."""

    def __init__(self, source: Settings, target: Settings, clock: Clock = system_clock,
                 workdir: Path | None = None) -> None:
        """`workdir`: where copies are spooled (default `<region B home>/replicator`)."""
        self.source, self.target, self.clock = source, target, clock
        self.source_store, self.target_store = ObjectStore(source), ObjectStore(target)
        self.spool = (workdir or replicator_dir(target)) / "spool"
        self.conn: psycopg.Connection | None = None
        self.copies = 0  # objects this process wrote to B (for its log)

    # -- the database ---------------------------------------------------------------------------

    def _open(self, stop: threading.Event) -> bool:
        """Open the session to region B's database and take the replicator's lock (waiting while another
        replicator holds it). False when `stop` was set first."""
        self.conn = connect(self.target.database_url, schema=self.target.db_schema, autocommit=True,
                            row_factory=psycopg.rows.dict_row)
        waited = False
        while not self.conn.execute(q("replication_lock"), {"key": REPLICATOR_LOCK}).fetchone()["locked"]:
            if not waited:
                log.warning("another replicator holds region B's lock; waiting")
                waited = True
            if stop.wait(2.0):
                return False
        return True

    def _row(self, key: str) -> dict[str, Any] | None:
        return self.conn.execute(q("region_object"), {"key": key}).fetchone()

    def _record_replicated(self, named: NamedObject, copied: Copied, where: dict[str, Any]) -> None:
        self.conn.execute(q("region_object_replicated"), {
            "key": named.key, "expected_sha256": named.sha256, "sha256": copied.sha256,
            "size_bytes": copied.size_bytes, "now": self.clock.now(), "written": copied.written, **where})

    def _record_pending(self, named: NamedObject, failed: CopyFailed, attempts: int, retry_at: datetime,
                        where: dict[str, Any]) -> None:
        self.conn.execute(q("region_object_pending"), {
            "key": named.key, "expected_sha256": named.sha256, "size_bytes": named.size_bytes,
            "attempts": attempts, "failure": failed.kind.value, "error": str(failed)[:1000],
            "next_try_at": retry_at, **where})

    # -- one object, one record ---------------------------------------------------------------------

    def _copy(self, named: NamedObject, where: dict[str, Any]) -> Copied:
        copied = copy_object(self.source_store, self.target_store, named, self.spool)
        crash_point("replicate.after_copy")  # in B, not recorded yet: a restart copies it again (written false)
        self._record_replicated(named, copied, where)
        self.copies += int(copied.written)
        log.info("object replicated", key=named.key, bytes=copied.size_bytes, written=copied.written)
        return copied

    def replicate_record(self, message: Any, stop: threading.Event) -> bool:
        """Replicate every object `message` names, then advance its partition's progress. Waits (with
        backoff) while a store does not answer; parks objects that are missing or do not match.
        Returns False when `stop` was set before the record was done (its progress not advanced)."""
        event_type, named_all = named_in(message)
        if event_type == UNDECODABLE:
            log.warning("undecodable record names no object", topic=message.topic(), partition=message.partition(),
                        offset=message.offset())
        where = {"named_by": event_type, "named_at": broker_time(message), "topic": message.topic(),
                 "partition": message.partition(), "offset": message.offset()}
        waits = 0
        for named in named_all:
            while True:
                row = self._row(named.key)
                if row is not None and row["state"] == "replicated" and named.sha256 in (None, row["sha256"]):
                    break  # already in B with these bytes
                try:
                    self._copy(named, where)
                    break
                except CopyFailed as failed:
                    attempts = (row["attempts"] if row else 0) + 1
                    decision = after_failure(failed.kind, max(attempts, waits + 1), self.clock.now(),
                                             first_s=self.target.replicate_retry_first_s,
                                             max_s=self.target.replicate_retry_max_s)
                    if decision.verdict is Verdict.PARK:
                        self._record_pending(named, failed, attempts, decision.retry_at, where)
                        log.warning("object pending", key=named.key, failure=failed.kind.value, attempts=attempts,
                                    retry_in_s=decision.delay_s, error=str(failed)[:300])
                        break
                    waits += 1
                    log.warning("store unavailable; waiting on the record", key=named.key, retry_in_s=decision.delay_s,
                                error=str(failed)[:300])
                    if stop.wait(decision.delay_s):
                        return False
        crash_point("replicate.before_advance")
        self.conn.execute(q("replication_advance"), {"topic": message.topic(), "partition": message.partition(),
                                                     "next_offset": message.offset() + 1})
        return True

    def retry_due(self, stop: threading.Event) -> int:
        """Try again every pending object whose time has come (at most DUE_BATCH); returns how many
        were replicated now."""
        done = 0
        for row in self.conn.execute(q("region_objects_due"), {"now": self.clock.now(), "limit": DUE_BATCH}).fetchall():
            if stop.is_set():
                break
            named = NamedObject(row["object_key"], row["expected_sha256"], row["size_bytes"])
            where = {"named_by": row["named_by"], "named_at": row["named_at"], "topic": row["source_topic"],
                     "partition": row["source_partition"], "offset": row["source_offset"]}
            try:
                self._copy(named, where)
                done += 1
            except CopyFailed as failed:
                attempts = row["attempts"] + 1
                decision = after_failure(failed.kind, attempts, self.clock.now(),
                                         first_s=self.target.replicate_retry_first_s,
                                         max_s=self.target.replicate_retry_max_s)
                self._record_pending(named, failed, attempts, decision.retry_at, where)
                log.warning("object still pending", key=named.key, failure=failed.kind.value, attempts=attempts,
                            retry_in_s=decision.delay_s)
        return done

    # -- the loop -----------------------------------------------------------------------------------

    def run(self, stop: threading.Event, ready: threading.Event | None = None) -> None:
        """Replicate until `stop` is set (module docstring). `ready` is set once the lock is held and
        every partition is assigned. Region B's PostgreSQL lost while running (or a followed topic missing)
        is retried with backoff, the log read again from the recorded progress; Kafka and S3 outages are waited
        out. Raises ServiceUnavailable when region B's PostgreSQL does not answer at start."""
        migrate(self.target.database_url, self.target.db_schema, self.target.reader_role)
        lost = 0
        try:
            while not stop.is_set():
                try:
                    self._follow(stop, ready)
                    return
                except (psycopg.OperationalError, ServiceUnavailable) as exc:  # B's PostgreSQL went away, a topic missing
                    lost += 1
                    delay = retry_delay_s(lost, self.target.replicate_retry_first_s, self.target.replicate_retry_max_s)
                    log.warning("region B's PostgreSQL or log did not answer; reading again from the recorded progress",
                                error=str(exc)[:300], retry_in_s=delay)
                    stop.wait(delay)
        finally:
            log.info("replicator stopped", objects_written=self.copies)

    def _follow(self, stop: threading.Event, ready: threading.Event | None) -> None:
        """One session: open it and take the lock, assign every followed partition at its recorded
        progress, replicate record after record (and due retries) until `stop`."""
        if not self._open(stop):
            return
        consumer = kafka.consumer(self.target, f"{self.target.app_name}.region-replicator",
                                  **{"enable.partition.eof": False})
        try:
            progress = {(r["topic"], r["partition"]): r["next_offset"]
                        for r in self.conn.execute(q("replication_progress")).fetchall()}
            positions = {(topic, partition): progress.get((topic, partition))
                         for topic in followed_topics(self.target)
                         for partition in range(kafka.partition_count(consumer, topic, timeout_s=60.0))}
            resumed = kafka_scan.assign_from(consumer, positions)
            log.info("replicating", source=self.source.s3_endpoint, target=self.target.s3_endpoint,
                     log=self.target.kafka_bootstrap_servers, partitions=len(positions), resumed=resumed)
            if ready is not None:
                ready.set()
            next_scan = 0.0
            while not stop.is_set():
                now_s = self.clock.now().timestamp()
                if now_s >= next_scan:
                    self.retry_due(stop)
                    next_scan = now_s + RETRY_SCAN_S
                message = consumer.poll(0.5)
                if message is None:
                    continue
                if message.error() is not None:
                    log.warning("read error", error=str(message.error()))
                    continue
                if not self.replicate_record(message, stop):
                    break
        finally:
            consumer.close()
            if self.conn is not None:
                self.conn.close()
                self.conn = None

"""Media replication measured: the reads behind the objects line of `tapeline region status`.

What the figures mean is `domain/replication.py` `object_totals` (pure). This module reads region B
only: the replicator's rows and progress in region B's PostgreSQL, and the records of region B's
mirrored log the replicator has not read yet (from its progress to the end of each partition), whose
objects count as pending (`unread`) unless already recorded.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import psycopg

from domain.replication import NamedObject, ObjectTotals, RecordedObject, object_totals
from tapeline import kafka_scan
from tapeline.postgres import connect, q
from regions.replicator import broker_time, followed_topics, named_in
from tapeline.settings import Settings


def _recorded(target: Settings) -> tuple[list[RecordedObject], dict[tuple[str, int], int]]:
    """The replicator's rows and per-partition progress in region B's database (none when it never ran
    there: the tables are missing until its first start migrates the database)."""
    with connect(target.database_url, schema=target.db_schema, autocommit=True,
                 row_factory=psycopg.rows.dict_row) as conn:
        try:
            rows = conn.execute(q("region_objects_all")).fetchall()
            progress = conn.execute(q("replication_progress")).fetchall()
        except psycopg.errors.UndefinedTable:
            return [], {}
    return ([RecordedObject(r["object_key"], r["state"], r["size_bytes"], r["named_at"], r["failure"]) for r in rows],
            {(r["topic"], r["partition"]): r["next_offset"] for r in progress})


def _unread(target: Settings, progress: dict[tuple[str, int], int], scan_limit: int,
            timeout_s: float) -> tuple[list[tuple[NamedObject, datetime]], bool]:
    """The objects named by records of region B's followed topics past the replicator's progress, with
    each record's broker time; and whether every such record was read (False: more than `scan_limit`
    records, or `timeout_s` passed)."""
    consumer = kafka_scan.committed_reader(target, "region-objects")
    found: list[tuple[NamedObject, datetime]] = []
    try:
        todo = kafka_scan.bounds(consumer, followed_topics(target), start_at=progress, timeout_s=timeout_s).ranges()
        if sum(high - start for start, high in todo.values()) > scan_limit:
            return found, False
        if not todo:
            return found, True

        def take(message: Any) -> bool:
            at = broker_time(message)
            found.extend((named, at) for named in named_in(message)[1])
            return True

        return found, kafka_scan.scan(consumer, todo, take, timeout_s) >= set(todo)
    finally:
        consumer.close()


def measure_objects(target: Settings, *, scan_limit: int = 200_000, timeout_s: float = 30.0) -> tuple[ObjectTotals, bool]:
    """(the object totals of region B, whether the unread tail of its log was read whole) for region
    B's settings `target`. Raises ServiceUnavailable when region B's PostgreSQL or Kafka does not
    answer, or a followed topic is missing."""
    recorded, progress = _recorded(target)
    unread, whole = _unread(target, progress, scan_limit, timeout_s)
    return object_totals(recorded, unread), whole


def objects_report(target: Settings, *, timeout_s: float = 30.0, now: datetime | None = None) -> dict:
    """`region status`'s `objects`: `object_totals` as a dict (`ObjectTotals.as_dict`) with `exact`
    (the unread tail was read whole), or `{"error": ...}` when region B could not be read."""
    try:
        totals, whole = measure_objects(target, timeout_s=timeout_s)
    except Exception as exc:  # a region B service that does not answer: said, not raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {**totals.as_dict(now or datetime.now(timezone.utc)), "exact": whole}

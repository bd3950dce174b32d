"""The projector: `<prefix>.jobs`, `<prefix>.uploads` and `<prefix>.dlq` -> PostgreSQL, exactly once.

Commit protocol, per batch of records (one PostgreSQL transaction):
  Step 1. decode every record; an undecodable one becomes a `dead_letters` row, never a crash;
  Step 2. load the rows of the batch's jobs and which of its dedup keys were already applied;
  Step 3. fold each event onto its job in log order (`lifecycle.evolve`), a repeated dedup key only
          as evidence;
  Step 4. write evidence, uploads, job rows and applied dedup keys;
  Step 5. advance `projector_offsets` for each partition to the next offset;
  Step 6. commit. A crash before step 6 leaves nothing; the restart resumes at the stored offsets.
Steps 1 and 3 (`decode_batch`, `fold_batch`) are shared with the bulk replay (`projections/bulk.py`).
The consumer is assigned its partitions at the stored offsets (no consumer-group commits), reads
committed records only, and on reaching a partition's end stores that position too, so "caught up"
can be judged against the last stable offset even after transaction markers.
"""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
import structlog
from psycopg import sql as psql
from confluent_kafka import OFFSET_BEGINNING, KafkaError, Message, TopicPartition
from psycopg.types.json import Jsonb

from domain import lifecycle
from projections import writes
from projections.batch import BatchResult  # noqa: F401 - re-exported: `projector.BatchResult` as before
from tapeline.lag import LagObserver
from projections.pgschema import LiveGuard, SchemaSwapped, schema_oid
from tapeline.postgres import connect, identifiers, migrate, q, qf
from domain import events as ev
from domain.codec import default_codec
from tapeline import kafka
from tapeline.kafka import broker_time
from tapeline.crashpoints import crash_point
from domain.errors import DecodeError, SchemaError
from tapeline.health import HealthState
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.projector")
JSON_COLUMNS = frozenset({"ladder", "outputs", "renditions"})


def _upsert_job_sql() -> psql.Composed:
    """The named query `upsert_job_state` for the job_state columns of `schemas/lifecycle.json`: the
    statement is generated from that column list, so it is composed (once, at import) from the template."""
    columns = lifecycle.JOB_STATE_COLUMNS
    updates = psql.SQL(", ").join(qf("upsert_job_state_update", column=c) for c in columns if c != "job_id")
    return qf("upsert_job_state", columns=identifiers(columns),
              values=psql.SQL(", ").join(psql.Placeholder(c) for c in columns), updates=updates)


UPSERT_JOB = _upsert_job_sql()


KeySetLike = Any  # `in` and `add` over dedup keys, e.g. `projections.bulk.KeySet`
Decoded = tuple[Message, "ev.Event | None", "str | None"]
"""A message with its event, or None and why it could not be decoded."""


def decode_batch(messages: list[Message], result: BatchResult,
                 end_positions: dict[tuple[str, int], int] | None = None) -> list[Decoded]:
    """Step 1: decode each message (an undecodable one keeps its error) and record in `result` the
    position after each message and the partition ends reached (`end_positions`)."""
    codec = default_codec()
    decoded: list[Decoded] = []
    positions = result.positions
    for message in messages:
        topic, partition, offset = message.topic(), message.partition(), message.offset()
        try:
            record = codec.decode(message.value(), topic=topic, partition=partition, offset=offset)
            decoded.append((message, ev.Event.from_decoded(record), None))
        except (DecodeError, SchemaError) as exc:
            decoded.append((message, None, str(exc)))
        positions[(topic, partition)] = offset + 1
    for position, offset in (end_positions or {}).items():
        if offset > 0:  # an empty partition needs no row: a missing row means offset 0 (and a replay stores none)
            positions[position] = max(positions.get(position, 0), offset)
    return decoded


@dataclass
class Folded:
    """What step 3 produced for one batch, for step 4 to write.

    `evidence`: rows in `writes.EVIDENCE_COLUMNS` order; `uploads`, `dead`, `replays`: parameters of
    `upsert_upload`, `upsert_dead_letter` and `mark_dead_letter_replayed`, in log order; `new_keys`:
    dedup keys applied by this batch; `changed`: job ids whose row in `rows` changed; `clock`: the
    latest broker time seen per partition of the clock topic.
    """

    evidence: list[tuple] = field(default_factory=list)
    uploads: list[dict[str, Any]] = field(default_factory=list)
    dead: list[dict[str, Any]] = field(default_factory=list)
    replays: list[dict[str, Any]] = field(default_factory=list)
    new_keys: list[str] = field(default_factory=list)
    changed: set[str] = field(default_factory=set)
    clock: dict[int, datetime] = field(default_factory=dict)


def fold_batch(decoded: list[Decoded], rows: dict[str, dict[str, Any]], seen: "set[str] | KeySetLike",
               result: BatchResult, clock_topic: str | None = None, dlq_topic: str | None = None,
               binary_payload: bool = False) -> Folded:
    """Step 3, shared by the projector and the bulk replay (`projections/bulk.py`): fold each
    decoded record onto `rows` (job id -> `job_state` row, updated in place) in log order, a dedup
    key already in `seen` (updated in place) only as evidence. Counts go to `result`.

    An evidence row's `payload` is the JSON text of the event's fields that have no evidence column
    of their own (`writes.PAYLOAD_OMITS` left out), or with `binary_payload` the same JSON as UTF-8 bytes
    (json's binary COPY format is its text) for a binary COPY.
    """
    out = Folded()
    evidence, clock = out.evidence, out.clock
    last_millis, ts = None, None
    for message, event, error in decoded:
        topic, partition, offset = message.topic(), message.partition(), message.offset()
        millis = message.timestamp()[1]
        if millis != last_millis:  # records of one producer batch share their LogAppendTime
            last_millis, ts = millis, broker_time(message)
        if topic == clock_topic:
            now = clock.get(partition)
            if now is None or ts > now:
                clock[partition] = ts
        if isinstance(event, ev.WatchdogTick):
            continue
        payload = None
        if event is not None and topic != dlq_topic:  # (a DeadLetter's raw bytes become bytea, not JSON)
            # JSON text (what model_dump_json returns), stored as written (a json column)
            payload = event.__pydantic_serializer__.to_json(event, exclude=writes.PAYLOAD_OMITS)
            error = unstorable(event, payload)
            if error is not None:
                event = None  # a dead letter, like an undecodable record: PostgreSQL cannot hold it
        if event is None:
            out.dead.append(_dead_letter(
                f"{topic}/{partition}/{offset}", "projection", topic, partition, offset, ts, error, "projector",
                key=message.key(), value=message.value(), headers=message.headers(), error_class="invalid_input",
                evidence=f"{topic}/{partition}/{offset}"))
            result.dead_letters += 1
            continue
        if topic == dlq_topic:
            if isinstance(event, ev.DeadLetter):
                out.dead.append(_dead_letter(
                    f"{event.source_topic}/{event.source_partition}/{event.source_offset}", "record",
                    event.source_topic, event.source_partition, event.source_offset, ts, event.error,
                    event.processor, key=event.key, value=event.value, headers=list(event.headers.items()),
                    error_class=event.error_class, stage=event.stage, evidence=f"{topic}/{partition}/{offset}"))
                result.dead_letters += 1
            continue
        if isinstance(event, ev.UploadCompleted):
            out.uploads.append({"upload_id": event.upload_id, "job_id": event.job_id, "filename": event.filename,
                                "size_bytes": event.size_bytes, "sha256": event.sha256, "priority": event.priority,
                                "broker_ts": ts, "submitter": event.submitter})
            continue
        duplicate = event.dedup_key in seen
        applied = superseded = False
        if not duplicate:
            try:
                row, applied, superseded = lifecycle.evolve(rows.get(event.job_id), event, ts)
            except (ArithmeticError, ValueError, TypeError) as exc:  # e.g. a lease of NaN or 1e12 seconds
                out.dead.append(_dead_letter(
                    f"{topic}/{partition}/{offset}", "projection", topic, partition, offset, ts,
                    f"{event.event_type} cannot be applied to its job: {type(exc).__name__}: {exc}", "projector",
                    key=message.key(), value=message.value(), headers=message.headers(),
                    error_class="invalid_input", job_id=event.job_id, stage=event.stage, attempt=event.attempt,
                    evidence=f"{topic}/{partition}/{offset}"))
                result.dead_letters += 1
                row = None  # kept as evidence, not applied
                applied = superseded = False
            if applied and row is not None:
                row["log_partition"] = partition  # a new dict of evolve's own (lifecycle.Outcome)
                rows[event.job_id] = row
                out.changed.add(event.job_id)
                seen.add(event.dedup_key)
                out.new_keys.append(event.dedup_key)
                if isinstance(event, ev.JobDeadLettered):
                    out.dead.append(_dead_letter(
                        f"{event.job_id}/{event.attempt}", "job", topic, partition, offset, ts, event.reason,
                        event.recorded_by.split("@", 1)[0], error_class=event.error_class, job_id=event.job_id,
                        stage=event.stage, attempt=event.attempt, attempts=event.attempts, evidence=event.evidence))
                elif isinstance(event, ev.JobReplayed) and event.dead_letter_id:
                    out.replays.append({"id": event.dead_letter_id, "broker_ts": ts, "operator": event.operator,
                                        "reason": event.reason})
        result.applied += applied
        result.duplicates += duplicate
        result.superseded += superseded
        evidence.append((  # writes.EVIDENCE_COLUMNS order
            topic, partition, offset, ts, event.event_id, event.event_type, event.job_id, event.stage, event.attempt,
            event.claim_token, event.dedup_key, event.occurred_at, event.recorded_by, event.causation_id, applied,
            superseded, duplicate, payload if binary_payload else payload.decode()))
    return out


def _holds_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(key) or _holds_nul(item) for key, item in value.items())
    if isinstance(value, list):
        return any(_holds_nul(item) for item in value)
    return False


_ENVELOPE_TEXT = ("event_id", "event_type", "job_id", "stage", "claim_token", "dedup_key", "recorded_by",
                  "correlation_id", "causation_id")


def unstorable(event: ev.Event, payload: bytes) -> str | None:
    """Why PostgreSQL cannot store `event` (its envelope's text columns and `payload`, its other
    fields as JSON text), or None. The one such value Avro allows: a NUL character in a string,
    which `text` cannot hold (nor jsonb, the payload's type before migration 018; json stores the
    escape `\\u0000` but every `->>` read of that field fails)."""
    if b"\\u0000" in payload and _holds_nul(json.loads(payload)):  # (not a literal backslash-u0000)
        return f"{event.event_type} holds a NUL character in a string field; PostgreSQL text cannot store it"
    values = event.__dict__
    for name in _ENVELOPE_TEXT:
        value = values.get(name)
        if value is not None and "\x00" in value:
            return f"{event.event_type} holds a NUL character in {name}; PostgreSQL text cannot store it"
    return None


def apply_batch(conn: psycopg.Connection, messages: list[Message], projection: str = "main",
                end_positions: dict[tuple[str, int], int] | None = None, clock_topic: str | None = None,
                guard: LiveGuard | None = None, dlq_topic: str | None = None) -> BatchResult:
    """Apply `messages` (in consumption order) and advance offsets, in one transaction on `conn`.

    `conn` must be in autocommit mode so that `conn.transaction()` is a real BEGIN/COMMIT.
    `clock_topic` (the lifecycle log) is the topic whose broker timestamps advance `log_clock`;
    its `WatchdogTick` records advance the clock and are not kept as evidence. Records of `dlq_topic`
    (the dead-letter topic) become `dead_letters` rows only: a `DeadLetter` is a record a processor
    could not decode; the copy of a `JobDeadLettered` there is skipped, because its lifecycle-log
    original makes the row (in the same transaction as the job's state).
    """
    result = BatchResult(records=len(messages))
    # Step 1: decode.
    decoded = decode_batch(messages, result, end_positions)

    with conn.transaction():
        if guard is not None:  # the swap lock (shared) and "is the live schema still ours?" (pgschema.py)
            guard.check(conn)
        # Step 2: load current rows and applied dedup keys.
        job_ids = list({event.job_id for _, event, _ in decoded if event is not None})
        rows = {row["job_id"]: row for row in conn.execute(q("job_state_by_ids"), {"job_ids": job_ids}).fetchall()} \
            if job_ids else {}
        keys = list({event.dedup_key for _, event, _ in decoded if event is not None})
        seen = {r["dedup_key"] for r in conn.execute(q("applied_dedup_keys_among"), {"keys": keys}).fetchall()} \
            if keys else set()
        # Step 3: fold in log order.
        folded = fold_batch(decoded, rows, seen, result, clock_topic, dlq_topic)
        # Step 4: write.
        with conn.cursor() as cur:
            if folded.evidence:
                writes.write_evidence(conn, folded.evidence)  # COPY; row by row only for a redelivery
            if folded.uploads:
                cur.executemany(q("upsert_upload"), folded.uploads)
            write_dead_letters(cur, folded)
            if folded.changed:
                cur.executemany(UPSERT_JOB, [job_params(rows[job_id]) for job_id in folded.changed])
            if folded.new_keys:
                writes.write_dedup_keys(conn, folded.new_keys)
            if folded.clock:
                cur.executemany(q("advance_log_clock"),
                                [{"partition": p, "now": now} for p, now in folded.clock.items()])
            # Step 5: offsets, in the same transaction.
            write_offsets(cur, projection, result.positions)
        if messages:
            crash_point("projector.before_commit")
    # Step 6: the `with conn.transaction()` block committed.
    if messages:
        crash_point("projector.after_commit")
    return result


def write_dead_letters(cur: psycopg.Cursor, folded: Folded) -> None:
    """A batch's dead letters, then the replays it marks (the order every batch uses)."""
    if folded.dead:
        cur.executemany(q("upsert_dead_letter"), folded.dead)
    if folded.replays:
        cur.executemany(q("mark_dead_letter_replayed"), folded.replays)


def write_offsets(cur: psycopg.Cursor, projection: str, positions: dict[tuple[str, int], int]) -> None:
    """Advance `projector_offsets` (never backwards) to `positions` ((topic, partition) -> next offset)."""
    if positions:
        cur.executemany(q("upsert_offset"), [
            {"projection": projection, "topic": topic, "partition": partition, "next_offset": offset}
            for (topic, partition), offset in positions.items()])


def _dead_letter(id: str, kind: str, topic: str | None, partition: int | None, offset: int | None,
                 broker_ts: datetime, error: str, seen_by: str, *, key: bytes | None = None,
                 value: bytes | None = None, headers: list[tuple[str, bytes | None]] | None = None,
                 error_class: str | None = None, job_id: str | None = None, stage: str | None = None,
                 attempt: int | None = None, attempts: int | None = None, evidence: str | None = None
                 ) -> dict[str, Any]:
    """Parameters of `upsert_dead_letter` (migration 005 documents each column)."""
    encoded = {name: base64.b64encode(raw or b"").decode() for name, raw in headers} if headers else None
    return {"id": id, "kind": kind, "topic": topic, "partition": partition, "offset": offset, "broker_ts": broker_ts,
            "key": key, "value": value, "headers": Jsonb(encoded) if encoded is not None else None, "error": error,
            "job_id": job_id, "stage": stage, "attempt": attempt, "error_class": error_class, "attempts": attempts,
            "evidence": evidence, "seen_by": [seen_by]}


OTHER_CLUSTER = "this database's projections were built from another Kafka cluster; refusing to mix them"
OTHER_CLUSTER_FIX = ("rebuild: `tapeline replay --into fresh` then `--swap fresh`, or point TAPELINE_DATABASE_URL "
                     "at a new database (locally: `runuser -u postgres -- dropdb tapeline`, then `make demo`)")


def other_cluster(conn: psycopg.Connection, cluster_id: str, projection: str = "main") -> str | None:
    """The Kafka cluster id `projection` was built from, when it is not `cluster_id` (the broker's);
    None when they match or nothing is recorded yet. The projector idles on a mismatch."""
    row = conn.execute(q("projection_cluster_id"), {"projection": projection}).fetchone()
    stored = None if row is None else (row["cluster_id"] if isinstance(row, dict) else row[0])
    return stored if stored is not None and stored != cluster_id else None


def job_params(row: dict[str, Any]) -> dict[str, Any]:
    """`row` as parameters of `UPSERT_JOB` (JSON columns wrapped as jsonb)."""
    return {c: (Jsonb(row[c]) if c in JSON_COLUMNS and row.get(c) is not None else row.get(c))
            for c in lifecycle.JOB_STATE_COLUMNS}


PROJECTOR_LOCK = 0x7A9E_0003
"""First key of the advisory lock the active projector of a schema holds (0001 migrations, 0002 swap)."""


class Projector:
    """Runs the projection loop until `stop` is set. Stateless apart from PostgreSQL and Kafka."""

    def __init__(self, settings: Settings, projection: str = "main", batch_size: int = 1000,
                 lag_interval_s: float = 5.0) -> None:
        """`lag_interval_s`: seconds between lag measurements (`tapeline.lag.LagObserver`); 0 turns them off."""
        self.settings, self.projection, self.batch_size = settings, projection, batch_size
        self.lag_interval_s = lag_interval_s
        self.topics = [settings.jobs_topic, settings.uploads_topic, settings.dlq_topic]
        self.processed = 0
        self.health = HealthState("projector", settings.instance_id)  # `tapeline run` replaces it with the served one

    def same_cluster(self, conn: psycopg.Connection, consumer, stop: threading.Event) -> bool:
        """Record or check the Kafka cluster this projection's offsets belong to.

        Against another cluster (a recreated local broker, another environment) the stored offsets
        are meaningless: the projector logs why and idles (not ready) until stopped, rather than
        skipping or mixing records or crash-looping. Returns whether it may run.
        """
        cluster = consumer.list_topics(timeout=10).cluster_id
        conn.execute(q("record_projection_source"), {"projection": self.projection, "cluster_id": cluster})
        stored = other_cluster(conn, cluster, self.projection)
        if stored is None:
            return True
        log.error(OTHER_CLUSTER, stored_cluster=stored, broker_cluster=cluster, fix=OTHER_CLUSTER_FIX)
        while not stop.wait(1.0):
            pass
        return False

    def hold_projection(self, conn: psycopg.Connection, stop: threading.Event, poll_s: float = 1.0) -> bool:
        """Become the one projector of this schema's projection: take `PROJECTOR_LOCK` (a session
        advisory lock, second key the schema and projection name's hash) on `conn`, the connection
        every batch commits on, waiting in standby while another projector holds it.

        Two projectors applying one projection at once read the same stored offsets and applied the
        same records twice (upload copies counted twice, dedup keys and offsets racing, deadlocks on
        the evidence key): the lock makes the second one a standby that takes over when the first
        one's session ends (it stopped, crashed or lost its connection, which also ends its batches).
        Returns False when `stop` was set first.
        """
        name = f"{self.settings.db_schema}:{self.projection}"
        waiting = False
        while not stop.is_set():
            if conn.execute(q("try_projector_lock"), {"key": PROJECTOR_LOCK, "name": name}).fetchone()["held"]:
                if waiting:
                    log.info("projector took over the projection", projection=self.projection,
                             schema=self.settings.db_schema)
                return True
            if not waiting:
                log.warning("another projector applies this projection; standing by until it stops",
                            projection=self.projection, schema=self.settings.db_schema)
                waiting = True
            stop.wait(poll_s)
        return False

    def run(self, stop: threading.Event, ready: threading.Event | None = None) -> None:
        """Consume and apply batches until `stop` is set; sets `ready` once assigned and caught up once."""
        migrate(self.settings.database_url, self.settings.db_schema)
        conn = connect(self.settings.database_url, schema=self.settings.db_schema,
                       autocommit=True)  # each batch is one explicit transaction
        lag = None
        guard = LiveGuard()
        guard.oid = schema_oid(conn)  # before reading the offsets: a swap in between is caught by the first batch
        conn.row_factory = psycopg.rows.dict_row
        consumer = kafka.consumer(self.settings, f"{self.settings.app_name}.projector",
                                  **{"enable.partition.eof": True,  # learn "caught up" at each partition's end
                                     "fetch.wait.max.ms": 100})  # low latency: processors wait on the projection
        try:
            if not self.hold_projection(conn, stop):
                return
            if not self.same_cluster(conn, consumer, stop):
                return
            stored = {(r["topic"], r["partition"]): r["next_offset"]
                      for r in conn.execute(q("offsets_of_projection"), {"projection": self.projection})}
            assignment = []
            for topic in self.topics:
                for partition in range(kafka.partition_count(consumer, topic)):
                    assignment.append(TopicPartition(topic, partition, stored.get((topic, partition), OFFSET_BEGINNING)))
            consumer.assign(assignment)
            log.info("projector assigned", partitions=len(assignment), projection=self.projection)
            if self.lag_interval_s > 0:  # its own thread, consumer and connection: metrics only
                lag = LagObserver(self.settings, self.health, self.projection, self.lag_interval_s).start()
            at_end: set[tuple[str, int]] = set()
            while not stop.is_set():
                messages = next_batch(consumer, self.batch_size)
                records, ends = [], {}
                for message in messages:
                    error = message.error()
                    if error is None:
                        records.append(message)
                    elif error.code() == KafkaError._PARTITION_EOF:
                        ends[(message.topic(), message.partition())] = message.offset()
                        at_end.add((message.topic(), message.partition()))
                    else:
                        log.warning("consumer error", error=str(error))
                if records or ends:
                    try:
                        result = apply_batch(conn, records, self.projection, ends, clock_topic=self.settings.jobs_topic,
                                             guard=guard, dlq_topic=self.settings.dlq_topic)
                    except SchemaSwapped:  # rolled back; resume from the new live schema's own offsets
                        stored = {(r["topic"], r["partition"]): r["next_offset"]
                                  for r in conn.execute(q("offsets_of_projection"), {"projection": self.projection})}
                        assignment = [TopicPartition(tp.topic, tp.partition, stored.get((tp.topic, tp.partition),
                                                                                        OFFSET_BEGINNING))
                                      for tp in assignment]
                        consumer.assign(assignment)
                        log.info("live schema swapped; re-seeked at its stored offsets", projection=self.projection)
                        continue
                    self.processed += result.records
                    self.health.consumed_messages(records)
                    if result.records:
                        log.info("batch applied", records=result.records, applied=result.applied,
                                 duplicates=result.duplicates, superseded=result.superseded,
                                 dead_letters=result.dead_letters)
                if ready is not None and not ready.is_set() and len(at_end) >= len(assignment):
                    ready.set()
                if not self.health.is_ready and len(at_end) >= len(assignment):
                    self.health.mark_ready()  # reached the end of every partition once
                self.health.observe_lag(consumer)
        finally:
            if lag is not None:
                lag.stop()
            consumer.close()
            conn.close()


def next_batch(consumer, batch_size: int, wait_s: float = 0.5) -> list[Message]:
    """Up to `batch_size` messages (and partition-end events): waits at most `wait_s` seconds for
    the first, then takes only what has already arrived.

    `Consumer.consume(n, timeout)` returns only when n messages arrived or the timeout passed, so a
    quiet log delayed every batch by the whole timeout (0.5 s): every processor that reconciles
    against the projection waited for it (seen in the claim timings).
    """
    first = consumer.poll(wait_s)
    if first is None:
        return []
    return [first] + (consumer.consume(batch_size - 1, timeout=0) if batch_size > 1 else [])

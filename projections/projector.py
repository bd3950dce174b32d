"""The projector: `<prefix>.jobs`, `<prefix>.uploads` and `<prefix>.dlq` -> PostgreSQL, exactly once.

Commit protocol, per batch of records (one PostgreSQL transaction):
  Step 1. decode every record; an undecodable one becomes a `dead_letters` row, never a crash;
  Step 2. load the rows of the batch's jobs and which of its dedup keys were already applied;
  Step 3. fold each event onto its job in log order (`lifecycle.evolve`), a repeated dedup key only
          as evidence;
  Step 4. write evidence, uploads, job rows and applied dedup keys;
  Step 5. advance `projector_offsets` for each partition to the next offset;
  Step 6. commit. A crash before step 6 leaves nothing; the restart resumes at the stored offsets.
Steps 1 and 3 are pure (`projections/fold.py`, shared with the bulk replay); steps 2, 4 and 5 are
the PostgreSQL writes of `projections/writes.py`. The loop reads the log through the event-log port
(`tapeline.ports.EventLog.assigned_reader`, built by `cli/wiring.py` `build_projector`): it is
assigned its partitions at the stored offsets (no consumer-group commits), reads committed records
only, and on reaching a partition's end stores that position too, so "caught up" can be judged
against the last stable offset even after transaction markers.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import psycopg
import structlog

from projections import writes
from projections.batch import BatchResult
from projections.fold import decode_batch, fold_batch
from projections.pgschema import LiveGuard, SchemaSwapped, schema_oid
from tapeline.crashpoints import crash_point
from tapeline.health import HealthState
from tapeline.ports import AssignedReader, EventLog, LogRecord, PartitionEnd, ReadError
from tapeline.postgres import connect, leader_session, migrate, q
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.projector")


def projected_topics(settings: Settings) -> list[str]:
    """The topics the projections are built from, in assignment order."""
    return [settings.jobs_topic, settings.uploads_topic, settings.dlq_topic]


def apply_batch(conn: psycopg.Connection, messages: list[LogRecord], projection: str = "main",
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
        rows, seen = writes.load_batch_state(conn, decoded)
        # Step 3: fold in log order.
        folded = fold_batch(decoded, rows, seen, result, clock_topic, dlq_topic)
        # Step 4: write.
        writes.write_folded(conn, folded, rows)
        # Step 5: offsets, in the same transaction.
        with conn.cursor() as cur:
            writes.write_offsets(cur, projection, result.positions)
        if messages:
            crash_point("projector.before_commit")
    # Step 6: the `with conn.transaction()` block committed.
    if messages:
        crash_point("projector.after_commit")
    return result


OTHER_CLUSTER = "this database's projections were built from another Kafka cluster; refusing to mix them"
OTHER_CLUSTER_FIX = ("rebuild: `tapeline replay --into fresh` then `--swap fresh`, or point TAPELINE_DATABASE_URL "
                     "at a new database (locally: `tapeline run --stop` so no processor holds the database, "
                     "`runuser -u postgres -- dropdb tapeline`, then `make demo`)")


def other_cluster(conn: psycopg.Connection, cluster_id: str, projection: str = "main") -> str | None:
    """The Kafka cluster id `projection` was built from, when it is not `cluster_id` (the broker's);
    None when they match or nothing is recorded yet. The projector idles on a mismatch."""
    row = conn.execute(q("projection_cluster_id"), {"projection": projection}).fetchone()
    stored = None if row is None else (row["cluster_id"] if isinstance(row, dict) else row[0])
    return stored if stored is not None and stored != cluster_id else None


PROJECTOR_LOCK = 0x7A9E_0003
"""First key of the advisory lock the active projector of a schema holds (0001 migrations, 0002 swap)."""


class Projector:
    """Runs the projection loop until `stop` is set. Stateless apart from PostgreSQL and Kafka."""

    def __init__(self, settings: Settings, events: EventLog, projection: str = "main", batch_size: int = 1000,
                 observe_lag: Callable[[HealthState], Any] | None = None) -> None:
        """`events`: the event log the loop reads (`EventLog.assigned_reader`). `observe_lag(health)`:
        starts a lag observer (`tapeline.lag.LagObserver`, something with `stop()`) once assigned;
        None measures no lag."""
        self.settings, self.events, self.projection, self.batch_size = settings, events, projection, batch_size
        self.observe_lag = observe_lag
        self.topics = projected_topics(settings)
        self.processed = 0
        self.health = HealthState("projector", settings.instance_id)  # `tapeline run` replaces it with the served one

    def same_cluster(self, conn: psycopg.Connection, stop: threading.Event) -> bool:
        """Record or check the Kafka cluster this projection's offsets belong to.

        Against another cluster (a recreated local broker, another environment) the stored offsets
        are meaningless: the projector logs why and idles (not ready) until stopped, rather than
        skipping or mixing records or crash-looping. Returns whether it may run.
        """
        cluster = self.events.cluster_id()
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
        conn = connect(self.settings.database_url, schema=self.settings.db_schema,  # holds PROJECTOR_LOCK:
                       autocommit=True, **leader_session(self.settings))  # each batch is one explicit transaction
        lag = None
        guard = LiveGuard()
        guard.oid = schema_oid(conn)  # before reading the offsets: a swap in between is caught by the first batch
        conn.row_factory = psycopg.rows.dict_row
        reader = self.events.assigned_reader(f"{self.settings.app_name}.projector",
                                             **{"fetch.wait.max.ms": 100})  # low latency: processors wait on the projection
        try:
            if not self.hold_projection(conn, stop):
                return
            if not self.same_cluster(conn, stop):
                return
            stored = writes.stored_offsets(conn, self.projection)
            assignment = [(topic, partition) for topic in self.topics
                          for partition in range(self.events.partition_count(topic))]
            reader.assign([(topic, partition, stored.get((topic, partition))) for topic, partition in assignment])
            log.info("projector assigned", partitions=len(assignment), projection=self.projection)
            if self.observe_lag is not None:  # its own thread, consumer and connection: metrics only
                lag = self.observe_lag(self.health)
            at_end: set[tuple[str, int]] = set()
            while not stop.is_set():
                records, ends = [], {}
                for item in next_batch(reader, self.batch_size):
                    if isinstance(item, PartitionEnd):
                        ends[(item.topic, item.partition)] = item.offset
                        at_end.add((item.topic, item.partition))
                    elif isinstance(item, ReadError):
                        log.warning("consumer error", error=item.reason)
                    else:
                        records.append(item)
                if records or ends:
                    try:
                        result = apply_batch(conn, records, self.projection, ends, clock_topic=self.settings.jobs_topic,
                                             guard=guard, dlq_topic=self.settings.dlq_topic)
                    except SchemaSwapped:  # rolled back; resume from the new live schema's own offsets
                        stored = writes.stored_offsets(conn, self.projection)
                        reader.assign([(topic, partition, stored.get((topic, partition)))
                                       for topic, partition in assignment])
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
                self.health.observe_lag(reader)
        finally:
            if lag is not None:
                lag.stop()
            reader.close()
            self.events.close()
            conn.close()


def next_batch(reader: AssignedReader, batch_size: int, wait_s: float = 0.5) -> list:
    """Up to `batch_size` records (and partition ends): waits at most `wait_s` seconds for the first,
    then takes only what has already arrived.

    A single `consume(n, timeout)` returns only when n records arrived or the timeout passed, so a
    quiet log delayed every batch by the whole timeout (0.5 s): every processor that reconciles
    against the projection waited for it (seen in the claim timings).
    """
    first = reader.poll(wait_s)
    if first is None:
        return []
    return [first] + (reader.consume(batch_size - 1, timeout_s=0) if batch_size > 1 else [])

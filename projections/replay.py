"""Rebuild every projection from offset 0 into a schema of its own (`tapeline replay --into`).

The replay reads `<prefix>.jobs`, `<prefix>.uploads` and `<prefix>.dlq` (the projector's topics) from the log start
up to stop offsets fixed when it begins (the last stable offsets, or the first offsets at or after
`--as-of`). A fresh replay folds them with the projector's own decode and fold steps, in memory, and
writes with COPY in one transaction (`projections/bulk.py`); a catch-up (`fresh=False`, before a
swap) applies them with the projector's own `apply_batch`. Either way the result, offsets included,
is exactly what the projector would have built and can be swapped in and continued by it. It never
creates a producer. The schema records the broker's cluster id in `projection_source` (in the bulk
transaction, or after the last batch), as the projector does, so a swapped-in schema is checked
against the cluster at once; a catch-up of a schema built from another cluster is refused.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Callable, Iterator

import psycopg
import structlog

from projections import partition_plan, partitioned
from tapeline import kafka_scan
from projections.bulk import BulkReplay
from projections.native import NativeUnsupported, resolve_engine
from projections.pgschema import check_target_name, prepare_fresh, record_source
from projections.projector import OTHER_CLUSTER, OTHER_CLUSTER_FIX, apply_batch, other_cluster, projected_topics
from tapeline.postgres import connect, migrate, q, qf
from domain.errors import ConfigurationError
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.replay")


@dataclass
class ReplayResult:
    schema: str
    records: int = 0
    applied: int = 0
    duplicates: int = 0
    superseded: int = 0
    dead_letters: int = 0
    offsets_total: int = 0
    elapsed_s: float = 0.0
    """Wall seconds from reading the log's bounds to the commit, schema preparation included (and a
    native attempt that fell back); not the command's start-up."""
    rows: dict[str, int] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase (bulk path): read (consume from Kafka), decode, fold, copy_evidence,
    write_final_rows, build_indexes, commit; with workers, also wait (the writer idle) and encode,
    and read, decode, fold and encode are summed over the workers."""
    workers: int = 1
    """Processes that decoded and folded (`projections/partitioned.py`); 1: the replay's own."""
    rss_mb: float = 0.0
    """Peak resident memory in MB: the replay process's, plus each worker's peak when there were workers."""
    rss_mb_by_process: list[float] = field(default_factory=list)
    """With workers: each process's peak in MB, the replay process's first."""
    engine: str = "python"
    """The fold engine that built the schema (`projections/native.py`): native or python."""
    engine_note: str = ""
    """Why the Python engine replayed when native was wanted (empty otherwise)."""

    @property
    def events_per_s(self) -> float:
        return self.records / self.elapsed_s if self.elapsed_s else 0.0


def replay(settings: Settings, schema: str, *, as_of: datetime | None = None, force: bool = False,
           fresh: bool = True, batch_size: int = 5000, projection: str = "main", bulk: bool = True,
           workers: int | None = None, on_start: Callable[[int], None] | None = None,
           on_progress: Callable[[int], None] | None = None, engine: str = "auto") -> ReplayResult:
    """Rebuild into `schema`. `fresh`: start from an empty schema (refusing a non-empty one unless
    `force`); otherwise continue from the offsets stored in `schema` (a catch-up before a swap).

    `as_of` keeps records whose broker timestamp is at or before it. `on_start(total_offsets)` and
    `on_progress(offsets_done)` drive a progress bar. `bulk` (fresh only): the in-memory fold with
    COPY (`projections/bulk.py`, one transaction: a crash leaves the schema empty); False applies
    `batch_size` records per transaction with `apply_batch`, like the projector. `workers` (bulk
    only): processes that decode and fold, partitions split among them (`projections/partitioned.py`,
    still one transaction); None picks `partition_plan.default_workers`, 1 folds in this process.
    Raises `partitioned.ReplayFailed` (`partition_plan.py`) when a worker fails (rolled back).

    `engine` (bulk only): the fold engine, `auto` (native when `tapeline_native` imports), `native` or
    `python` (`projections/native.py`). When the native engine meets a log it cannot fold exactly,
    the replay is rolled back and done again with the Python engine, with a log line saying why.
    """
    check_target_name(schema)
    chosen = resolve_engine(engine) if fresh and bulk else "python"
    with replay_lock(settings.database_url, schema):
        args = dict(as_of=as_of, force=force, fresh=fresh, batch_size=batch_size, projection=projection, bulk=bulk,
                    workers=workers, on_start=on_start, on_progress=on_progress)
        if chosen == "native":
            began = time.monotonic()
            try:
                return _replay(settings, schema, engine="native", **args)
            except NativeUnsupported as exc:  # rolled back: the schema is as prepare_fresh left it, empty
                log.warning("native replay engine cannot fold this log exactly; replaying with the Python engine",
                            schema=schema, reason=str(exc))
                result = _replay(settings, schema, engine="python", **args)
                result.elapsed_s = time.monotonic() - began  # the rolled-back native attempt's time counts too
                result.engine_note = f"native engine fell back: {exc}"
                return result
        return _replay(settings, schema, engine="python", **args)


REPLAY_LOCK = 7_214_365
"""First key of the session advisory lock a replay into a schema holds (the second: the schema name's hash)."""


@contextmanager
def replay_lock(database_url: str, schema: str) -> Iterator[None]:
    """Hold `schema`'s replay lock (a PostgreSQL session advisory lock) for the block. Raises
    `ConfigurationError` at once when another replay into `schema` holds it: two replays into one
    schema would each commit a whole replay, the last silently replacing the first."""
    with connect(database_url, autocommit=True) as conn:
        held = conn.execute(q("try_replay_lock"), {"key": REPLAY_LOCK, "schema": schema}).fetchone()[0]
        if not held:
            raise ConfigurationError(f"another replay into {schema} is running; wait for it to end (or stop it)")
        try:
            yield
        finally:
            conn.execute(q("release_replay_lock"), {"key": REPLAY_LOCK, "schema": schema})


def _replay(settings: Settings, schema: str, *, as_of: datetime | None, force: bool, fresh: bool, batch_size: int,
            projection: str, bulk: bool, workers: int | None, on_start: Callable[[int], None] | None,
            on_progress: Callable[[int], None] | None, engine: str = "python") -> ReplayResult:
    started = time.monotonic()  # the figure a replay reports includes reading the bounds and preparing the schema
    topics = projected_topics(settings)
    # Until is exclusive in `bounds`; as-of includes its own millisecond.
    until = as_of + timedelta(milliseconds=1) if as_of is not None else None
    fresh_span = None
    if fresh:
        # The log's bounds before the schema is touched: a replay that cannot read them (the broker
        # down) fails with the old schema still in place, even with --force.
        probe = kafka_scan.reader(settings, "replay-bounds")
        try:
            fresh_span = kafka_scan.bounds(probe, topics, until=until)
            cluster = probe.list_topics(timeout=10).cluster_id
        finally:
            probe.close()
        prepare_fresh(settings.database_url, schema, settings.db_schema, force=force, reader_role=settings.reader_role)
    else:
        migrate(settings.database_url, schema, settings.reader_role)
        cluster = None
    result = ReplayResult(schema=schema, engine=engine)
    with connect(settings.database_url, schema=schema, autocommit=True) as conn:
        conn.row_factory = psycopg.rows.dict_row
        # A replay is redone from its stored offsets after any crash (they commit with the rows), so
        # losing its last commits to a server crash costs time, never correctness: skip the WAL flush wait.
        conn.execute(q("session_skip_commit_flush_wait"))
        # Rows encoded without a connection (replay workers, the json payload bytes) are UTF-8.
        conn.execute(q("session_client_encoding_utf8"))
        stored = {} if fresh else {(r["topic"], r["partition"]): r["next_offset"]
                                   for r in conn.execute(q("offsets_of_projection"), {"projection": projection})}
        use_bulk = fresh and bulk
        # The bulk path keeps its state in memory: cap what librdkafka prefetches (RSS) to 8 MB.
        consumer = kafka_scan.reader(settings, "replay", queue_kbytes=8 * 1024 if use_bulk else 256 * 1024)
        writer = None
        try:
            if cluster is None:  # a catch-up: its stored offsets mean nothing against another cluster
                cluster = consumer.list_topics(timeout=10).cluster_id
                built_from = other_cluster(conn, cluster, projection)
                if built_from is not None:
                    raise ConfigurationError(f"{OTHER_CLUSTER} ({schema} was built from cluster {built_from}, the "
                                             f"broker is {cluster}): {OTHER_CLUSTER_FIX}")

            def record(conn: psycopg.Connection) -> None:  # in the bulk paths' one transaction
                record_source(conn, cluster, projection)
            span = fresh_span or kafka_scan.bounds(consumer, topics, until=until, start_at=stored)
            result.offsets_total = span.total
            if on_start is not None:
                on_start(span.total)
            if use_bulk:
                result.workers = workers or partition_plan.default_workers(span.total)
            if result.workers > 1:
                consumer.close()
                consumer = None
                outcome = partitioned.run(settings, conn, span, result.workers, projection, batch_size=batch_size,
                                          on_progress=on_progress, before_commit=record, engine=engine)
                result.workers = outcome.workers
                for name in ("records", "applied", "duplicates", "superseded", "dead_letters"):
                    setattr(result, name, getattr(outcome.counts, name))
                result.phases, result.rss_mb = outcome.phases, outcome.rss_mb
                result.rss_mb_by_process = outcome.rss_mb_by_process
                result.elapsed_s = time.monotonic() - started
                result.rows = row_counts(conn, schema)
                return result
            if use_bulk:
                writer = BulkReplay(conn, projection, clock_topic=settings.jobs_topic, dlq_topic=settings.dlq_topic,
                                    engine=engine)
            pieces = kafka_scan.read(consumer, span, batch_size=batch_size, on_progress=on_progress)
            while True:
                reading = time.perf_counter()
                piece = next(pieces, None)
                result.phases["read"] = result.phases.get("read", 0.0) + time.perf_counter() - reading
                if piece is None:
                    break
                if writer is not None:
                    batch = writer.apply(piece.records, piece.ends)
                else:
                    batch = apply_batch(conn, piece.records, projection, piece.ends, clock_topic=settings.jobs_topic,
                                        dlq_topic=settings.dlq_topic)
                result.records += batch.records
                result.applied += batch.applied
                result.duplicates += batch.duplicates
                result.superseded += batch.superseded
                result.dead_letters += batch.dead_letters
            if writer is not None:
                writer.finish(before_final_rows=record)
                result.phases.update(writer.phases)
                writer = None
            else:  # batches committed one by one: the source once the last one is in
                record(conn)
        except BaseException as exc:
            if writer is not None:
                writer.abort(exc)
            raise
        finally:
            if consumer is not None:
                consumer.close()
        result.rss_mb = partitioned.peak_rss_mb()
        result.elapsed_s = time.monotonic() - started
        result.rows = row_counts(conn, schema)
    return result


def row_counts(conn: psycopg.Connection, schema: str) -> dict[str, int]:
    """Exact row count of every table in `schema`."""
    tables = [r["tablename"] if isinstance(r, dict) else r[0] for r in conn.execute(
        q("tables_of_schema"), {"schema": schema})]
    counts = {}
    for name in tables:
        row = conn.execute(qf("row_count_of", schema=schema, table=name)).fetchone()
        counts[name] = row["n"] if isinstance(row, dict) else row[0]
    return counts

"""The bulk path of `tapeline replay --into`: the projector's fold, held in memory, written with COPY.

A fresh replay starts from an empty schema, so nothing it needs is in the database: the job rows,
the applied dedup keys, the uploads and the log clock live in memory, and the projector's own
`decode_batch` and `fold_batch` (`projections/fold.py`) fold every record onto them in log
order, exactly as `apply_batch` would (same rules, same evidence flags, same dead letters; any new
event type or fold rule added there applies here too). What changes is the writing:

- evidence rows stream through ONE binary `COPY` kept open across slices (the server parses and
  stores while the next slice is decoded; a psycopg thread sends), never held beyond one slice;
- a job whose row reaches a final state (completed, rejected, failed, cancelled) never changes
  again: every `flush_rows` such jobs the COPY is ended, their rows are COPYed into `job_state` and
  only a `{"state": ...}` stub stays in memory (`lifecycle.evolve` looks at nothing else of a final
  row); dead letters and dead-letter replay marks wait for the same flush and are written with the
  projector's own upserts, in log order;
- the remaining job rows, the dedup keys, the uploads, the log clock and the offsets are written
  once, at the end;
- `lifecycle_evidence`'s indexes (primary key included) are dropped at the start and rebuilt at the
  end from their own definitions (`pg_get_indexdef`, `pg_get_constraintdef`): one sort each
  instead of a b-tree insert per row.

Everything runs in ONE transaction that `BulkReplay.finish` commits. A crash (or Ctrl-C) before
that leaves the schema as `prepare_fresh` made it: migrated, every table empty, no offsets, its
indexes in place (DDL is transactional). That is "clearly incomplete and resumable": `replay
--into SCHEMA --force` redoes it, and `replay --swap` would catch it up from offset 0 the slow way
(`apply_batch`), since no offsets are stored.

The in-memory fold itself (`FoldState`, `KeySet`) is `projections/fold_state.py`, shared with the
replay workers and the native engine's comparison.

Memory: applied dedup keys are kept compactly (`KeySet`, ~20-30 bytes each), open jobs' rows in
full, final jobs as stubs; the consumer's prefetch queue is capped by the caller
(`kafka_scan.reader(..., queue_kbytes=...)`). The cyclic garbage collector is off during the replay
(the state only grows and holds no cycles; re-scanning it cost a large share of the time).
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable

import psycopg
from psycopg import sql
from psycopg.copy import QueuedLibpqWriter

from domain import lifecycle
from projections import writes
from projections.batch import BatchResult
from projections.fold_state import UPLOAD_COLUMNS, FoldState, KeySet  # noqa: F401 - re-exported: `bulk.FoldState` as before
from projections.writes import write_offsets
from tapeline.postgres import identifiers, q, qf

BULK_TABLES = ("lifecycle_evidence", "applied_dedup_keys", "job_state", "uploads")
"""The tables the bulk path COPYs into (`COPY ... FREEZE`, so it truncates them first)."""
INDEX_BUILD_MEMORY = "1GB"
"""`maintenance_work_mem` of the replay's transaction (PostgreSQL's memory for its index builds; the
server's, not the replay process's). Enough for the index builds after a load of a million evidence
rows to sort in memory: a b-tree build splits it between the leader and its parallel workers
(`max_parallel_maintenance_workers`, 2 by default), and with 256 MB each got 85 MB and sorted on
disk. Measured on 924k records (`bench/replay.py`): index builds 5.1 s with 1 GB, 6.6 s with 256 MB."""
EVIDENCE_COPY = qf("copy_evidence_binary_freeze", columns=identifiers(writes.EVIDENCE_COLUMNS))
"""The evidence COPY of a bulk replay: its column list is generated (`schemas/lifecycle.json`), so the
statement is composed from the named template once, at import."""

class BulkReplay:
    """Folds slices of records into memory and writes them to the (fresh, empty) schema of `conn`.

    `conn` must be in autocommit mode and its `search_path` the target schema. Call `apply(messages,
    ends)` per slice in consumption order, then `finish()`; or `abort()` on failure (rolls back).
    """

    def __init__(self, conn: psycopg.Connection, projection: str = "main", clock_topic: str | None = None,
                 dlq_topic: str | None = None, defer_indexes: bool = True, flush_rows: int = 2000,
                 engine: str = "python", built_elsewhere: tuple[str, ...] = ()) -> None:
        """`flush_rows`: final job rows (or slices with dead letters) kept before the evidence COPY is
        ended to write them (bounds memory; each flush makes the server catch up once). `engine`:
        `python` (`FoldState`) or `native` (`projections.native.NativeFoldState`, which raises
        `NativeUnsupported` for what it cannot fold exactly). `built_elsewhere`: bulk-loaded tables
        whose indexes this transaction leaves alone because the caller replaces the table before
        the commit (`keys_aside.DedupKeysAside`)."""
        self.conn, self.projection = conn, projection
        self.state = make_fold_state(engine, clock_topic, dlq_topic, flush_rows)
        self.deferred: list[str] = []
        self._copy = self._copy_cm = self._cursor = None
        self.phases: dict[str, float] = {}
        """Seconds spent per phase (decode, fold, copy_evidence, write_final_rows, build_indexes, commit)."""
        self._gc_was_enabled = gc.isenabled()
        self._tx = conn.transaction()
        self._tx.__enter__()
        # Emptied in this transaction (they are empty already), the bulk-loaded tables take COPY
        # ... FREEZE: rows are written frozen, so the first reads after the replay do not rewrite
        # every page to set hint bits (and with wal_level=minimal the COPYs skip the WAL).
        conn.execute(qf("truncate_tables", tables=identifiers(BULK_TABLES)))
        conn.execute(qf("set_local_maintenance_work_mem", memory=sql.Literal(INDEX_BUILD_MEMORY)))
        if defer_indexes:
            self.deferred = [statement for table in ("lifecycle_evidence", "applied_dedup_keys")
                             if table not in built_elsewhere for statement in self._drop_indexes(table)]
        # The state only grows and holds no reference cycles: the cyclic collector would re-scan
        # every job row and key at each collection (a large share of the time at a million events).
        gc.disable()

    def apply(self, messages: list, end_positions: dict[tuple[str, int], int] | None = None) -> BatchResult:
        """Fold one slice (in consumption order) and stream its evidence; returns its counts."""
        result, folded = self.state.fold(messages, end_positions, self.phases)
        if self.state.native:  # rows already in binary COPY format
            if folded:
                self.write_evidence_rows(folded)
            if self.state.flush_due():
                self._flush()
            return result
        started = time.perf_counter()
        if folded.evidence:
            copy = self._evidence_copy()
            for row in folded.evidence:
                copy.write_row(row)
        self._add("copy_evidence", time.perf_counter() - started)
        if self.state.flush_due():
            self._flush()
        return result

    def finish(self, before_final_rows: Callable[[psycopg.Connection], None] | None = None,
               after_indexes: Callable[[psycopg.Connection], None] | None = None) -> None:
        """Write the final rows and offsets, rebuild the deferred indexes, and commit.
        `before_final_rows(conn)` runs once the evidence COPY has ended (to write more rows);
        `after_indexes(conn)` once the indexes are built, right before the commit."""
        try:
            conn = self.conn
            self._flush()
            started = time.perf_counter()
            if before_final_rows is not None:
                before_final_rows(conn)
            state = self.state
            if state.native:
                writes.copy_encoded(conn, "job_state", lifecycle.JOB_STATE_COLUMNS, state.open_rows_copy(), freeze=True)
                writes.copy_encoded(conn, "applied_dedup_keys", ("dedup_key",), state.keys_copy(), freeze=True)
            else:
                writes.copy_rows(conn, "job_state", lifecycle.JOB_STATE_COLUMNS, state.open_rows(), freeze=True)
                writes.copy_rows(conn, "applied_dedup_keys", ("dedup_key",), ((key,) for key in state.seen),
                                 freeze=True)
            writes.copy_rows(conn, "uploads", UPLOAD_COLUMNS, (tuple(row) for row in state.uploads.values()),
                             freeze=True)
            with conn.cursor() as cur:
                write_clock_and_offsets(cur, self.projection, state.clock, state.positions)
                indexed_at = time.perf_counter()
                self._add("write_final_rows", indexed_at - started)
                for statement in self.deferred:
                    cur.execute(statement)
            committing = time.perf_counter()
            self._add("build_indexes", committing - indexed_at)
            if after_indexes is not None:
                after_indexes(conn)
                self._add("install_aside", time.perf_counter() - committing)
                committing = time.perf_counter()
            self._tx.__exit__(None, None, None)
            self._add("commit", time.perf_counter() - committing)
        finally:
            self._restore_gc()

    def _evidence_copy(self, raw: bool = False):
        """The evidence COPY, opened on first use and kept open across slices (the server parses
        while the next slice is decoded), until a flush needs the connection for other statements.
        `raw`: the caller writes rows already in binary COPY format (`write_evidence_rows`)."""
        if self._copy is None:
            self._cursor = self.conn.cursor()
            # Rows formatted here: a thread of psycopg's sends while this one formats more. Rows
            # formatted elsewhere (raw): sent directly, so at most one chunk waits in memory.
            self._copy_cm = self._cursor.copy(EVIDENCE_COPY,
                                              writer=None if raw else QueuedLibpqWriter(self._cursor))
            self._copy = self._copy_cm.__enter__()
            self._raw = raw
            if raw:
                self._copy.write(writes.BINARY_COPY_HEADER)
            else:
                self._copy.set_types(list(writes.EVIDENCE_TYPES))
        return self._copy

    _raw = False

    def write_evidence_rows(self, data: bytes) -> None:
        """Evidence rows already encoded in binary COPY format (`writes.RowEncoder`), e.g. by a replay worker."""
        started = time.perf_counter()
        self._evidence_copy(raw=True).write(data)
        self._add("copy_evidence", time.perf_counter() - started)

    def queue_dead(self, dead: list, replays: list) -> None:
        """Dead letters and replay marks to write at the next flush (in this order)."""
        self.state.pending_dead.append((dead, replays))
        if self.state.flush_due():
            self._flush()

    def _close_copy(self, exc: BaseException | None = None) -> None:
        if self._copy is not None:
            copy, copy_cm, cursor = self._copy, self._copy_cm, self._cursor
            self._copy = self._copy_cm = self._cursor = None
            try:
                if self._raw and exc is None:
                    copy.write(writes.BINARY_COPY_TRAILER)
                copy_cm.__exit__(type(exc) if exc else None, exc, None)
            finally:
                cursor.close()

    def _flush(self) -> None:
        """End the evidence COPY; write the final job rows and the dead-letter upserts pending (in
        log order, each slice's dead letters before its replay marks, as `apply_batch` does)."""
        started = time.perf_counter()
        self._close_copy()
        closed = time.perf_counter()
        self._add("copy_evidence", closed - started)
        if self.state.native:
            final_rows = self.state.take_final_rows_copy()
            if final_rows:
                writes.copy_encoded(self.conn, "job_state", lifecycle.JOB_STATE_COLUMNS, [final_rows], freeze=True)
        else:
            final_rows = self.state.take_final_rows()
            if final_rows:
                writes.copy_rows(self.conn, "job_state", lifecycle.JOB_STATE_COLUMNS, final_rows, freeze=True)
        pending_dead = self.state.take_dead()
        if pending_dead:
            with self.conn.cursor() as cur:
                for dead, replays in pending_dead:
                    if dead:
                        cur.executemany(q("upsert_dead_letter"), dead)
                    writes.mark_dead_letters(cur, replays)
        self._add("write_final_rows", time.perf_counter() - closed)

    def abort(self, exc: BaseException | None = None) -> None:
        """Roll back everything written so far."""
        try:
            self._close_copy(exc or Exception("replay aborted"))
        except BaseException:  # noqa: BLE001 - ending a COPY with an error raises that error back
            pass
        try:
            self._tx.__exit__(type(exc) if exc else Exception, exc or Exception("replay aborted"), None)
        except BaseException:  # noqa: BLE001 - the transaction re-raises the exception it rolled back for
            pass
        finally:
            self._restore_gc()

    def _add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def _restore_gc(self) -> None:
        if self._gc_was_enabled:
            gc.enable()

    def _drop_indexes(self, table: str) -> list[str]:
        """Drop every index of `table` (in the current schema); return the statements that recreate them."""
        conn = self.conn
        constraints = conn.execute(q("unique_constraints_of"), {"table": table}).fetchall()
        indexes = conn.execute(q("plain_indexes_of"), {"table": table}).fetchall()
        recreate = []
        for name, definition in (tuple(r.values()) if isinstance(r, dict) else tuple(r) for r in constraints):
            conn.execute(qf("drop_constraint", table=table, name=name))
            recreate.append(qf("add_constraint", table=table, name=name, definition=sql.SQL(definition)).as_string(conn))
        for name, definition in (tuple(r.values()) if isinstance(r, dict) else tuple(r) for r in indexes):
            conn.execute(qf("drop_index", name=name))
            recreate.append(definition)
        return recreate


def make_fold_state(engine: str, clock_topic: str | None, dlq_topic: str | None, flush_rows: int):
    """A `FoldState` (`engine` "python") or a `native.NativeFoldState` ("native")."""
    if engine == "native":
        from projections.native import NativeFoldState

        return NativeFoldState(clock_topic, dlq_topic, flush_rows)
    return FoldState(clock_topic, dlq_topic, flush_rows)


def write_clock_and_offsets(cur: psycopg.Cursor, projection: str, clock: dict[int, Any],
                            positions: dict[tuple[str, int], int]) -> None:
    """The log clock (latest broker time per lifecycle partition) and the projection's offsets."""
    if clock:
        cur.executemany(q("advance_log_clock"), [{"partition": p, "now": now} for p, now in clock.items()])
    write_offsets(cur, projection, positions)

"""The projections' PostgreSQL writes: what a projector batch loads and writes (steps 2, 4 and 5 of
`projections/projector.py`: `load_batch_state`, `write_folded`, `write_offsets`), the `job_state`
upsert, and the bulk writes, `COPY` first, the row-by-row upsert only when COPY hits a conflict.

A batch's evidence rows and new dedup keys are normally all new (their offsets and keys were not
applied yet), so one `COPY ... FROM STDIN` per table replaces thousands of INSERT round trips. A
redelivered record (the restart and redelivery cases) makes COPY fail on the primary key; the COPY
ran inside a savepoint, so only it is rolled back and the rows go through the named query with
`ON CONFLICT DO NOTHING` instead: the same result as before, slower, and only in that case.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import psycopg
from psycopg import sql as psql
from psycopg.adapt import Transformer
from psycopg.copy import QueuedLibpqWriter
from psycopg.pq import Format
from psycopg.types.json import Jsonb

try:  # psycopg >= 3.2 (its C implementation when psycopg[binary] is installed)
    from psycopg._copy_base import format_row_binary as _format_row_binary, format_row_text as _format_row_text
except ImportError:  # pragma: no cover - older layouts
    from psycopg.copy import format_row_binary as _format_row_binary, format_row_text as _format_row_text

from tapeline.postgres import identifiers, q, qf
from domain import lifecycle

if TYPE_CHECKING:
    from projections.fold import Decoded, Folded

EVIDENCE_COLUMNS = lifecycle.EVIDENCE_COLUMNS
PAYLOAD_OMITS = lifecycle.PAYLOAD_OMITS
JSON_COLUMNS = frozenset({"ladder", "outputs", "renditions", "pipeline_stages"})


def _upsert_job_sql() -> psql.Composed:
    """The named query `upsert_job_state` for the job_state columns of `schemas/lifecycle.json`: the
    statement is generated from that column list, so it is composed (once, at import) from the template."""
    columns = lifecycle.JOB_STATE_COLUMNS
    updates = psql.SQL(", ").join(qf("upsert_job_state_update", column=c) for c in columns if c != "job_id")
    return qf("upsert_job_state", columns=identifiers(columns),
              values=psql.SQL(", ").join(psql.Placeholder(c) for c in columns), updates=updates)


UPSERT_JOB = _upsert_job_sql()


def job_params(row: dict[str, Any]) -> dict[str, Any]:
    """`row` as parameters of `UPSERT_JOB` (JSON columns wrapped as jsonb)."""
    return {c: (Jsonb(row[c]) if c in JSON_COLUMNS and row.get(c) is not None else row.get(c))
            for c in lifecycle.JOB_STATE_COLUMNS}


def load_batch_state(conn: psycopg.Connection, decoded: list[Decoded]) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """Step 2 of a projector batch: the `job_state` rows of the batch's jobs (job id -> row; `conn`
    has the dict row factory) and which of its dedup keys were already applied."""
    job_ids = list({event.job_id for _, event, _ in decoded if event is not None})
    rows = {row["job_id"]: row for row in conn.execute(q("job_state_by_ids"), {"job_ids": job_ids}).fetchall()} \
        if job_ids else {}
    keys = list({event.dedup_key for _, event, _ in decoded if event is not None})
    seen = {r["dedup_key"] for r in conn.execute(q("applied_dedup_keys_among"), {"keys": keys}).fetchall()} \
        if keys else set()
    return rows, seen


def write_folded(conn: psycopg.Connection, folded: Folded, rows: dict[str, dict[str, Any]]) -> None:
    """Step 4 of a projector batch: evidence, uploads, dead letters, the changed job rows (from
    `rows`), applied dedup keys and the log clock, in the transaction open on `conn`."""
    with conn.cursor() as cur:
        if folded.evidence:
            write_evidence(conn, folded.evidence)  # COPY; row by row only for a redelivery
        if folded.uploads:
            cur.executemany(q("upsert_upload"), folded.uploads)
        write_dead_letters(cur, folded)
        if folded.changed:
            cur.executemany(UPSERT_JOB, [job_params(rows[job_id]) for job_id in folded.changed])
        if folded.new_keys:
            write_dedup_keys(conn, folded.new_keys)
        if folded.clock:
            cur.executemany(q("advance_log_clock"),
                            [{"partition": p, "now": now} for p, now in folded.clock.items()])


def write_dead_letters(cur: psycopg.Cursor, folded: Folded) -> None:
    """A batch's dead letters, then the replays and dismissals it marks (the order every batch uses)."""
    if folded.dead:
        cur.executemany(q("upsert_dead_letter"), folded.dead)
    mark_dead_letters(cur, folded.replays)


def mark_dead_letters(cur: psycopg.Cursor, marks: list[dict]) -> None:
    """Mark dead letters as replayed (`mark_dead_letter_replayed`) or dismissed (`mark` "dismissed":
    `mark_dead_letter_dismissed`); `marks`: {id, broker_ts, operator, reason[, mark]} in log order
    (each kind of mark keeps its first: the queries' COALESCE)."""
    for mark, query in (("replayed", "mark_dead_letter_replayed"), ("dismissed", "mark_dead_letter_dismissed")):
        these = [m for m in marks if m.get("mark", "replayed") == mark]
        if these:
            cur.executemany(q(query), these)


def write_offsets(cur: psycopg.Cursor, projection: str, positions: dict[tuple[str, int], int]) -> None:
    """Step 5: advance `projector_offsets` (never backwards) to `positions` ((topic, partition) -> next offset)."""
    if positions:
        cur.executemany(q("upsert_offset"), [
            {"projection": projection, "topic": topic, "partition": partition, "next_offset": offset}
            for (topic, partition), offset in positions.items()])


def stored_offsets(conn: psycopg.Connection, projection: str) -> dict[tuple[str, int], int]:
    """`projector_offsets` of `projection`: (topic, partition) -> next offset (`conn`: dict rows)."""
    return {(r["topic"], r["partition"]): r["next_offset"]
            for r in conn.execute(q("offsets_of_projection"), {"projection": projection})}


EVIDENCE_TYPES = ("text", "int4", "int8", "timestamptz", "text", "text", "text", "text", "int4", "text", "text",
                  "timestamptz", "text", "text", "bool", "bool", "bool", "bytea")
"""Types psycopg dumps `EVIDENCE_COLUMNS` as in a binary COPY. The payload (a json column, migration
018) is sent as raw bytes, its JSON text as UTF-8 (json's binary format is its text): psycopg's own
json dumper would serialise a Python str again, as a JSON string."""


BINARY_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + bytes(8)
"""Start of a binary COPY stream: signature, flags (int32 0), header extension length (int32 0)
(PostgreSQL documentation, "COPY", "Binary Format")."""
BINARY_COPY_TRAILER = b"\xff\xff"
"""End of a binary COPY stream: a field count of -1."""


class RowEncoder:
    """Rows of one table in COPY's binary (`types` given: PostgreSQL type names) or text format,
    encoded without a connection (psycopg's own global dumpers and row formatters), to be written
    later with `copy.write` by a process that has one. `encode(rows)` returns the bytes of `rows`
    only: a binary stream still needs `BINARY_COPY_HEADER` before and `BINARY_COPY_TRAILER` after.

    Without a connection, strings are encoded as UTF-8: the connection that writes the bytes must
    use client_encoding UTF8 (`projections.replay` sets it). Text format refuses `bytes` values
    (psycopg's bytea text dumper needs a connection to escape them right): use binary format.
    """

    def __init__(self, types: Sequence[str] | None = None) -> None:
        self.transformer = Transformer()
        self.binary = types is not None
        if types is not None:
            self.transformer.set_dumper_types([psycopg.adapters.types[name].oid for name in types], Format.BINARY)

    def encode(self, rows: Iterable[tuple]) -> bytearray:
        """The rows (tuples in column order) in COPY format. Raises TypeError for `bytes` in text format."""
        out = bytearray()
        format_row, transformer = (_format_row_binary if self.binary else _format_row_text), self.transformer
        for row in rows:
            if not self.binary and any(isinstance(value, (bytes, bytearray, memoryview)) for value in row):
                raise TypeError("RowEncoder: bytes need the binary format (types=...)")
            format_row(row, transformer, out)
        return out


def copy_or_insert(conn: psycopg.Connection, table: str, columns: Sequence[str], rows: list[tuple],
                   fallback_query: str) -> None:
    """Write `rows` (tuples in `columns` order) with COPY; on a unique violation, with `fallback_query`
    (named parameters, one per column)."""
    if not rows:
        return
    try:
        with conn.transaction():  # a savepoint: a failed COPY leaves the batch's transaction usable
            copy_rows(conn, table, columns, rows)
    except psycopg.errors.UniqueViolation:
        with conn.cursor() as cur:
            cur.executemany(q(fallback_query), [dict(zip(columns, row)) for row in rows])


@lru_cache(maxsize=64)
def copy_statement(table: str, columns: tuple[str, ...], *, binary: bool, freeze: bool) -> psql.Composed:
    """`COPY table (columns) FROM STDIN` with its options: the named template of `sql/copy.sql` for
    (binary, freeze), the table and columns quoted as identifiers. The statement is generated (the
    column lists come from `schemas/lifecycle.json`), so it is composed, once per table and options."""
    name = "copy_" + ("binary" if binary else "text") + ("_freeze" if freeze else "")
    return qf(name, table=table, columns=identifiers(columns))


def copy_rows(conn: psycopg.Connection, table: str, columns: Sequence[str], rows: Iterable[tuple],
              types: Sequence[str] | None = None, queued: bool = False, freeze: bool = False) -> None:
    """`COPY table (columns) FROM STDIN` of `rows` (tuples in `columns` order); binary when `types`
    (the PostgreSQL type of each column) is given, text otherwise. `queued`: a thread of psycopg's
    sends the data while this one formats more rows (the server parses while we decode). `freeze`:
    `COPY ... FREEZE` (the table must have been created or truncated in this transaction). Raises what
    PostgreSQL raises."""
    statement = copy_statement(table, tuple(columns), binary=bool(types), freeze=freeze)
    with conn.cursor() as cur, cur.copy(statement, writer=QueuedLibpqWriter(cur) if queued else None) as copy:
        if types:
            copy.set_types(list(types))
        for row in rows:
            copy.write_row(row)


def copy_encoded(conn: psycopg.Connection, table: str, columns: Sequence[str], chunks: Iterable[bytes],
                 freeze: bool = False) -> None:
    """`COPY table (columns) FROM STDIN` of rows already in text COPY format (e.g. from the native
    engine, `projections/native.py`), written chunk by chunk."""
    with conn.cursor() as cur, cur.copy(copy_statement(table, tuple(columns), binary=False, freeze=freeze)) as copy:
        for chunk in chunks:
            copy.write(chunk)


def write_evidence(conn: psycopg.Connection, rows: list[tuple]) -> None:
    """Evidence rows in `EVIDENCE_COLUMNS` order (`payload` is JSON text, `PAYLOAD_OMITS` left out: COPY and
    the json column take it as is)."""
    copy_or_insert(conn, "lifecycle_evidence", EVIDENCE_COLUMNS, rows, "insert_evidence")


def write_dedup_keys(conn: psycopg.Connection, keys: list[str]) -> None:
    """Applied dedup keys."""
    copy_or_insert(conn, "applied_dedup_keys", ("dedup_key",), [(key,) for key in keys], "insert_dedup_key")

"""Bulk writes of the projector: `COPY` first, the row-by-row upsert only when COPY hits a conflict.

A batch's evidence rows and new dedup keys are normally all new (their offsets and keys were not
applied yet), so one `COPY ... FROM STDIN` per table replaces thousands of INSERT round trips. A
redelivered record (the restart and redelivery cases) makes COPY fail on the primary key; the COPY
ran inside a savepoint, so only it is rolled back and the rows go through the named query with
`ON CONFLICT DO NOTHING` instead: the same result as before, slower, and only in that case.
"""

from __future__ import annotations

from typing import Any, Sequence

import psycopg

from projections.sql import q

EVIDENCE_COLUMNS = ("topic", "partition", "offset", "broker_ts", "event_id", "event_type", "job_id", "stage",
                    "attempt", "claim_token", "dedup_key", "occurred_at", "recorded_by", "causation_id", "applied",
                    "superseded", "duplicate", "payload")


def copy_or_insert(conn: psycopg.Connection, table: str, columns: Sequence[str], rows: list[dict[str, Any]],
                   fallback_query: str) -> None:
    """Write `rows` (dicts keyed by column) with COPY; on a unique violation, with `fallback_query`."""
    if not rows:
        return
    names = ", ".join(f'"{c}"' for c in columns)
    try:
        with conn.transaction():  # a savepoint: a failed COPY leaves the batch's transaction usable
            with conn.cursor() as cur, cur.copy(f"COPY {table} ({names}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(tuple(row[c] for c in columns))
    except psycopg.errors.UniqueViolation:
        with conn.cursor() as cur:
            cur.executemany(q(fallback_query), rows)


def write_evidence(conn: psycopg.Connection, rows: list[dict[str, Any]]) -> None:
    """Evidence rows (`payload` may be JSON text: COPY and the jsonb cast take it as is)."""
    copy_or_insert(conn, "lifecycle_evidence", EVIDENCE_COLUMNS, rows, "insert_evidence")


def write_dedup_keys(conn: psycopg.Connection, rows: list[dict[str, Any]]) -> None:
    copy_or_insert(conn, "applied_dedup_keys", ("dedup_key",), rows, "insert_dedup_key")

"""Projections per PostgreSQL schema: the live schema, rebuilt schemas, and swapping one in.

Every projection table, view, grant and offset lives inside one schema (a view stays bound to the
table it was created on, so a schema is swapped as a whole). The live schema is the one named by
`Settings.db_schema` (default `public`); a replay builds another one, and `swap` renames the two in
one transaction while holding `SWAP_LOCK` exclusively. The projector takes the same lock shared in
each batch's transaction and checks, under it, that the live schema is still the one whose offsets
it is consuming from (`LiveGuard`); after a swap it re-reads the stored offsets and seeks there.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

import psycopg
from psycopg import sql

from projections.sql import READER_ROLE, check_schema_name, connect, migrate, migrations
from tapeline.errors import ConfigurationError, TapelineError

SWAP_LOCK = 0x7A9E_0002  # advisory lock key: shared per projector batch, exclusive during a swap


class SchemaSwapped(TapelineError):
    """The live schema was swapped under the projector; its batch was rolled back and it must re-seek."""


def schema_oid(conn: psycopg.Connection, schema: str | None = None) -> int | None:
    """OID of `schema` (default: the connection's current schema), or None when it does not exist."""
    if schema is None:
        row = conn.execute("SELECT oid FROM pg_namespace WHERE nspname = current_schema()").fetchone()
    else:
        row = conn.execute("SELECT oid FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone()
    if row is None:
        return None
    return row["oid"] if isinstance(row, dict) else row[0]


def relation_count(conn: psycopg.Connection, schema: str) -> int:
    """How many tables, views and sequences `schema` holds (0 when it is missing or empty)."""
    row = conn.execute("SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                       " WHERE n.nspname = %s AND c.relkind IN ('r', 'v', 'm', 'S', 'p')", (schema,)).fetchone()
    return row["count"] if isinstance(row, dict) else row[0]


@dataclass
class LiveGuard:
    """What the projector checks in every batch transaction: the swap lock (shared) and that the
    schema its connection resolves to is still the one it loaded its offsets from."""

    oid: int | None = None

    def check(self, conn: psycopg.Connection) -> None:
        """Call inside the batch's transaction, before any read. Raises `SchemaSwapped`."""
        conn.execute("SELECT pg_advisory_xact_lock_shared(%s)", (SWAP_LOCK,))
        current = schema_oid(conn)
        if self.oid is None:
            self.oid = current
        elif current != self.oid:
            self.oid = current
            raise SchemaSwapped(f"live schema changed (oid {current}); re-seeking at the stored offsets")


def prepare_fresh(database_url: str, schema: str, live_schema: str, force: bool = False,
                  reader_role: str = READER_ROLE) -> None:
    """Make `schema` an empty, fully migrated schema for a replay.

    Refuses the live schema, and an existing non-empty schema unless `force` (which drops it). A
    Tapeline schema whose projections hold no row (what a failed or interrupted replay leaves: its
    one transaction rolled back) is dropped and rebuilt without `force`. `force` never drops a
    schema that is not a Tapeline projection schema (`is_projection_schema`): a typo must not drop
    another application's tables. Raises `ConfigurationError`.
    """
    check_schema_name(schema)
    if schema == live_schema:
        raise ConfigurationError(f"{schema} is the live schema; replay into another one and swap it in")
    with connect(database_url, autocommit=True) as conn:
        if relation_count(conn, schema):
            if not is_projection_schema(conn, schema):
                raise ConfigurationError(f"schema {schema} holds tables that are not a Tapeline projection (no "
                                         f"schema_migrations of ours); refusing to drop it, even with --force: "
                                         f"choose another name, or drop it yourself")
            if not force and not holds_no_projection(conn, schema):
                raise ConfigurationError(f"schema {schema} exists and is not empty (use --force to drop it)")
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    migrate(database_url, schema, reader_role)


PROJECTION_TABLES = ("projector_offsets", "lifecycle_evidence", "job_state", "applied_dedup_keys", "uploads",
                     "dead_letters", "log_clock", "provider_calls", "provider_state", "intake_uploads")
"""Tables a replay or the projector fills; a schema with all of them empty holds nothing to lose."""


def is_projection_schema(conn: psycopg.Connection, schema: str) -> bool:
    """True when `schema` holds a `schema_migrations` table recording Tapeline's first migration
    (`001_init.sql`, by version and name): a schema this code (or an older version of it) migrated."""
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (f'"{schema}".schema_migrations',)).fetchone()
    if not (next(iter(row.values())) if isinstance(row, dict) else row[0]):
        return False
    version, name, _ = min(migrations())
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}.schema_migrations WHERE version = %s AND name = %s")
                       .format(sql.Identifier(schema)), (version, name)).fetchone()
    return (next(iter(row.values())) if isinstance(row, dict) else row[0]) == 1


def holds_no_projection(conn: psycopg.Connection, schema: str) -> bool:
    """True when `schema` has every table of `PROJECTION_TABLES` and all of them are empty; False for
    any other schema (one that is not Tapeline's, or holds rows)."""
    present = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = %s AND tablename = ANY(%s)",
                           (schema, list(PROJECTION_TABLES))).fetchone()
    if (present["count"] if isinstance(present, dict) else present[0]) != len(PROJECTION_TABLES):
        return False
    any_row = sql.SQL(" OR ").join(
        sql.SQL("EXISTS (SELECT 1 FROM {}.{})").format(sql.Identifier(schema), sql.Identifier(table))
        for table in PROJECTION_TABLES)
    row = conn.execute(sql.SQL("SELECT {} AS any_row").format(any_row)).fetchone()
    return not (row["any_row"] if isinstance(row, dict) else row[0])


@dataclass(frozen=True)
class SwapResult:
    live: str
    retired: str
    stall_policy_copied: bool


def swap(database_url: str, schema: str, live_schema: str, retired: str | None = None,
         lock_timeout_s: float = 30.0) -> SwapResult:
    """Make `schema` the live schema: rename live -> `retired`, `schema` -> live, in one transaction.

    Holds `SWAP_LOCK` exclusively, so no projector batch is in flight; the projector notices the new
    schema in its next batch and resumes from that schema's stored offsets. Settings tables that are
    not derived from the log (`stall_policy`, the HTTP intake's `intake_uploads`) are copied from the
    old live schema. The old schema is
    kept under `retired` (default `<live>_retired_<UTC timestamp>`) for a swap back or a DROP.
    """
    check_schema_name(schema)
    check_schema_name(live_schema)
    if schema == live_schema:
        raise ConfigurationError(f"{schema} is already the live schema")
    retired = check_schema_name(retired or f"{live_schema}_retired_{datetime.now(timezone.utc):%Y%m%d%H%M%S}")
    latest = max((number for number, _, _ in migrations()), default=0)
    migrate(database_url, schema)  # a schema rebuilt by older code gets the newer migrations first
    with connect(database_url, autocommit=True) as conn:
        with conn.transaction():
            conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(f"{int(lock_timeout_s * 1000)}ms")))
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SWAP_LOCK,))
            version = conn.execute(sql.SQL("SELECT max(version) FROM {}.schema_migrations")
                                   .format(sql.Identifier(schema))).fetchone()[0]
            if version != latest:
                raise ConfigurationError(f"schema {schema} is at migration {version}, expected {latest}")
            copied = False
            if schema_oid(conn, live_schema) is not None:
                copied = _copy_stall_policy(conn, live_schema, schema)
                _copy_table(conn, live_schema, schema, "intake_uploads")  # the HTTP intake's claims and keys
                conn.execute(sql.SQL("ALTER SCHEMA {} RENAME TO {}").format(sql.Identifier(live_schema),
                                                                          sql.Identifier(retired)))
            conn.execute(sql.SQL("ALTER SCHEMA {} RENAME TO {}").format(sql.Identifier(schema),
                                                                      sql.Identifier(live_schema)))
    return SwapResult(live=live_schema, retired=retired, stall_policy_copied=copied)


def _copy_table(conn: psycopg.Connection, source: str, target: str, table: str) -> bool:
    """Replace `target.table` by the rows of `source.table` (a table not derived from the log); False
    when either is missing. Writes to the source racing the swap's transaction may be lost."""
    present = conn.execute("SELECT to_regclass(%s) IS NOT NULL AND to_regclass(%s) IS NOT NULL",
                           (f'"{source}".{table}', f'"{target}".{table}')).fetchone()[0]
    if not present:
        return False
    conn.execute(sql.SQL("DELETE FROM {}.{}").format(sql.Identifier(target), sql.Identifier(table)))
    conn.execute(sql.SQL("INSERT INTO {}.{} SELECT * FROM {}.{}").format(
        sql.Identifier(target), sql.Identifier(table), sql.Identifier(source), sql.Identifier(table)))
    return True


def _copy_stall_policy(conn: psycopg.Connection, source: str, target: str) -> bool:
    present = conn.execute("SELECT to_regclass(%s) IS NOT NULL AND to_regclass(%s) IS NOT NULL",
                           (f'"{source}".stall_policy', f'"{target}".stall_policy')).fetchone()[0]
    if not present:
        return False
    conn.execute(sql.SQL("DELETE FROM {}.stall_policy").format(sql.Identifier(target)))
    conn.execute(sql.SQL("INSERT INTO {}.stall_policy SELECT * FROM {}.stall_policy")
                 .format(sql.Identifier(target), sql.Identifier(source)))
    return True

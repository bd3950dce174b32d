"""Projections per PostgreSQL schema: the live schema, rebuilt schemas, and swapping one in.

Every projection table, view, grant and offset lives inside one schema (a view stays bound to the
table it was created on, so a schema is swapped as a whole). The live schema is the one named by
`Settings.db_schema` (default `public`); a replay builds another one, and `swap` renames the two in
one transaction while holding the swap guard (`SWAP_GUARD`) in EXCLUSIVE mode. The projector takes
it in ROW EXCLUSIVE mode in each batch's transaction and checks, under it, that the live schema is
still the one whose offsets it is consuming from (`LiveGuard`); after a swap it re-reads the stored
offsets and seeks there.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache

import psycopg
from psycopg import sql

from tapeline.postgres import CONTROL_SCHEMA, READER_ROLE, check_schema_name, connect, migrate, migrations, q, qf
from domain.errors import ConfigurationError, TapelineError

SWAP_GUARD = f"{CONTROL_SCHEMA}.swap_guard"
"""The empty table whose lock is the swap lock: ROW EXCLUSIVE per projector batch, EXCLUSIVE during a
swap (the two conflict; batches do not conflict with each other). A table, not an advisory lock, so
that a read-only role cannot take it: `pg_advisory_lock` is open to every role, and a dashboard
user holding the old advisory key froze the projector; LOCK TABLE in these modes needs UPDATE,
DELETE or INSERT rights on it, and readers have no USAGE on `CONTROL_SCHEMA` at all."""


class SchemaSwapped(TapelineError):
    """The live schema was swapped under the projector; its batch was rolled back and it must re-seek."""


class SchemaRefused(ConfigurationError):
    """That schema cannot be the target of a replay or a swap as asked; nothing was changed (the CLI
    exits with code 2, as for any other unusable argument)."""


class SwapRefused(SchemaRefused):
    """That schema cannot be swapped in; nothing was changed."""


def schema_oid(conn: psycopg.Connection, schema: str | None = None) -> int | None:
    """OID of `schema` (default: the connection's current schema), or None when it does not exist."""
    if schema is None:
        row = conn.execute(q("current_schema_oid")).fetchone()
    else:
        row = conn.execute(q("schema_oid"), {"schema": schema}).fetchone()
    if row is None:
        return None
    return row["oid"] if isinstance(row, dict) else row[0]


def relation_count(conn: psycopg.Connection, schema: str) -> int:
    """How many tables, views and sequences `schema` holds (0 when it is missing or empty)."""
    row = conn.execute(q("relation_count"), {"schema": schema}).fetchone()
    return row["count"] if isinstance(row, dict) else row[0]


@dataclass
class LiveGuard:
    """What the projector checks in every batch transaction: the swap guard (ROW EXCLUSIVE) and that
    the schema its connection resolves to is still the one it loaded its offsets from."""

    oid: int | None = None

    def check(self, conn: psycopg.Connection) -> None:
        """Call inside the batch's transaction, before any read. Raises `SchemaSwapped`."""
        conn.execute(_guard_lock("lock_swap_guard_for_batch"))
        current = schema_oid(conn)
        if self.oid is None:
            self.oid = current
        elif current != self.oid:
            self.oid = current
            raise SchemaSwapped(f"live schema changed (oid {current}); re-seeking at the stored offsets")


@lru_cache(maxsize=None)
def _guard_lock(name: str) -> sql.Composed:
    """The named LOCK TABLE of `SWAP_GUARD` (composed once: the projector takes it in every batch)."""
    return qf(name, guard=sql.Identifier(CONTROL_SCHEMA, "swap_guard"))


def check_target_name(schema: str) -> str:
    """`schema` if a replay may write into a schema of that name (`sql.check_schema_name`); else
    `SchemaRefused`."""
    try:
        return check_schema_name(schema)
    except ConfigurationError as exc:
        raise SchemaRefused(str(exc)) from None


def prepare_fresh(database_url: str, schema: str, live_schema: str, force: bool = False,
                  reader_role: str = READER_ROLE) -> None:
    """Make `schema` an empty, fully migrated schema for a replay.

    Refuses the live schema, and an existing non-empty schema unless `force` (which drops it). A
    Tapeline schema whose projections hold no row (what a failed or interrupted replay leaves: its
    one transaction rolled back) is dropped and rebuilt without `force`. `force` never drops a
    schema that is not a Tapeline projection schema (`is_projection_schema`): a typo must not drop
    another application's tables, and a name that is not a plain PostgreSQL name. Raises `SchemaRefused`.
    """
    check_target_name(schema)
    if schema == live_schema:
        raise SchemaRefused(f"{schema} is the live schema; replay into another one and swap it in")
    with connect(database_url, autocommit=True) as conn:
        if relation_count(conn, schema):
            if not is_projection_schema(conn, schema):
                raise SchemaRefused(f"schema {schema} holds tables that are not a Tapeline projection (no "
                                    f"schema_migrations of ours); refusing to drop it, even with --force: "
                                    f"choose another name, or drop it yourself")
            if not force and not holds_no_projection(conn, schema):
                raise SchemaRefused(f"schema {schema} exists and is not empty (use --force to drop it)")
            conn.execute(qf("drop_schema_cascade", schema=schema))
    migrate(database_url, schema, reader_role)


PROJECTION_TABLES = ("projector_offsets", "lifecycle_evidence", "job_state", "applied_dedup_keys", "uploads",
                     "dead_letters", "log_clock", "provider_calls", "provider_state", "intake_uploads",
                     "webhook_endpoints", "webhook_deliveries")
"""Tables a replay or the projector fills; a schema with all of them empty holds nothing to lose."""


def is_projection_schema(conn: psycopg.Connection, schema: str) -> bool:
    """True when `schema` holds a `schema_migrations` table recording Tapeline's first migration
    (`001_init.sql`, by version and name): a schema this code (or an older version of it) migrated."""
    row = conn.execute(q("relation_exists"), {"schema": schema, "table": "schema_migrations"}).fetchone()
    if not (next(iter(row.values())) if isinstance(row, dict) else row[0]):
        return False
    version, name, _ = min(migrations())
    row = conn.execute(qf("migration_recorded_in", schema=schema), {"version": version, "name": name}).fetchone()
    return (next(iter(row.values())) if isinstance(row, dict) else row[0]) == 1


def holds_no_projection(conn: psycopg.Connection, schema: str) -> bool:
    """True when `schema` has every table of `PROJECTION_TABLES` and all of them are empty; False for
    any other schema (one that is not Tapeline's, or holds rows)."""
    present = conn.execute(q("tables_present"), {"schema": schema, "tables": list(PROJECTION_TABLES)}).fetchone()
    if (present["count"] if isinstance(present, dict) else present[0]) != len(PROJECTION_TABLES):
        return False
    row = conn.execute(qf("projection_holds_rows", schema=schema)).fetchone()  # reads each of PROJECTION_TABLES
    return not (row["any_row"] if isinstance(row, dict) else row[0])


def record_source(conn: psycopg.Connection, cluster_id: str, projection: str = "main") -> None:
    """Record in `projection_source` the Kafka cluster `projection` is built from (kept when present).

    A replay calls it in the transaction that commits its rows, so a rebuilt schema carries the
    cluster id the projector checks (`projector.other_cluster`) from the moment it is swapped in, and
    the row doubles as the mark of a replay that finished (`replay_finished`)."""
    conn.execute(q("record_projection_source"), {"projection": projection, "cluster_id": cluster_id})


def replay_finished(conn: psycopg.Connection, schema: str, projection: str = "main") -> bool:
    """True when `schema` holds a projection that was built to the end: a replay that committed
    (its `projection_source` row, written in the replay's one transaction) or any stored offset (a
    projector or catch-up committed at least one batch; schemas rebuilt before replays recorded
    their source). A replay that crashed or was interrupted leaves neither."""
    row = conn.execute(qf("replay_finished_in", schema=schema), {"projection": projection}).fetchone()
    return bool(next(iter(row.values())) if isinstance(row, dict) else row[0])


def check_swap_candidate(conn: psycopg.Connection, schema: str, live_schema: str) -> None:
    """Refuse (`SwapRefused`) to swap in the live schema itself, a schema that does not exist (a typo,
    or a swap already done: the schema now has the live name) and one that is not a Tapeline
    projection (another application's tables must never be migrated and renamed to the live name)."""
    check_schema_name(schema)
    if schema == live_schema:
        raise SwapRefused(f"{schema} is already the live schema; swap in a schema built by `tapeline replay --into`")
    if schema_oid(conn, schema) is None:
        raise SwapRefused(f"schema {schema} does not exist (a typo, or already swapped in?); build it first with "
                          f"`tapeline replay --into {schema}`")
    if not is_projection_schema(conn, schema):
        raise SwapRefused(f"schema {schema} is not a Tapeline projection (no schema_migrations of ours); refusing to "
                          f"swap it in")


def check_swappable(database_url: str, schema: str, live_schema: str) -> None:
    """`check_swap_candidate` on a connection of its own: what `replay --swap` checks before catching up."""
    check_schema_name(schema)
    with connect(database_url, autocommit=True) as conn:
        check_swap_candidate(conn, schema, live_schema)


@dataclass(frozen=True)
class SwapResult:
    live: str
    retired: str
    stall_policy_copied: bool


def swap(database_url: str, schema: str, live_schema: str, retired: str | None = None,
         lock_timeout_s: float = 30.0, projection: str = "main") -> SwapResult:
    """Make `schema` the live schema: rename live -> `retired`, `schema` -> live, in one transaction.

    Refuses (`SwapRefused`, nothing changed) what `check_swap_candidate` refuses and a schema whose
    replay never finished (`replay_finished`: no offsets and no recorded source, what a crashed
    replay leaves; a catch-up first completes it). Holds `SWAP_GUARD` exclusively, so no projector
    batch is in flight; the projector notices the new schema in its next batch and resumes from that
    schema's stored offsets. Settings tables that are not derived from the log (`stall_policy`, the
    HTTP intake's `intake_uploads`, the customers' `webhook_endpoints`) are copied from the old live schema. The old schema is kept under
    `retired` (default `<live>_retired_<UTC time to the second>`, with `_2`, `_3`... when a swap of
    the same second took that name) for a swap back or a DROP.
    """
    check_schema_name(schema)
    check_schema_name(live_schema)
    if retired is not None:
        check_schema_name(retired)
    base = f"{live_schema}_retired_{datetime.now(timezone.utc):%Y%m%d%H%M%S}"
    latest = max((number for number, _, _ in migrations()), default=0)
    with connect(database_url, autocommit=True) as conn:
        check_swap_candidate(conn, schema, live_schema)  # before migrate(), which would create a missing schema
    migrate(database_url, schema)  # a schema rebuilt by older code gets the newer migrations first
    with connect(database_url, autocommit=True) as conn:
        with conn.transaction():
            conn.execute(qf("set_local_lock_timeout", timeout=sql.Literal(f"{int(lock_timeout_s * 1000)}ms")))
            conn.execute(_guard_lock("lock_swap_guard_for_swap"))
            check_swap_candidate(conn, schema, live_schema)  # again under the lock: a concurrent swap took it
            version = conn.execute(qf("schema_migration_version", schema=schema)).fetchone()[0]
            if version != latest:
                raise ConfigurationError(f"schema {schema} is at migration {version}, expected {latest}")
            if not replay_finished(conn, schema, projection):
                raise SwapRefused(f"schema {schema} holds no finished replay (no stored offsets, no recorded source: "
                                  f"a replay into it crashed or was interrupted); run `tapeline replay --into {schema} "
                                  f"--force` again, or swap without --no-catch-up to catch it up from offset 0")
            if retired is None:
                retired = _free_name(conn, base)
            elif schema_oid(conn, retired) is not None:
                raise SwapRefused(f"schema {retired} already exists; name another one to retire {live_schema} under")
            copied = False
            if schema_oid(conn, live_schema) is not None:
                copied = _copy_table(conn, live_schema, schema, "stall_policy")
                _copy_table(conn, live_schema, schema, "intake_uploads")  # the HTTP intake's claims and keys
                _copy_table(conn, live_schema, schema, "webhook_endpoints")  # registrations and their secrets
                conn.execute(qf("rename_schema", schema=live_schema, new_name=retired))
            conn.execute(qf("rename_schema", schema=schema, new_name=live_schema))
    return SwapResult(live=live_schema, retired=retired, stall_policy_copied=copied)


def _free_name(conn: psycopg.Connection, base: str) -> str:
    """`base`, or `base_2`, `base_3`... the first no schema has (call under `SWAP_GUARD`: swaps take
    names one at a time). Raises `ConfigurationError` when the name would pass PostgreSQL's 63 bytes."""
    name, number = base, 1
    while schema_oid(conn, check_schema_name(name)) is not None:
        number += 1
        name = f"{base}_{number}"
    return name


def _copy_table(conn: psycopg.Connection, source: str, target: str, table: str) -> bool:
    """Replace `target.table` by the rows of `source.table` (a table not derived from the log:
    `stall_policy`, `intake_uploads`); False when either is missing. Writes to the source racing the
    swap's transaction may be lost."""
    present = conn.execute(q("relation_in_both_schemas"), {"source": source, "target": target, "table": table}
                           ).fetchone()[0]
    if not present:
        return False
    conn.execute(qf("delete_all_rows_of", schema=target, table=table))
    conn.execute(qf("copy_rows_between_schemas", source=source, target=target, table=table))
    return True

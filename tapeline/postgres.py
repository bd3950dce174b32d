"""The PostgreSQL adapter: connections, named queries and migrations.

SQL lives in `.sql` files of the projections (`projections/sql/`): numbered migrations in
`sql/migrations/`, named queries in the other `sql/*.sql` files (`queries.sql`, and one file per area
such as `replay.sql`). A named query is a block starting with `-- name: <name>` and a one-line
description; Python calls it by name (`q`). A query that names a table or schema chosen at run time
writes it as a `{placeholder}` and is composed with `qf`, which quotes it as an identifier
(`psycopg.sql.Identifier`); values stay `%(param)s` parameters.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from functools import lru_cache
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql as psql

from domain.errors import ConfigurationError, DatabaseAccessRefused, ServiceUnavailable
from domain.lifecycle_data import LIFECYCLE, Lifecycle
from tapeline.ports import LockTimeout

if TYPE_CHECKING:
    from tapeline.settings import Settings

SQL_DIR = Path(str(files("projections"))) / "sql"
MIGRATIONS_DIR = SQL_DIR / "migrations"
MIGRATION_LOCK = 0x7A9E_0001  # advisory lock key: one migrator at a time


def query_files() -> list[Path]:
    """The files of named queries: every `sql/*.sql` (not the migrations), in name order."""
    return sorted(SQL_DIR.glob("*.sql"))


@lru_cache(maxsize=1)
def queries() -> dict[str, str]:
    """`{name: sql}` of every named query of `query_files()`. Raises `ValueError` when a name is
    defined twice, in one file or in two (a second definition would silently replace the first)."""
    found: dict[str, str] = {}
    where: dict[str, str] = {}
    for path in query_files():
        for block in re.split(r"^-- name: ", path.read_text(), flags=re.M)[1:]:
            name, _, body = block.partition("\n")
            name = name.strip()
            lines = [line for line in body.splitlines() if not line.startswith("--")]
            if name in found:
                raise ValueError(f"{path.name} defines {name!r}, already defined in {where[name]}")
            found[name], where[name] = "\n".join(lines).strip(), path.name
    return found


def q(name: str) -> str:
    """The SQL of one named query. Raises `ConfigurationError` for an unknown name."""
    try:
        return queries()[name]
    except KeyError as exc:
        raise ConfigurationError(f"no query named {name!r} in sql/*.sql") from exc


def qf(name: str, /, **parts: str | psql.Composable) -> psql.Composed:
    """The named query `name` with its `{placeholders}` filled: a `str` as an identifier
    (`sql.Identifier`, quoted), a `psycopg.sql.Composable` as it is (`sql.Literal` for a value where
    PostgreSQL takes no bind parameter: DDL, COMMENT ON, SET; `identifiers` for a list of names).
    Raises `ConfigurationError` for an unknown name, `KeyError` for a placeholder not given."""
    return psql.SQL(q(name)).format(**{key: value if isinstance(value, psql.Composable) else psql.Identifier(value)
                                       for key, value in parts.items()})


def identifiers(names) -> psql.Composed:
    """`"a", "b", "c"`: the names quoted as identifiers, comma-separated (a column or table list for `qf`)."""
    return psql.SQL(", ").join(psql.Identifier(name) for name in names)


def dead_peer_settings(timeout_s: float) -> tuple[str, dict[str, int]]:
    """(more `options`, libpq keyword parameters) for a session that holds a leader lock: both ends
    give up on a peer that stopped answering within about `timeout_s` seconds (at least 6).

    PostgreSQL keeps a session, and so its advisory locks, until it learns the client is gone; a
    client host cut off from the network sends nothing, so with the kernel's TCP defaults (7,200 s
    idle, then 9 probes 75 s apart) a cut-off watchdog, notifier or projector leader kept its lock
    and no standby took over for about 2 h 11 min. The server side: `tcp_keepalives_idle`,
    `_interval`, `_count` and `tcp_user_timeout` as session settings ("Connection Settings",
    PostgreSQL 15 manual 20.3.1); the client side: libpq's `keepalives*` and `tcp_user_timeout`
    ("Parameter Key Words", 34.1.2), so the cut-off process's own next query fails instead of
    waiting. Probes start after a third of the timeout, one every sixth, three unanswered end it
    (5/6 of the timeout); `tcp_user_timeout` (milliseconds) bounds unacknowledged data. Pure."""
    timeout_s = max(6.0, timeout_s)
    idle, interval, count, user_ms = int(timeout_s // 3), int(timeout_s // 6), 3, int(timeout_s * 1000)
    options = (f" -c tcp_keepalives_idle={idle} -c tcp_keepalives_interval={interval}"
               f" -c tcp_keepalives_count={count} -c tcp_user_timeout={user_ms}")
    return options, {"keepalives": 1, "keepalives_idle": idle, "keepalives_interval": interval,
                     "keepalives_count": count, "tcp_user_timeout": user_ms}


def session_options(schema: str | None = None) -> str:
    """libpq `options` for every Tapeline session: JIT compilation off, and `schema` (a plain
    lowercase name, see `check_schema_name`) as the whole `search_path` when given.

    JIT is off because Tapeline's queries are short: on a young database (tables not analyzed yet)
    the planner's estimates pass `jit_above_cost` and PostgreSQL compiled the watchdog's
    `expected_work_missing` query on every tick, 0.95 s of its 1.0 s (EXPLAIN ANALYZE: "Timing:
    Inlining 160 ms, Optimization 543 ms, Emission 243 ms"), which delayed every stall verdict.
    PostgreSQL documents JIT as worthwhile for long-running CPU-bound analytic queries only
    ("Just-in-Time Compilation (JIT)", chapter 32 of the PostgreSQL 15 manual)."""
    options = "-c jit=off"
    if schema is not None:
        options += f" -c search_path={check_schema_name(schema)}"
    return options


TLS_REFUSALS: tuple[tuple[str, str], ...] = (
    ("certificate verify failed", "the server's certificate is not signed by a CA in sslrootcert"),
    ("does not match host name", "the server's certificate does not name the host connected to"),
    ("root certificate file", "sslrootcert names no readable CA file"),
    ("certificate present, but not private key", "sslcert is given without its sslkey"),
    ("could not load private key", "sslkey cannot be read"),
    ("private key file", "sslkey cannot be used"),
    ("could not open certificate file", "sslcert cannot be read"),
    ("certificate required", "the server requires a client certificate (sslcert, sslkey)"),
    ("requires a valid client certificate", "the server requires a client certificate (sslcert, sslkey)"),
    ("certificate authentication failed", "the client certificate does not name the user logging in"),
    ("server does not support SSL", "the server does not speak TLS, and sslmode requires it"),
    ("SSL error", "the TLS handshake failed"),
)
"""(text in libpq's message, what it means) of the TLS failures a connection can meet, first match
wins (libpq 15's messages: `fe-secure-openssl.c`, `fe-connect.c`)."""


def tls_refusal(message: str) -> str | None:
    """What a libpq connection error says about TLS, for a person (`TLS_REFUSALS`), or None when it
    is not a TLS failure. Pure."""
    return next((meaning for text, meaning in TLS_REFUSALS if text in message), None)


AUTHENTICATION_REFUSALS: tuple[tuple[str, str], ...] = (
    (r"password authentication failed", "the password is wrong for this user"),
    (r"no pg_hba\.conf entry", "the server's pg_hba.conf lets no such connection in (user, database, address, TLS)"),
    (r"no password supplied", "the server wants a password and the URL gives none"),
    (r'role "[^"]*" does not exist', "no such user on the server"),
    (r'database "[^"]*" does not exist', "no such database on the server"),
)
"""(regular expression over libpq's message, what it means) of the refused logins, first match wins
(the server's messages: PostgreSQL 15 `auth.c`, `postinit.c`)."""


def authentication_refusal(message: str) -> str | None:
    """What a libpq connection error says about a refused login, for a person
    (`AUTHENTICATION_REFUSALS`), or None when it is none. Pure."""
    return next((meaning for pattern, meaning in AUTHENTICATION_REFUSALS if re.search(pattern, message)), None)


def masked_dsn(dsn: str) -> str:
    """The DSN with its password replaced by `***`: a URL's user info and its `password` query
    parameter (libpq reads both), or the key=value form's `password`. Every message that shows a
    database address shows it through this."""
    if "://" in dsn:
        parts = urlsplit(dsn)
        netloc = parts.netloc
        if parts.password is not None:
            netloc = netloc.replace(f":{parts.password}@", ":***@", 1)
        query = "&".join("password=***" if p.split("=", 1)[0].lower() == "password" else p
                         for p in parts.query.split("&")) if parts.query else parts.query
        return urlunsplit(parts._replace(netloc=netloc, query=query))
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        return make_conninfo(dsn, password="***") if "password" in conninfo_to_dict(dsn) else dsn
    except psycopg.ProgrammingError:  # malformed: it may still hold a password, so show none of it
        return "(a key=value DSN libpq cannot parse; not shown)"


def connect(database_url: str, schema: str | None = None, **kwargs) -> psycopg.Connection:
    """A PostgreSQL connection (`session_options`). Raises `ServiceUnavailable` with the address
    when it fails; a TLS failure (a certificate not signed by the CA, a name that does not match,
    a missing file; `tls_refusal`) or a refused login (`authentication_refusal`) raises its
    subclass `DatabaseAccessRefused`, which says which first.

    `database_url` carries the TLS settings as libpq parameters, so every connection, pool and
    libpq tool (`pg_dump`) that is given it honours them: `sslmode` (`verify-full` in production:
    encrypted, the server's certificate signed by `sslrootcert` and naming the host),
    `sslrootcert` (PEM file of the CA), `sslcert`/`sslkey` (a client certificate, when the server
    asks for one); docs/production.md. libpq's `PGSSLMODE`, `PGSSLROOTCERT`, ... environment
    variables apply where the URL does not say.

    `schema` (a plain lowercase name, see `check_schema_name`) becomes the connection's whole
    `search_path`, so unqualified tables, views and offsets resolve inside that schema only.
    """
    kwargs.setdefault("options", session_options(schema))
    try:
        return psycopg.connect(database_url, connect_timeout=10, **kwargs)
    except psycopg.OperationalError as exc:
        safe = masked_dsn(database_url)
        tls = tls_refusal(str(exc))
        if tls is not None:
            raise DatabaseAccessRefused("tls", f"PostgreSQL at {safe} refused over TLS: {tls} ({exc})".strip()) from exc
        refused = authentication_refusal(str(exc))
        if refused is not None:
            raise DatabaseAccessRefused("authentication", f"PostgreSQL at {safe} refused the login: {refused} "
                                                          f"({exc})".strip()) from exc
        raise ServiceUnavailable(f"PostgreSQL at {safe} did not answer: {exc}".strip()) from exc


def migrations() -> list[tuple[int, str, str]]:
    """(number, file name, sql) of every migration, in order."""
    found = []
    for path in sorted(MIGRATIONS_DIR.glob("*.sql")):
        number = int(path.name.split("_", 1)[0])
        found.append((number, path.name, path.read_text()))
    return found


def check_schema_name(schema: str) -> str:
    """`schema` if it is a plain PostgreSQL name (lowercase letters, digits, `_`; not a system schema:
    pg_*, information_schema); else `ConfigurationError`."""
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", schema) or schema.startswith("pg_") or \
            schema == "information_schema":
        raise ConfigurationError(f"schema name {schema!r} must be lowercase letters, digits and _ (not pg_* "
                                 "or information_schema)")
    return schema


CONTROL_SCHEMA = "tapeline_control"
"""A schema of the database's Tapeline deployments that is never swapped: the swap guard table lives
there (`pgschema.SWAP_GUARD`). Readers get no USAGE on it."""

READER_ROLE = "tapeline_reader"
"""The read-only role migration 010 creates (when it may) and grants to; `Settings.reader_role`."""


def migrate(database_url: str, schema: str = "public", reader_role: str = READER_ROLE) -> list[str]:
    """Apply every migration not yet applied, each in its own transaction; returns the names applied.

    Everything (tables, views, `schema_migrations`) lands in `schema`, created when missing; the
    lifecycle tables are rewritten from `schemas/lifecycle.json` where they differ
    (`sync_lifecycle_tables`), applied or not; the swap guard in `CONTROL_SCHEMA` (outside every swapped schema) is created when missing. Then the
    read grants are made again (`grant_reader`), applied or not: a reader role created by hand after
    migration 010 ran gets them on the next run. Safe to run from several processes at once (an
    advisory lock serialises them).
    """
    applied_now = []
    with connect(database_url, schema=schema, autocommit=True) as conn:
        conn.execute(q("advisory_lock"), {"key": MIGRATION_LOCK})
        try:
            if conn.execute(q("schema_missing"), {"schema": schema}).fetchone()[0]:
                conn.execute(qf("create_schema_if_missing", schema=schema))
            conn.execute(q("create_schema_migrations"))
            done = {row[0] for row in conn.execute(q("applied_migration_versions"))}
            for number, name, sql in migrations():
                if number in done:
                    continue
                with conn.transaction():
                    conn.execute(sql)
                    conn.execute(q("record_migration"), {"version": number, "name": name})
                applied_now.append(name)
            sync_lifecycle_tables(conn)
            grant_reader(conn, schema, reader_role)
            conn.execute(qf("create_schema_if_missing", schema=CONTROL_SCHEMA))
            conn.execute(qf("create_swap_guard", schema=CONTROL_SCHEMA))  # only ever locked
        finally:
            conn.execute(q("advisory_unlock"), {"key": MIGRATION_LOCK})
    return applied_now


def lifecycle_table_rows(lifecycle: Lifecycle = LIFECYCLE) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows `lifecycle_states` and `lifecycle_ending_events` (migration 024) should hold for
    `lifecycle`: `[{state, meaning, kind}]` (kind live, final or reopenable) in state order, and
    `[{event_type, state, attempt_outcome}]` in event type order. Pure."""
    states = [{"state": state, "meaning": lifecycle.state_help[state],
               "kind": "final" if state in lifecycle.final_states
               else "reopenable" if state in lifecycle.reopenable_states else "live"}
              for state in sorted(lifecycle.states)]
    ending = [{"event_type": kind, "state": rule.state, "attempt_outcome": rule.attempt_outcome}
              for kind, rule in sorted(lifecycle.ending.items())]
    return states, ending


def sync_lifecycle_tables(conn: psycopg.Connection, lifecycle: Lifecycle = LIFECYCLE) -> bool:
    """Rewrite `lifecycle_states` and `lifecycle_ending_events` in the connection's schema from
    `lifecycle` (`schemas/lifecycle.json`) when they differ from it, in one transaction, so a new
    state or ending event takes no migration. Nothing before migration 024. Returns whether it
    wrote. (`migrate` calls it under its advisory lock.)"""
    if not conn.execute(q("lifecycle_tables_present")).fetchone()[0]:
        return False
    states, ending = lifecycle_table_rows(lifecycle)
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:  # compared as sets: the server's collation may sort otherwise
        same = (_rowset(cur.execute(q("lifecycle_state_rows")).fetchall()) == _rowset(states)
                and _rowset(cur.execute(q("lifecycle_ending_rows")).fetchall()) == _rowset(ending))
    if same:
        return False
    with conn.transaction():
        conn.execute(q("clear_lifecycle_states"))
        conn.execute(q("clear_lifecycle_ending_events"))
        with conn.cursor() as cur:
            cur.executemany(q("insert_lifecycle_state"), states)
            cur.executemany(q("insert_lifecycle_ending_event"), ending)
    return True


def _rowset(rows: list[dict[str, Any]]) -> set[tuple]:
    return {tuple(sorted(row.items())) for row in rows}


HIDDEN_COLUMNS: dict[str, tuple[str, ...]] = {"webhook_endpoints": ("secret",)}
"""Columns the read-only role never reads (the dashboard's and Grafana's login): a webhook endpoint's
signing secret is shown once, at registration, and never again. The reader gets SELECT on the
table's other columns only."""


def grant_reader(conn: psycopg.Connection, schema: str, role: str = READER_ROLE) -> list[str]:
    """What migration 010 grants `role`, made again where missing: USAGE on `schema`, SELECT on each of
    its tables and views but the `HIDDEN_COLUMNS` (taken back where the default privileges granted
    them), and SELECT on tables the migrating user creates there later (default privileges). Nothing when the role does not exist (010 then said who must create it). Idempotent:
    grants only what is missing (a GRANT rewrites the catalog row even when it changes nothing).
    Returns what it granted, e.g. `["USAGE ON SCHEMA x", "SELECT ON x.job_state"]`.
    """
    if conn.execute(q("role_missing"), {"role": role}).fetchone()[0]:
        return []
    granted = []
    with conn.transaction():
        if not conn.execute(q("role_has_schema_usage"), {"role": role, "schema": schema}).fetchone()[0]:
            conn.execute(qf("grant_schema_usage", schema=schema, role=role))
            granted.append(f"USAGE ON SCHEMA {schema}")
        missing = [name for (name,) in conn.execute(
            q("relations_not_readable_by"), {"schema": schema, "role": role}) if name not in HIDDEN_COLUMNS]
        for name in missing:
            conn.execute(qf("grant_select_on", schema=schema, relation=name, role=role))
            granted.append(f"SELECT ON {schema}.{name}")
        for name, hidden in HIDDEN_COLUMNS.items():
            relation = f'"{schema}"."{name}"'
            present, readable = conn.execute(q("table_select_granted"), {"relation": relation, "role": role}).fetchone()
            if not present:
                continue
            if readable:  # the default privileges granted the whole table when a migration created it
                conn.execute(qf("revoke_select_on", schema=schema, relation=name, role=role))
                granted.append(f"no SELECT ON {schema}.{name}.{', '.join(hidden)}")
            columns = [col for (col,) in conn.execute(q("columns_not_readable_by"), {
                "relation": relation, "role": role, "hidden": list(hidden)})]
            if columns:
                conn.execute(qf("grant_select_columns_on", columns=identifiers(columns), schema=schema,
                                relation=name, role=role))
                granted.append(f"SELECT ON {schema}.{name} ({', '.join(columns)})")
        defaults = conn.execute(q("default_select_granted"), {"schema": schema, "role": role}).fetchone()[0]
        if not defaults:
            conn.execute(qf("grant_default_select", schema=schema, role=role))
            granted.append(f"SELECT ON future tables of {schema}")
    return granted


SCHEMA_SNAPSHOT = SQL_DIR / "schema.sql"
"""What the migrations produce in a fresh database: `pg_dump --schema-only --no-owner --no-privileges`,
normalised (`normalise_schema_dump`). `scripts/schema_snapshot.py` writes it again;
tests/integration/test_schema_snapshot.py checks it. It holds no `-- name:` block, so the loader of
named queries reads nothing from it."""


def pg_dump_path(database_url: str) -> str | None:
    """The `pg_dump` of the server's major version (Debian's `/usr/lib/postgresql/<major>/bin`), else
    the one on the PATH; None when there is none."""
    import shutil

    with connect(database_url) as conn:
        major = conn.info.server_version // 10000
    candidate = Path(f"/usr/lib/postgresql/{major}/bin/pg_dump")
    return str(candidate) if candidate.exists() else shutil.which("pg_dump")


DUMP_NOISE = re.compile(r"--( |$)|\\(un)?restrict\b|SET |SELECT pg_catalog\.set_config\(")
"""A line of a schema dump that says nothing about the schema (see `normalise_schema_dump`)."""


def normalise_schema_dump(text: str) -> str:
    """A schema dump without what varies between dumps of the same schema: pg_dump's comment lines
    (`--`, `-- Name: ...`, versions), its `\\restrict` keys, the session settings it starts with
    (`SET ...`, `SELECT pg_catalog.set_config(...)`); runs of blank lines become one."""
    kept = []
    for line in text.splitlines():
        if DUMP_NOISE.match(line):
            continue
        if not line.strip() and (not kept or not kept[-1].strip()):
            continue
        kept.append(line.rstrip())
    return "\n".join(kept).strip() + "\n"


def dump_schema(database_url: str, pg_dump: str = "pg_dump") -> str:
    """The normalised schema of the database at `database_url` (every schema in it)."""
    import subprocess

    out = subprocess.run([pg_dump, "--schema-only", "--no-owner", "--no-privileges", database_url],
                         capture_output=True, text=True, check=True).stdout
    return normalise_schema_dump(out)


def wait_applied(conn: psycopg.Connection, topic: str, partition: int, target: int, timeout_s: float,
                 projection: str = "main", poll_s: float = 0.05, stop: threading.Event | None = None) -> None:
    """Block until `projection` has applied `topic[partition]` up to offset `target` (its next
    offset reaches it). `conn` must be in autocommit mode (each read sees the latest commit). Raises
    `ServiceUnavailable` after `timeout_s` seconds, or at once when `stop` is set."""
    deadline = time.monotonic() + timeout_s
    while True:
        row = conn.execute(q("projector_next_offset"), {"projection": projection, "topic": topic,
                                                          "partition": partition}).fetchone()
        position = (row["next_offset"] if isinstance(row, dict) else row[0]) if row else 0
        if position >= target:
            return
        if time.monotonic() > deadline:
            raise ServiceUnavailable(f"projector is behind on {topic}[{partition}]: at {position}, log at "
                                     f"{target} after {timeout_s:.0f} s (is `tapeline run --role projector` running?)")
        if stop is None:
            time.sleep(poll_s)
        elif stop.wait(poll_s):
            raise ServiceUnavailable(f"stopping while the projector is behind on {topic}[{partition}] (at {position}, "
                                     f"log at {target})")


def leader_session(settings: "Settings") -> dict[str, Any]:
    """`connect` keyword arguments for a session that holds a leader lock (the watchdog's, the
    notifier's, the projector's): the deployment's `session_options` with `dead_peer_settings`
    for `leader_session_timeout_s`, and libpq's keepalive parameters."""
    extra, params = dead_peer_settings(settings.leader_session_timeout_s)
    return {"options": session_options(settings.db_schema) + extra, **params}


class PostgresJobStore:
    """The `JobStore` port (`tapeline/ports.py`) over PostgreSQL: named queries of
    projections/sql/*.sql on one autocommit session in the deployment's schema, rows as dicts. The
    session opens on first use; `close` ends it (and any session lock taken through it); a later
    call opens a new one.

    A session the server or the network ended (a restart, `pg_terminate_backend`, a link cut longer
    than the keepalives) makes the call that meets it raise `ServiceUnavailable`, and the next call
    opens a new session: a worker reads its item again rather than exit. Not so for a `leader`
    store: its session held the leader lock, which ended with it, so a new session would hide the
    loss; the call raises `psycopg.OperationalError`, and so does every later one until `close`."""

    def __init__(self, settings: "Settings", leader: bool = False) -> None:
        self.settings, self.leader = settings, leader
        self._conn: psycopg.Connection | None = None

    def connection(self) -> psycopg.Connection:
        """The session itself, opened on first use (the adapter's own: not part of the port). A
        `leader` store's session (it holds a leader lock) gives up on a silent peer within
        `leader_session_timeout_s` (`dead_peer_settings`)."""
        if self._conn is None:
            self._conn = connect(self.settings.database_url, schema=self.settings.db_schema, autocommit=True,
                                 **(leader_session(self.settings) if self.leader else {}))
            self._conn.row_factory = psycopg.rows.dict_row
        return self._conn

    def open(self) -> None:
        """Open the session now, if it is not open."""
        self.connection()

    def _execute(self, name: str, params: dict[str, Any] | None):
        with self._session_lost(name):
            try:
                return self.connection().execute(q(name), params)
            except psycopg.errors.LockNotAvailable as exc:
                raise LockTimeout(f"{name}: {exc}") from exc

    @contextlib.contextmanager
    def _session_lost(self, during: str) -> Iterator[None]:
        """Around a call on the session: `ServiceUnavailable` (the session dropped, so the next call
        opens another) when a `psycopg.OperationalError` ended this store's session and the store is
        no leader's; any other error, and a leader's lost session, goes on as it is."""
        try:
            yield
        except psycopg.OperationalError as exc:
            if self.leader or self._conn is None or not self._conn.closed:
                raise
            self._conn = None
            raise ServiceUnavailable(f"PostgreSQL session lost during {during} (a new one opens on the next "
                                     f"call): {exc}".strip()) from exc

    def all(self, name: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Every row of the named query."""
        return self._execute(name, params).fetchall()

    def one(self, name: str, params: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The first row of the named query, or None."""
        return self._execute(name, params).fetchone()

    def run(self, name: str, params: dict[str, Any] | None = None) -> None:
        """Run the named statement."""
        self._execute(name, params)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """`Connection.transaction()` on the session: commit at the end, roll back on an exception."""
        with self._session_lost("a transaction"), self.connection().transaction():
            yield

    def wait_applied(self, topic: str, partition: int, target: int, timeout_s: float,
                     stop: threading.Event | None = None) -> None:
        """`wait_applied` on this session, projection `main`."""
        with self._session_lost("wait_applied"):
            wait_applied(self.connection(), topic, partition, target, timeout_s, stop=stop)

    def close(self) -> None:
        """End the session, if it was opened."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

"""SQL lives in `.sql` files: numbered migrations in `sql/migrations/`, named queries in `sql/queries.sql`.

A named query is a block starting with `-- name: <name>` and a one-line description.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import psycopg

from tapeline.errors import ConfigurationError, ServiceUnavailable

SQL_DIR = Path(__file__).resolve().parent / "sql"
MIGRATIONS_DIR = SQL_DIR / "migrations"
MIGRATION_LOCK = 0x7A9E_0001  # advisory lock key: one migrator at a time


@lru_cache(maxsize=1)
def queries() -> dict[str, str]:
    """`{name: sql}` of every named query in `sql/queries.sql`."""
    text = (SQL_DIR / "queries.sql").read_text()
    found = {}
    for block in re.split(r"^-- name: ", text, flags=re.M)[1:]:
        name, _, body = block.partition("\n")
        lines = [line for line in body.splitlines() if not line.startswith("--")]
        if name.strip() in found:  # a second definition would silently replace the first
            raise ValueError(f"queries.sql defines {name.strip()!r} twice")
        found[name.strip()] = "\n".join(lines).strip()
    return found


def q(name: str) -> str:
    """The SQL of one named query. Raises `ConfigurationError` for an unknown name."""
    try:
        return queries()[name]
    except KeyError as exc:
        raise ConfigurationError(f"no query named {name!r} in sql/queries.sql") from exc


def connect(database_url: str, schema: str | None = None, **kwargs) -> psycopg.Connection:
    """A PostgreSQL connection. Raises `ServiceUnavailable` with the address when it fails.

    `schema` (a plain lowercase name, see `check_schema_name`) becomes the connection's whole
    `search_path`, so unqualified tables, views and offsets resolve inside that schema only.
    """
    if schema is not None:
        kwargs["options"] = f"-c search_path={check_schema_name(schema)}"
    try:
        return psycopg.connect(database_url, connect_timeout=10, **kwargs)
    except psycopg.OperationalError as exc:
        safe = re.sub(r":[^:@/]+@", ":***@", database_url)
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


def migrate(database_url: str, schema: str = "public") -> list[str]:
    """Apply every migration not yet applied, each in its own transaction; returns the names applied.

    Everything (tables, views, `schema_migrations`) lands in `schema`, created when missing. Safe to
    run from several processes at once (an advisory lock serialises them).
    """
    applied_now = []
    with connect(database_url, schema=schema, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
        try:
            if conn.execute("SELECT to_regnamespace(%s) IS NULL", (schema,)).fetchone()[0]:
                conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations ("
                         " version integer PRIMARY KEY, name text NOT NULL,"
                         " applied_at timestamptz NOT NULL DEFAULT now())")
            done = {row[0] for row in conn.execute("SELECT version FROM schema_migrations")}
            for number, name, sql in migrations():
                if number in done:
                    continue
                with conn.transaction():
                    conn.execute(sql)
                    conn.execute("INSERT INTO schema_migrations (version, name) VALUES (%s, %s)", (number, name))
                applied_now.append(name)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))
    return applied_now

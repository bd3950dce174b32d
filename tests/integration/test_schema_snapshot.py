"""projections/sql/schema.sql is what the migrations give a fresh database (issue 19 item 5): a
database created for this test and migrated from scratch dumps (pg_dump --schema-only, normalised)
to exactly the snapshot. After adding a migration: `.venv/bin/python scripts/schema_snapshot.py`."""

from __future__ import annotations

import difflib
import uuid
from typing import Iterator

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from tapeline.postgres import SCHEMA_SNAPSHOT, dump_schema, migrate, normalise_schema_dump, pg_dump_path, qf
from devstack import drop_database


@pytest.fixture()
def fresh_database(base_settings) -> Iterator[str]:
    dbname = f"tapeline_test_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(base_settings.database_url, autocommit=True) as conn:
        conn.execute(qf("create_database", database=dbname))
    yield make_conninfo(base_settings.database_url, dbname=dbname)
    try:
        drop_database(base_settings.database_url, dbname)
    except psycopg.Error as exc:  # as conftest's `isolated`: the database leaks, the test stands
        print(f"could not drop test database {dbname}: {exc}")


def test_migrating_a_fresh_database_gives_the_schema_snapshot(fresh_database):
    pg_dump = pg_dump_path(fresh_database)
    # Debian's postgresql (scripts/bootstrap.sh) brings pg_dump: a missing one is a broken setup, not a skip.
    assert pg_dump is not None, "no pg_dump of the server's major version: apt-get install postgresql-client"
    migrate(fresh_database)
    got = dump_schema(fresh_database, pg_dump)
    want = normalise_schema_dump(SCHEMA_SNAPSHOT.read_text())
    assert got == want, ("the migrations no longer give projections/sql/schema.sql; if the change is "
                         "intended, run `.venv/bin/python scripts/schema_snapshot.py`:\n"
                         + "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True),
                                                        "schema.sql", "migrated", n=2))[:6000])


def test_the_snapshot_holds_no_named_query():
    """The loader of named queries reads every sql/*.sql: the snapshot must add nothing to it."""
    assert "-- name:" not in SCHEMA_SNAPSHOT.read_text()

"""The lifecycle's data in PostgreSQL (migration 024, issue 19 item 9): `migrate` writes
`lifecycle_states` and `lifecycle_ending_events` from `schemas/lifecycle.json`, rewrites them when
they differ, and the `attempts` view takes which events end an attempt, and the outcome, from them,
so a new state or ending event takes no migration. Real PostgreSQL, a database of the test's own."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import datetime, timezone
from typing import Iterator

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row

from domain.lifecycle_data import LIFECYCLE, Ending
from tapeline.postgres import lifecycle_table_rows, migrate, qf, sync_lifecycle_tables
from devstack import drop_database


@pytest.fixture(scope="module")
def database(base_settings) -> Iterator[str]:
    dbname = f"tapeline_test_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(base_settings.database_url, autocommit=True) as conn:
        conn.execute(qf("create_database", database=dbname))
    url = make_conninfo(base_settings.database_url, dbname=dbname)
    migrate(url)
    yield url
    try:
        drop_database(base_settings.database_url, dbname)
    except psycopg.Error as exc:
        print(f"could not drop test database {dbname}: {exc}")


def _tables(url: str) -> tuple[list[dict], list[dict]]:
    with psycopg.connect(url, row_factory=dict_row) as conn:
        states = conn.execute("SELECT state, meaning, kind FROM lifecycle_states ORDER BY state COLLATE \"C\"").fetchall()
        ending = conn.execute("SELECT event_type, state, attempt_outcome FROM lifecycle_ending_events "
                              "ORDER BY event_type COLLATE \"C\"").fetchall()
    return states, ending


def test_migrate_writes_the_file_into_the_tables(database):
    assert _tables(database) == lifecycle_table_rows()


def test_migrate_puts_back_what_differs_and_leaves_what_does_not(database):
    with psycopg.connect(database, autocommit=True) as conn:
        assert not sync_lifecycle_tables(conn)  # as the file says already: nothing written
        conn.execute("DELETE FROM lifecycle_states WHERE state = 'needs_review'")
        conn.execute("UPDATE lifecycle_ending_events SET attempt_outcome = 'x' WHERE event_type = 'JobFailed'")
    migrate(database)
    assert _tables(database) == lifecycle_table_rows()


def _attempt_ended_by(conn: psycopg.Connection, job_id: str, end_event: str) -> None:
    """Evidence of one applied attempt of `job_id` and then the job-ending `end_event`."""
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    rows = [(0, "AttemptStarted", '{"worker": "w", "lease_s": 30}'), (1, end_event, '{"error_class": "transient"}')]
    for offset, kind, payload in rows:
        conn.execute(
            "INSERT INTO lifecycle_evidence (topic, partition, \"offset\", broker_ts, event_id, event_type, job_id, "
            "stage, attempt, claim_token, dedup_key, occurred_at, recorded_by, applied, superseded, duplicate, payload) "
            "VALUES ('t', 0, %s, %s, %s, %s, %s, 'transcode', 1, 'tok', %s, %s, 'test', true, false, false, %s::jsonb)",
            (offset, t0, uuid.uuid4().hex, kind, job_id, f"{job_id}:{kind}", t0, payload))


def test_the_attempts_view_takes_the_outcome_of_a_job_ending_event_from_the_table(database):
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database, autocommit=True) as conn:
        _attempt_ended_by(conn, job_id, "JobCancelled")
        outcome = lambda: conn.execute("SELECT outcome FROM attempts WHERE job_id = %s", (job_id,)).fetchone()[0]
        assert outcome() == "cancelled"
        # A lifecycle.json that said otherwise (here: a new ending event's data) changes the view
        # through the table alone, with no migration.
        changed = replace(LIFECYCLE, ending={**LIFECYCLE.ending, "JobCancelled": Ending("cancelled", ("reason",), (),
                                                                                       "withdrawn")})
        assert sync_lifecycle_tables(conn, changed)
        assert outcome() == "withdrawn"
        assert sync_lifecycle_tables(conn)  # back to the repository's file
        assert outcome() == "cancelled"

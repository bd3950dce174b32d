"""Every SQL panel of the provisioned Grafana dashboard runs as the read-only role against the real
migrated projections (issue 8, item 7), on a projection with one projected job."""

from __future__ import annotations

import psycopg
import pytest

from projections.projector import apply_batch
from tapeline.postgres import connect
from tests.fakelog import FakeLog
from tests.integration.test_read_api import lifecycles
from tests.unit.test_compose import grafana_sql

pytestmark = pytest.mark.integration


def test_every_grafana_sql_panel_runs_as_tapeline_reader(isolated):
    jobs, events = lifecycles()
    log = FakeLog()
    for i, event in enumerate(events):
        log.append(i, event)
    with connect(isolated.database_url, autocommit=True) as conn:
        conn.row_factory = psycopg.rows.dict_row
        apply_batch(conn, log.messages)
        conn.execute("SET ROLE tapeline_reader")
        results = {title: conn.execute(sql).fetchall() for title, sql in grafana_sql()}
    assert results["Jobs by state"] == [{"state": "completed", "jobs": 1}, {"state": "dead_lettered", "jobs": 1},
                                        {"state": "needs_review", "jobs": 1}, {"state": "queued", "jobs": 1}]
    assert [(r["kind"], r["job_id"]) for r in results["Stalled now"]] == [("needs_review", jobs["review"].job_id)]
    assert [r["id"] for r in results["Dead letters"]] == [f"{jobs['dead'].job_id}/1"]
    assert set(results) == {"Jobs by state", "Stalled now", "Stage durations (completed stages in range)",
                            "Stage total time", "Dead letters"}

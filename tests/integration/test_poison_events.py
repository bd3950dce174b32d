"""Events that decode but that the projection cannot take (guarantee: a classified dead letter,
never a crash loop): a lease of NaN seconds that no timestamp can be computed from, and NUL
characters, which PostgreSQL's text and jsonb cannot store. Before, each stopped the projector on
the same record at every restart, and every replay failed on it."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from bench import lifecycles
from projections.replay import replay
from tapeline import kafka
from tests.integration.test_projector import lifecycle, run_projector_until_caught_up
from tests.integration.test_replay import assert_same_tables, produce

pytestmark = pytest.mark.integration


def rows(settings, sql, params=()):
    with psycopg.connect(settings.database_url) as conn:
        return conn.execute(sql, params).fetchall()


def test_events_postgresql_cannot_take_become_dead_letters_and_the_rest_is_applied(isolated):
    producer = kafka.transactional_producer(isolated, f"{isolated.app_name}.poison-writer")
    before, nan_job, nul_job, after = (lifecycle(f"u-{uuid.uuid4()}") for _ in range(4))
    nan_start = nan_job[2].model_copy(update={"lease_s": float("nan")})  # AttemptStarted
    nul_accept = nul_job[0].model_copy(update={"source_key": "uploads/k\x00"})  # JobAccepted
    literal = after[0].model_copy(update={"source_key": "uploads/a\\u0000b"})  # a backslash, not a NUL: stored
    upload = lifecycles.upload(f"u-{uuid.uuid4()}")
    nul_upload = upload.model_copy(update={"filename": "clip\x00.mp4"})
    produce(isolated, producer, before)
    produce(isolated, producer, nan_job[:2] + [nan_start] + nan_job[3:], uploads=[nul_upload])
    produce(isolated, producer, [nul_accept] + nul_job[1:])
    produce(isolated, producer, [literal] + after[1:])
    run_projector_until_caught_up(isolated)  # returns: it did not stop on any of them

    dead = rows(isolated, "SELECT kind, error_class, job_id, error FROM dead_letters ORDER BY error")
    assert [(kind, error_class) for kind, error_class, _, _ in dead] == [("projection", "invalid_input")] * 3
    assert [error.split(" ", 1)[0] for _, _, _, error in dead] == ["AttemptStarted", "JobAccepted", "UploadCompleted"]
    assert "cannot be applied to its job: ValueError" in dead[0][3] and dead[0][2] == nan_start.job_id
    assert dead[1][3] == "JobAccepted holds a NUL character in a string field; PostgreSQL text cannot store it"
    assert dead[2][3] == "UploadCompleted holds a NUL character in a string field; PostgreSQL text cannot store it"
    # The jobs around them are applied as ever; the NaN lease's job stays queued (its start is
    # evidence only), the NUL job never got a row, the upload with a NUL no row either.
    states = dict(rows(isolated, "SELECT job_id, state FROM job_state"))
    assert states == {before[0].job_id: "failed", nan_job[0].job_id: "queued", after[0].job_id: "failed"}
    assert rows(isolated, "SELECT applied, superseded FROM lifecycle_evidence WHERE event_id = %s",
                (nan_start.event_id,)) == [(False, False)]
    assert rows(isolated, "SELECT count(*) FROM lifecycle_evidence WHERE event_id = %s", (nul_accept.event_id,)) == [(0,)]
    assert rows(isolated, "SELECT payload->>'source_key' FROM lifecycle_evidence WHERE event_id = %s",
                (literal.event_id,)) == [("uploads/a\\u0000b",)]
    assert rows(isolated, "SELECT count(*) FROM uploads") == [(0,)]
    # A replay reads past them too, to the same tables.
    rebuilt = replay(isolated, "poison_rebuilt", force=True)
    assert rebuilt.dead_letters == 3
    assert_same_tables(isolated, "public", "poison_rebuilt")

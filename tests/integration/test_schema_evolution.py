"""Schema evolution end to end: the golden old events (tests/golden, schema version 1 of Heartbeat and
JobCompleted) go into real Kafka byte for byte, and the current code projects and exports them."""

from __future__ import annotations

import io
import json

import fastavro
import psycopg
import pytest

from projections.export import export
from projections.writes import PAYLOAD_OMITS
from domain import events as ev
from domain.codec import default_codec
from tapeline import kafka
from tests.golden import load
from tests.integration.test_projector import run_projector_until_caught_up

pytestmark = pytest.mark.integration
GOLDEN = load()
JOB_ID = GOLDEN[0][2]["job_id"]


@pytest.fixture(scope="module")
def golden_in_log(isolated):
    """The golden values produced unchanged, in one transaction, to the job's partition; projected."""
    producer = kafka.transactional_producer(isolated, f"{isolated.app_name}.golden-writer")
    partition = kafka.partition_for(JOB_ID, kafka.partition_count(producer, isolated.jobs_topic))
    producer.begin_transaction()
    for _, value, _ in GOLDEN:
        producer.produce(isolated.jobs_topic, key=JOB_ID.encode(), value=value, partition=partition)
    producer.commit_transaction(30)
    run_projector_until_caught_up(isolated)
    return partition


def select(settings, sql, *params):
    with psycopg.connect(settings.database_url, row_factory=psycopg.rows.dict_row) as conn:
        return conn.execute(sql, params).fetchall()


def with_later_defaults(expected: dict) -> dict:
    """The expected event as the current code reads it: fields added after the expected file was
    written appear at their defaults."""
    cls = getattr(ev, expected["event_type"])
    later = {name: field.get_default(call_default_factory=True) for name, field in cls.model_fields.items()
             if name not in expected}
    nested = {}
    for name, value in expected.items():  # a nested record (JobAccepted.media) may have gained fields too
        model = cls.model_fields[name].annotation if name in cls.model_fields else None
        if isinstance(value, dict) and hasattr(model, "model_fields"):
            nested[name] = {**{f: field.get_default(call_default_factory=True) for f, field in model.model_fields.items()
                               if f not in value}, **value}
    return {**expected, **json.loads(json.dumps(nested)), **json.loads(json.dumps(later))}


def test_old_events_are_projected(isolated, golden_in_log):
    assert select(isolated, "SELECT count(*) AS n FROM dead_letters")[0]["n"] == 0
    envelope = sorted(PAYLOAD_OMITS)
    evidence = select(isolated, f"SELECT {', '.join(envelope)}, applied, superseded, duplicate, payload"
                                " FROM lifecycle_evidence WHERE job_id = %s ORDER BY \"offset\"", JOB_ID)
    assert [r["event_type"] for r in evidence] == [record["event_type"] for record, _, _ in GOLDEN]
    assert all(r["applied"] and not r["superseded"] and not r["duplicate"] for r in evidence)
    # The payload holds every field without a column of its own; columns + payload are the whole event.
    assert all(not PAYLOAD_OMITS & r["payload"].keys() for r in evidence)
    rebuilt = [getattr(ev, r["event_type"]).model_validate({**r["payload"], **{k: r[k] for k in envelope}})
               for r in evidence]
    assert rebuilt == [getattr(ev, want["event_type"]).model_validate(with_later_defaults(want))
                       for _, _, want in GOLDEN]
    row = select(isolated, "SELECT * FROM job_state WHERE job_id = %s", JOB_ID)[0]
    assert (row["state"], row["attempts"], row["events"], row["last_event_type"]) == ("completed", 1, 13, "JobCompleted")
    assert row["master_url"] == GOLDEN[-1][2]["master_url"]
    attempts = select(isolated, "SELECT stage, attempt, outcome, heartbeats, progress_frames, wasted_s"
                                " FROM attempts WHERE job_id = %s ORDER BY claim_offset", JOB_ID)
    assert [tuple(a.values()) for a in attempts] == [("transcode", 1, "succeeded", 3, 132, 0.0),
                                                     ("publish", 1, "succeeded", 0, None, 0.0)]


def test_old_events_are_exported_as_jsonl(isolated, golden_in_log):
    out = io.BytesIO()
    result = export(isolated, out, "jsonl", job=JOB_ID)
    lines = [json.loads(line) for line in out.getvalue().decode().splitlines()]
    assert (result.events, result.skipped_undecodable) == (13, 0)
    assert [line["event"] for line in lines] == [with_later_defaults(want) for _, _, want in GOLDEN]
    assert {line["partition"] for line in lines} == {golden_in_log}


def test_old_events_are_exported_as_avro_with_the_current_schema(isolated, golden_in_log):
    out = io.BytesIO()
    assert export(isolated, out, "avro", job=JOB_ID).events == 13
    out.seek(0)
    reader = fastavro.reader(out)
    records = list(reader)
    codec = default_codec()
    assert [r["event"]["event_type"] for r in records] == [record["event_type"] for record, _, _ in GOLDEN]
    heartbeats = [r["event"] for r in records if r["event"]["event_type"] == "Heartbeat"]
    assert [(h["frames_done"], h["speed"]) for h in heartbeats] == [(40, None), (90, None), (132, None)]
    completed = [r["event"] for r in records if r["event"]["event_type"] == "JobCompleted"]
    assert [(c["media_duration_s"], c["master_url"]) for c in completed] == [(None, GOLDEN[-1][2]["master_url"])]
    # The file carries the current schema: the fields the old writers lacked are part of it.
    branches = {b["name"]: b for b in reader.writer_schema["fields"][3]["type"] if isinstance(b, dict)}
    assert "speed" in [f["name"] for f in branches["tapeline.events.Heartbeat"]["fields"]]
    # Each exported event equals the current decoding of its golden bytes.
    for record, (_, value, _) in zip(records, GOLDEN):
        assert record["event"] == codec.decode(value)

"""Dead letters end to end: poison records on every topic a processor reads, and a job out of
attempts that an operator replays (issue 5, items 4 and 5), against the real services."""

from __future__ import annotations

import base64
import json
import uuid
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from confluent_kafka import Producer

from projections.fold import dead_letter
from tapeline.postgres import q
from domain import events as ev
from domain.codec import default_codec
from tapeline.samples import sample_video
from fastapi.testclient import TestClient
from pydantic import SecretStr

from cli.wiring import build_app
from tests.conftest import Pipeline, tapeline_cli, wait_for
from tests.faults.test_worker_faults import submit, wait_state
from tests.integration.helpers import committed_events, committed_messages, of_job

pytestmark = pytest.mark.integration


def dlq_list(settings, *args: str) -> list[dict]:
    done = tapeline_cli(settings, "dlq", "list", "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def produce_raw(settings, topic: str, key: bytes, value: bytes) -> tuple[int, int]:
    """Produce one raw (non-Avro) record, not in a transaction; returns its (partition, offset)."""
    producer = Producer({"bootstrap.servers": settings.kafka_bootstrap})
    where = {}
    producer.produce(topic, key=key, value=value, headers=[("origin", b"test")],
                     on_delivery=lambda err, msg: where.update(partition=msg.partition(), offset=msg.offset()))
    assert producer.flush(10) == 0
    return where["partition"], where["offset"]


def test_poison_records_go_to_the_dead_letters_and_later_jobs_are_unaffected(isolated, tmp_path):
    settings = isolated
    pipeline = Pipeline(settings, tmp_path / "run.log").start()
    try:
        poisoned(settings, pipeline)
    finally:
        pipeline.stop()


def poisoned(settings, pipeline):
    wait_for(lambda: pipeline.children().keys() >= {"intake", "transcode", "projector"}, 60, "roles to start")
    poison = {
        "uploads": (settings.uploads_topic, b"\xc3\x01garbage that is not an upload"),
        "jobs": (settings.jobs_topic, b"not avro at all"),
        "work": (settings.work_topic("transcode", "standard"), b"\xc3\x01" + b"\x00" * 8 + b"truncated"),
    }
    ids = {}
    for name, (topic, value) in poison.items():
        partition, offset = produce_raw(settings, topic, f"poison-{name}".encode(), value)
        ids[name] = f"{topic}/{partition}/{offset}"

    job_id = submit(settings, sample_video("carphone_pristine.mp4"))
    assert wait_state(settings, job_id, timeout_s=180)["state"] == "completed"

    # The intake dead-letters the bad upload; the projector, which reads uploads too, records it as well.
    by_id = wait_for(lambda: (lambda rows: rows if set(rows) == set(ids.values()) and
                              rows[ids["uploads"]]["seen_by"] == ["intake", "projector"] else None)(
        {r["id"]: r for r in dlq_list(settings)}), 60, "three dead letters")
    uploads, jobs, work = by_id[ids["uploads"]], by_id[ids["jobs"]], by_id[ids["work"]]
    assert uploads["kind"] == "record" and uploads["error_class"] == "invalid_input"
    assert jobs["kind"] == "projection" and jobs["seen_by"] == ["projector"] and jobs["error_class"] == "invalid_input"
    assert work["kind"] == "record" and work["seen_by"] == ["transcode"] and work["stage"] == "transcode"
    # The table shows each whole id, the argument `dlq show` and `dlq replay` take, even at 80 columns.
    table = tapeline_cli(settings, "dlq", "list", env={"COLUMNS": "80"})
    assert table.returncode == 0, table.stderr
    assert all(dead_letter_id in table.stdout for dead_letter_id in ids.values()), table.stdout
    # The raw bytes and the source position are kept exactly.
    for name, (topic, value) in poison.items():
        shown = tapeline_cli(settings, "dlq", "show", ids[name], "--json")
        assert shown.returncode == 0, shown.stderr
        data = json.loads(shown.stdout)
        assert base64.b64decode(data["value"]) == value and data["topic"] == topic
        assert base64.b64decode(data["key"]) == f"poison-{name}".encode()
    # On the dead-letter topic: one DeadLetter per bad record a Kafka processor read (not the
    # lifecycle log's, which only the projector reads).
    dead = [e for e in committed_events(settings, settings.dlq_topic) if isinstance(e, ev.DeadLetter)]
    assert sorted((e.processor, e.source_topic) for e in dead) == sorted(
        [("intake", settings.uploads_topic), ("transcode", settings.work_topic("transcode", "standard"))])
    assert all(e.headers == {"origin": b"test"} for e in dead)
    # A record that is not a job cannot be replayed: a clear refusal, nothing produced.
    refused = tapeline_cli(settings, "dlq", "replay", ids["work"], "--why", "try")
    assert refused.returncode == 1 and "undecodable record" in refused.stderr
    dismissed_records(settings, ids, poison)
    # The lifecycle log still holds the poison record, and the job's events around it are intact.
    values = [m.value() for m in committed_messages(settings)]
    assert poison["jobs"][1] in values
    codec = default_codec()
    events = [ev.Event.from_record(codec.decode(v)) for v in values if v != poison["jobs"][1]]
    assert len(of_job(events, job_id, "JobCompleted")) == 1


def pending_metric(client) -> float:
    [line] = [x for x in client.get("/metrics").text.splitlines() if x.startswith("tapeline_dead_letters_pending ")]
    return float(line.split()[1])


def dismissed_records(settings, ids: dict[str, str], poison: dict[str, tuple[str, bytes]]) -> None:
    """Issue 44 items 5 and 6 on the real dead letters of `poisoned`: a raw record is for the admin
    token only, and an undecodable record's dead letter (nothing to replay or fail) is dismissed by an
    operator, audited, once: it stays with its bytes but is no longer pending (nor in the alert's gauge)."""
    token = "dismiss-test-token"
    served = settings.model_copy(update={"admin_token": SecretStr(token)})
    admin = {"Authorization": f"Bearer {token}"}
    with TestClient(build_app(served), base_url="http://localhost") as client:
        url = f"/api/dead-letters/{ids['work']}"
        anonymous, full = client.get(url).json(), client.get(url, headers=admin).json()
        assert (anonymous["key"], anonymous["value"], anonymous["headers"]) == (None, None, None)
        assert base64.b64decode(full["value"]) == poison["work"][1] and full["headers"] == {"origin": "dGVzdA=="}
        assert {k: v for k, v in anonymous.items() if k not in ("key", "value", "headers")} == \
            {k: v for k, v in full.items() if k not in ("key", "value", "headers")}  # the rest for anyone
        before = pending_metric(client)
        body = {"dead_letter_id": ids["work"], "operator": "alice", "why": "producer fixed in v2.3"}
        assert client.post("/api/dead-letters/dismiss", json=body).status_code == 401  # nothing without the token
        done = client.post("/api/dead-letters/dismiss", json=body, headers=admin)
        assert done.status_code == 200 and done.json()["done"] is True, done.text
        again = client.post("/api/dead-letters/dismiss", json={**body, "operator": "bob"}, headers=admin).json()
        assert again["done"] is False and again["detail"].startswith("already dismissed by alice at "), again
        unknown = client.post("/api/dead-letters/dismiss", json={**body, "dead_letter_id": "x/0/1"}, headers=admin)
        assert unknown.status_code == 404 and "no dead letter" in unknown.json()["detail"]
        assert pending_metric(client) == before - 1
        page = client.get("/dead-letters").text
        assert "dismissed by alice: producer fixed in v2.3" in page
    pending = {r["id"] for r in dlq_list(settings, "--pending")}
    assert ids["work"] not in pending and {ids["uploads"], ids["jobs"]} <= pending
    shown = json.loads(tapeline_cli(settings, "dlq", "show", ids["work"], "--json").stdout)
    assert (shown["dismissed_by"], shown["dismiss_reason"]) == ("alice", "producer fixed in v2.3")
    assert base64.b64decode(shown["value"]) == poison["work"][1]  # the record stays
    # The CLI dismisses the same way; one DeadLetterDismissed per dead letter on the dead-letter topic.
    cli = tapeline_cli(settings, "dlq", "dismiss", ids["uploads"], "--why", "bad client", "--operator", "carol")
    assert cli.returncode == 0 and "dismissed, dismissed: bad client" in cli.stdout, (cli.stdout, cli.stderr)
    dismissals = [e for e in committed_events(settings, settings.dlq_topic) if isinstance(e, ev.DeadLetterDismissed)]
    assert sorted((e.dead_letter_id, e.operator) for e in dismissals) == sorted(
        [(ids["work"], "alice"), (ids["uploads"], "carol")])


def test_replaying_an_unknown_dead_letter_is_a_clear_error(isolated):
    done = tapeline_cli(isolated, "dlq", "replay", f"{uuid.uuid4()}/1", "--why", "x")
    assert done.returncode == 2 and "no dead letter" in done.stderr
    usage = tapeline_cli(isolated, "dlq", "replay", "--why", "x")
    assert usage.returncode == 2 and "give one dead letter id" in usage.stderr


def test_two_sightings_of_one_bad_record_keep_the_earliest_in_either_order(isolated):
    """The projector's own sighting of an undecodable record and intake's `DeadLetter` for it are one
    row whose broker_ts, evidence and headers are the earliest sighting's, whichever is applied first
    (a replay's consumption order must not change the row)."""
    at = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)

    def sightings(id: str) -> list[dict]:
        common = dict(key=b"k", value=b"\xff")
        return [
            dead_letter(id, "projection", "uploads", 0, 7, at, "not Avro", "projector",
                         headers=[("origin", b"test")], evidence="uploads/0/7", error_class="invalid_input", **common),
            dead_letter(id, "record", "uploads", 0, 7, at + timedelta(seconds=2), "undecodable", "intake",
                         headers=[("origin", b"test"), ("retried", b"1")], evidence="dead-letters/0/3",
                         error_class="unsupported_media", stage="intake", **common)]

    with psycopg.connect(isolated.database_url, autocommit=True) as conn:
        first, second = sightings("uploads/0/7-a"), sightings("uploads/0/7-b")
        conn.cursor().executemany(q("upsert_dead_letter"), first)
        conn.cursor().executemany(q("upsert_dead_letter"), list(reversed(second)))
        rows = conn.execute("SELECT id, kind, broker_ts, evidence, headers, error, seen_by, error_class, stage "
                            "FROM dead_letters WHERE id LIKE 'uploads/0/7-%%' ORDER BY id").fetchall()
    assert [row[1:] for row in rows] == [
        ("record", at, "uploads/0/7", {"origin": base64.b64encode(b"test").decode()}, "undecodable",
         ["intake", "projector"], "unsupported_media", "intake")] * 2

"""The native replay engine (`projections/native.py`, the `native/` crate) builds exactly what the
Python engine builds, every table row for row, from one real log in Kafka into real PostgreSQL: with
one process and with two workers, on a log with retries, zombies, failures, redeliveries, repeated
uploads, an undecodable record, a job dead letter and its operator replay, and an old writer
schema's records, and a NaN lease (a dead letter); and a log it cannot fold exactly (bytes in a
lifecycle event) is replayed by the Python engine."""

from __future__ import annotations

import json
import random

import psycopg
import pytest

from bench import lifecycles
from projections.replay import replay
from domain import events as ev
from tapeline import kafka
from tapeline.clock import system_clock
from tests.conftest import tapeline_cli
from tests.enginecompare import require_native
from tests.integration.test_projector import run_projector_until_caught_up
from tests.integration.test_replay import phase, produce, rows

pytestmark = pytest.mark.integration
require_native()  # where cargo exists the engine must be built: these tests fail instead of skipping
TABLES = {  # every table a replay writes; (columns, order); columns written with now() left out
    "job_state": ("*", "job_id"),
    "lifecycle_evidence": ("*, payload::text AS payload_text", 'topic, partition, "offset"'),
    "uploads": ("*", "upload_id"),
    "dead_letters": ('id, kind, topic, partition, "offset", broker_ts, key, value, headers, error, job_id, stage, '
                     "attempt, error_class, attempts, evidence, seen_by, replayed_at, replayed_by, replay_reason", "id"),
    "applied_dedup_keys": ("*", "dedup_key"),
    "log_clock": ("*", "partition"),
    "projector_offsets": ("projection, topic, partition, next_offset", "projection, topic, partition"),
}


def golden_values() -> list[tuple[bytes, bytes]]:
    """Records written with older writer schemas (tests/golden), as (key, value)."""
    values = []
    for path in ("tests/golden/lifecycle-v1.records.jsonl", "tests/golden/providers-v1.records.jsonl"):
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                values.append((b"golden-" + path.encode(), bytes.fromhex(record["value_hex"])))
    return values


def through_profile(job: list[ev.Event], degraded: bool = False) -> list[ev.Event]:
    """`job` (a `bench.lifecycles` job: transcode -> publish, accepted before profiles) as a job of
    the `default` profile: its JobAccepted records the pipeline, and between the transcode's success
    and the publish it runs `thumbnails` (a heartbeat, three outputs, a zombie's late heartbeat
    after publish took over), or, `degraded`, skips it with a `StageSkipped`."""
    accepted = job[0].model_copy(update={"pipeline": "default", "pipeline_stages": ["transcode", "thumbnails", "publish"],
                                         "degraded": degraded})
    at = next(i for i, e in enumerate(job) if isinstance(e, ev.StageQueued) and e.stage == "publish")
    done = job[at - 1]
    assert isinstance(done, ev.AttemptSucceeded) and done.stage == "transcode"
    common = dict(job_id=accepted.job_id, recorded_by="bench", correlation_id=accepted.upload_id)
    stamp = system_clock.stamp
    if degraded:
        middle = [ev.StageSkipped.new(stamp(), stage="thumbnails", attempt=0, claim_token=done.claim_token,
                                      reason="optional stage skipped: the job runs degraded", **common)]
        return [accepted, *job[1:at], *middle, *job[at:]]
    token = f"thumbs-{accepted.job_id[:8]}"
    outputs = [ev.OutputFile(key=f"work/{accepted.job_id}/thumbnails/1/thumbnails/{name}", sha256="3" * 64,
                             size_bytes=100, content_type=kind)
               for name, kind in (("poster.jpg", "image/jpeg"), ("storyboard.jpg", "image/jpeg"),
                                  ("storyboard.vtt", "text/vtt"))]
    middle = [
        ev.StageQueued.new(stamp(), stage="thumbnails", attempt=1, tier="standard", claim_token=done.claim_token,
                           work_topic="work.thumbnails.standard", **common),
        ev.AttemptStarted.new(stamp(), stage="thumbnails", attempt=1, claim_token=token, lease_s=60.0, worker="t0",
                              work_topic="work.thumbnails.standard", work_partition=0, work_offset=0, **common),
        ev.Heartbeat.new(stamp(), stage="thumbnails", attempt=1, claim_token=token, sequence=1, frames_done=10,
                         out_time_s=2.0, **common),
        ev.AttemptSucceeded.new(stamp(), stage="thumbnails", attempt=1, claim_token=token, outputs=outputs,
                                renditions=[], media_duration_s=5.0, elapsed_s=0.5, **common),
    ]
    publish_queued = job[at].model_copy(update={"claim_token": token})
    zombie = ev.Heartbeat.new(stamp(), stage="thumbnails", attempt=1, claim_token=token, sequence=2, frames_done=11,
                              out_time_s=2.5, **common)  # after publish's claim: superseded
    return [accepted, *job[1:at], *middle, publish_queued, job[at + 1], zombie, *job[at + 2:]]


@pytest.fixture(scope="module")
def log(isolated):
    producer = kafka.transactional_producer(isolated, f"{isolated.app_name}.native-writer")
    phase(isolated, producer, 5, 8, duplicate_first=True)
    produce(isolated, producer, [], raw=[(b"not-a-job", b"\x00garbage")] + golden_values())
    job = lifecycles.job(random.Random(4), heartbeats=2, checkpoints=1)
    accepted = job[0]
    dead = ev.JobDeadLettered.new(system_clock.stamp(), job_id=accepted.job_id, stage="transcode", attempt=1, recorded_by="watchdog@x",
                                  correlation_id=accepted.upload_id, error_class="storage_transient",
                                  reason="out of attempts", attempts=1, evidence="x/1")
    replayed = ev.JobReplayed.new(system_clock.stamp(), job_id=accepted.job_id, stage="transcode", attempt=1, recorded_by="operator@y",
                                  correlation_id=accepted.upload_id, operator="ops", reason="back",
                                  dead_letter_id=f"{accepted.job_id}/1")
    produce(isolated, producer, [accepted, job[1], dead, replayed, dead])
    nan = lifecycles.job(random.Random(8), heartbeats=1, checkpoints=1)  # fold.evolve raises: a dead letter
    produce(isolated, producer, [e.model_copy(update={"lease_s": float("nan")}) if isinstance(e, ev.AttemptStarted)
                                 else e for e in nan])
    # jobs of the `default` profile (a recorded pipeline: transcode -> thumbnails -> publish), one degraded
    produce(isolated, producer, through_profile(lifecycles.job(random.Random(11), heartbeats=2, checkpoints=2))
            + through_profile(lifecycles.job(random.Random(12), heartbeats=1, checkpoints=1), degraded=True)
            + through_profile(lifecycles.job(random.Random(13), heartbeats=1, checkpoints=1, failed_attempts=1)))
    run_projector_until_caught_up(isolated)
    profiled = rows(isolated, "SELECT job_id, state, pipeline, pipeline_stages, outputs FROM job_state "
                              "WHERE pipeline IS NOT NULL ORDER BY job_id")
    assert len(profiled) == 3 and all(r["pipeline_stages"] == ["transcode", "thumbnails", "publish"] for r in profiled)
    assert all(r["state"] == "completed" for r in profiled), profiled
    thumbs = [o["key"] for r in profiled for o in r["outputs"] if "/thumbnails/" in o["key"]]
    assert len(thumbs) == 6  # two jobs ran thumbnails (three objects each, beside the transcode's); one skipped it
    return producer


def assert_same_tables(settings, a: str, b: str) -> None:
    for name, (columns, order) in TABLES.items():
        left = rows(settings, f"SELECT {columns} FROM {a}.{name} ORDER BY {order}")
        right = rows(settings, f"SELECT {columns} FROM {b}.{name} ORDER BY {order}")
        assert left == right, f"{name} differs between {a} and {b}"


@pytest.mark.parametrize("workers", [1, 2])
def test_native_and_python_engines_build_the_same_tables(isolated, log, workers):
    python = replay(isolated, f"py_{workers}", workers=workers, engine="python")
    native_run = replay(isolated, f"nat_{workers}", workers=workers, engine="native")
    assert python.engine == "python" and native_run.engine == "native" and not native_run.engine_note
    assert (native_run.records, native_run.applied, native_run.duplicates, native_run.superseded,
            native_run.dead_letters) == (python.records, python.applied, python.duplicates, python.superseded,
                                         python.dead_letters)
    assert python.duplicates > 0 and python.superseded > 0 and python.dead_letters >= 2
    assert_same_tables(isolated, f"py_{workers}", f"nat_{workers}")
    assert_same_tables(isolated, "public", f"nat_{workers}")  # and the live projection's
    kinds = {r["kind"] for r in rows(isolated, f"SELECT kind FROM nat_{workers}.dead_letters")}
    assert kinds == {"job", "projection"}
    assert rows(isolated, f"SELECT count(*) AS n FROM nat_{workers}.dead_letters WHERE replayed_by = 'ops'")[0]["n"] == 1


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_log_the_native_engine_cannot_fold_is_replayed_by_the_python_engine(isolated, log, workers):
    # A processor's dead letter written to the lifecycle topic (bytes in a lifecycle event): the
    # native engine does not fold it, the Python one keeps it as evidence.
    stray = ev.DeadLetter.new(system_clock.stamp(), job_id="stray", stage="intake", attempt=0, recorded_by="intake@a", correlation_id="c",
                              source_topic="x", source_partition=0, source_offset=1, key=b"k", value=b"v",
                              headers={}, error_class="invalid_input", error="bad", processor="intake")
    produce(isolated, log, [stray])
    run_projector_until_caught_up(isolated)
    schema = f"fell_back_{workers}"
    done = tapeline_cli(isolated, "replay", "--into", schema, "--json", "--engine", "native", "--workers", workers)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["engine"] == "python" and "bytes" in summary["engine_note"]
    assert summary["workers"] == int(workers)
    assert "replaying with the Python engine" in done.stderr
    assert_same_tables(isolated, "public", schema)


def test_float_payloads_are_spelled_the_same(isolated):
    """The evidence payload is a json column, which keeps the text as written: the native engine must
    spell floats as pydantic does (ryu's digits, `1e+16` where ryu writes `1e16`), over a spread of
    magnitudes, and PostgreSQL must read back each value exactly."""
    from projections.bulk import FoldState
    from projections.native import NativeFoldState
    from domain.codec import default_codec
    from tests.fakelog import FakeMessage

    def raw_payloads(data: bytes) -> list[str]:  # the payload field of each binary COPY row, as sent
        payloads, pos = [], 0
        while pos < len(data):
            pos += 2  # field count
            for field in range(18):
                size = int.from_bytes(data[pos:pos + 4], "big", signed=True)
                pos += 4
                if size >= 0:
                    if field == 17:
                        payloads.append(data[pos:pos + size].decode())  # json's binary format: the text
                    pos += size
        return payloads

    rng = random.Random(1)
    values = [0.0, -0.0, 1.0, 0.1, 1e15, 1e16, 1e17, 1.5e-7, 1e-5, 5e-324, 1.7976931348623157e308, 2.0 ** 63, 1 / 3]
    values += [rng.uniform(-1e6, 1e6) for _ in range(100)] + [10 ** rng.uniform(-30, 30) for _ in range(100)]
    messages = [FakeMessage("t.jobs", 0, i, 1_700_000_000_000 + i, default_codec().encode(ev.Heartbeat.new(system_clock.stamp(), 
        job_id="j", stage="transcode", attempt=1, recorded_by="w@x", correlation_id="c", sequence=i, frames_done=1,
        out_time_s=v, speed=-v).to_record())) for i, v in enumerate(values)]
    _, native_rows = NativeFoldState("t.jobs", "t.dlq").fold(messages, None, {})
    _, folded = FoldState("t.jobs", "t.dlq").fold(messages, None, {})
    with psycopg.connect(isolated.database_url) as conn:
        for value, python_row, native_text in zip(values, folded.evidence, raw_payloads(native_rows), strict=True):
            python_text = python_row[17].decode()
            assert native_text == python_text
            stored = conn.execute("SELECT (%s::json->>'out_time_s')::float8, (%s::json->>'speed')::float8",
                                  (native_text, native_text)).fetchone()
            assert stored == (value, -value), native_text

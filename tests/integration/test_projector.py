"""The projector against real Kafka and PostgreSQL: exactly once, restartable, rebuildable."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest

from processors.runtime import transact
from cli.wiring import build_runtime
from domain.lifecycle import JOB_STATE_COLUMNS
from projections.projector import apply_batch
from cli.wiring import build_projector
from tapeline.postgres import connect, migrate
from domain import events as ev
from tapeline import kafka
import devstack as stack
from tapeline.clock import system_clock
from tests.conftest import wait_for
from tests.integration.helpers import committed_messages

pytestmark = pytest.mark.integration
MEDIA = ev.SourceMedia(format_name="mov", duration_s=5.28, width=1280, height=720, display_width=1280,
                       display_height=720, rotation=0, fps=25.0, frames=132, video_codec="h264")


def lifecycle(upload_id: str) -> list[ev.Event]:
    job = ev.job_id_for(upload_id)
    common = dict(job_id=job, recorded_by="test", correlation_id=upload_id)
    ladder = [ev.Rendition(name="720p", width=1280, height=720, video_bitrate_kbps=2800)]
    return [
        ev.JobAccepted.new(system_clock.stamp(), stage="intake", attempt=0, upload_id=upload_id, source_key="k", source_sha256="0" * 64,
                           source_size_bytes=1, priority="standard", profile="default", media=MEDIA, ladder=ladder,
                           **common),
        ev.StageQueued.new(system_clock.stamp(), stage="transcode", attempt=1, tier="standard", work_topic="w", **common),
        ev.AttemptStarted.new(system_clock.stamp(), stage="transcode", attempt=1, claim_token="t1", lease_s=10.0, worker="w", work_topic="w",
                              work_partition=0, work_offset=0, **common),
        ev.Heartbeat.new(system_clock.stamp(), stage="transcode", attempt=1, claim_token="t1", sequence=1, frames_done=10, out_time_s=0.4,
                         **common),
        # A zombie's late event: another claim token, kept as evidence only.
        ev.AttemptFailed.new(system_clock.stamp(), stage="transcode", attempt=1, claim_token="zombie", error_class="unknown",
                             retryable=True, reason="late", **common),
        ev.JobFailed.new(system_clock.stamp(), stage="transcode", attempt=1, claim_token="t1", error_class="invalid_input", reason="bad",
                         **common),
    ]


@pytest.fixture(scope="module")
def written(isolated):
    """Two jobs' lifecycles committed to the log, the first one's events written twice."""
    runtime = build_runtime(isolated, "test")
    producer = runtime.events.transactional_producer(f"{isolated.app_name}.test-writer")
    first, second = lifecycle(f"u-{uuid.uuid4()}"), lifecycle(f"u-{uuid.uuid4()}")
    for events in (first, second, first):  # the repeat is a redelivery of identical events
        transact(producer, lambda events=events: runtime.produce(producer, [(isolated.jobs_topic, e) for e in events]))
    runtime.close()
    return first, second


def run_projector_until_caught_up(settings):
    stop, ready = threading.Event(), threading.Event()
    projector = build_projector(settings)
    thread = threading.Thread(target=projector.run, args=(stop, ready), daemon=True)
    thread.start()
    wait_for(ready.is_set, 60, "the projector to reach the end of every partition")
    stop.set()
    thread.join(30)
    return projector


def table(settings, sql):
    with psycopg.connect(settings.database_url, row_factory=psycopg.rows.dict_row) as conn:
        return conn.execute(sql).fetchall()


def test_projection_applies_each_dedup_key_once_and_fences_stale_tokens(isolated, written):
    first, second = written
    run_projector_until_caught_up(isolated)
    rows = {r["job_id"]: r for r in table(isolated, "SELECT * FROM job_state")}
    assert set(rows) == {first[0].job_id, second[0].job_id}
    for job in (first, second):
        row = rows[job[0].job_id]
        assert row["state"] == "failed" and row["error_class"] == "invalid_input" and row["events"] == 5
    evidence = table(isolated, "SELECT event_type, applied, superseded, duplicate FROM lifecycle_evidence"
                               " ORDER BY partition, \"offset\"")
    assert len(evidence) == 18
    # The repeat of the first job: its five applied events are duplicates; the zombie's event was
    # never applied, so its copy is not a duplicate, just evidence again (the job had ended by then).
    assert sum(r["duplicate"] for r in evidence) == 5
    assert sum(r["applied"] for r in evidence) == 10
    assert [r["event_type"] for r in evidence if r["superseded"]] == ["AttemptFailed", "AttemptFailed"]


def test_restart_and_redelivery_never_apply_twice(isolated, written):
    run_projector_until_caught_up(isolated)
    before = table(isolated, "SELECT * FROM job_state ORDER BY job_id")
    offsets_before = table(isolated, "SELECT topic, partition, next_offset FROM projector_offsets ORDER BY 1, 2")
    run_projector_until_caught_up(isolated)  # a restart resumes at the stored offsets
    assert table(isolated, "SELECT * FROM job_state ORDER BY job_id") == before
    # Redeliver every record again through apply_batch: nothing changes.
    messages = committed_messages(isolated)
    with connect(isolated.database_url, autocommit=True) as conn:
        conn.row_factory = psycopg.rows.dict_row
        result = apply_batch(conn, messages)
    assert result.applied == 0
    assert table(isolated, "SELECT * FROM job_state ORDER BY job_id") == before
    assert len(table(isolated, "SELECT 1 FROM lifecycle_evidence")) == 18
    assert table(isolated, "SELECT topic, partition, next_offset FROM projector_offsets ORDER BY 1, 2") == offsets_before


def test_rebuild_from_offset_zero_gives_identical_rows(isolated, written):
    run_projector_until_caught_up(isolated)
    fresh = isolated.model_copy(update={"database_url": isolated.database_url.rsplit("/", 1)[0] + "/" + (
        isolated.database_url.rsplit("/", 1)[1] + "_rebuild")})
    with psycopg.connect(isolated.database_url.rsplit("/", 1)[0] + "/tapeline", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{fresh.database_url.rsplit("/", 1)[1]}"')
        conn.execute(f'CREATE DATABASE "{fresh.database_url.rsplit("/", 1)[1]}"')
    try:
        migrate(fresh.database_url)
        run_projector_until_caught_up(fresh)
        columns = ", ".join(JOB_STATE_COLUMNS)
        assert table(fresh, f"SELECT {columns} FROM job_state ORDER BY job_id") == \
            table(isolated, f"SELECT {columns} FROM job_state ORDER BY job_id")
    finally:
        stack.drop_database(isolated.database_url.rsplit("/", 1)[0] + "/tapeline", fresh.database_url.rsplit("/", 1)[1])


def test_job_state_columns_match_the_migration(isolated):
    columns = [r["column_name"] for r in table(
        isolated, "SELECT column_name FROM information_schema.columns WHERE table_name = 'job_state'"
                  " ORDER BY ordinal_position")]
    assert tuple(columns) == JOB_STATE_COLUMNS


def test_projector_refuses_offsets_from_another_kafka_cluster(isolated, written):
    run_projector_until_caught_up(isolated)  # records this cluster
    with psycopg.connect(isolated.database_url, autocommit=True) as conn:
        conn.execute("UPDATE projection_source SET cluster_id = 'another-cluster'")
        before = conn.execute("SELECT count(*) FROM lifecycle_evidence").fetchone()[0]
    stop = threading.Event()
    projector = build_projector(isolated)
    thread = threading.Thread(target=projector.run, args=(stop,), daemon=True)
    thread.start()
    thread.join(3)
    assert thread.is_alive()  # idles, does not crash-loop
    stop.set()
    thread.join(10)
    assert not thread.is_alive() and projector.processed == 0
    with psycopg.connect(isolated.database_url, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM lifecycle_evidence").fetchone()[0] == before
        conn.execute("UPDATE projection_source SET cluster_id = %s", (_cluster_id(isolated),))


def test_waiting_for_a_job_fails_fast_when_the_projections_come_from_another_cluster(isolated, written):
    from cli.job_commands import _wait_for_job
    from domain.errors import TapelineError

    run_projector_until_caught_up(isolated)  # records this cluster
    with psycopg.connect(isolated.database_url, autocommit=True) as conn:
        conn.execute("UPDATE projection_source SET cluster_id = 'another-cluster'")
    try:
        started = time.monotonic()
        with pytest.raises(TapelineError) as info:  # not the whole timeout's "are the processors running?"
            _wait_for_job(isolated, str(uuid.uuid4()), timeout_s=60, show_progress=False)
        assert time.monotonic() - started < 20
        assert "another Kafka cluster" in str(info.value) and "another-cluster" in str(info.value)
        assert _cluster_id(isolated) in str(info.value) and "tapeline replay --into" in str(info.value)
    finally:
        with psycopg.connect(isolated.database_url, autocommit=True) as conn:
            conn.execute("UPDATE projection_source SET cluster_id = %s", (_cluster_id(isolated),))


def test_a_processor_told_to_stop_gives_up_waiting_for_a_projection_at_once(isolated, written):
    """A processor waiting for the projection (here one that never runs) stops when asked, not after
    its caught-up timeout (a supervisor's SIGTERM would otherwise wait the whole grace)."""
    from domain.errors import ServiceUnavailable
    from tapeline.postgres import wait_applied

    reader = kafka.consumer(isolated, f"lso-{uuid.uuid4().hex[:6]}")
    partition = kafka.partition_for(written[0][0].job_id, kafka.partition_count(reader, isolated.jobs_topic))
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    try:
        with connect(isolated.database_url, autocommit=True) as conn:
            started = time.monotonic()
            with pytest.raises(ServiceUnavailable, match="stopping while the projector is behind"):
                target = kafka.last_stable_offsets(reader, isolated.jobs_topic, [partition])[partition]
                wait_applied(conn, isolated.jobs_topic, partition, target, 60.0, projection="never-run", stop=stop)
            assert time.monotonic() - started < 10  # the timeout is 60 s
    finally:
        reader.close()


def _cluster_id(settings):
    consumer = kafka.consumer(settings, "cluster-id")
    try:
        return consumer.list_topics(timeout=10).cluster_id
    finally:
        consumer.close()


def test_an_upload_from_a_submitter_with_a_slow_clock_gets_the_brokers_time(isolated):
    """The uploads topic is LogAppendTime like the lifecycle log: a submitter whose clock is an hour
    behind does not make its upload an hour old (stall views, lag, as-of cuts read broker time)."""
    from bench import lifecycles
    from domain.codec import default_codec

    upload = lifecycles.upload(f"u-{uuid.uuid4()}")
    producer = kafka.idempotent_producer(isolated)
    an_hour_ago_ms = int((time.time() - 3600) * 1000)
    producer.produce(isolated.uploads_topic, key=upload.upload_id.encode(),
                     value=default_codec().encode(upload.to_record()), timestamp=an_hour_ago_ms,
                     partition=kafka.partition_for(upload.upload_id, kafka.partition_count(producer, isolated.uploads_topic)))
    assert producer.flush(30) == 0
    run_projector_until_caught_up(isolated)
    broker_ts = table(isolated, f"SELECT broker_ts FROM uploads WHERE upload_id = '{upload.upload_id}'")[0]["broker_ts"]
    assert abs(broker_ts.timestamp() - time.time()) < 60

"""Projection lag (events and seconds behind the log end) against real Kafka and PostgreSQL: shown by
`tapeline status`, exported as Prometheus gauges by the projector process."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from datetime import datetime, timezone

import pytest

from tapeline.lag import LagObserver, lag_reader, measure
from tapeline.postgres import connect
from tapeline import kafka
from tapeline.health import HealthState
from cli.wiring import build_projector
from tests.conftest import settings_env, tapeline_cli, wait_for
from tests.integration.test_projector import lifecycle, run_projector_until_caught_up
from tests.integration.test_replay import produce

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def producer(isolated):
    """A transactional writer; one job already projected, so every partition has a stored offset."""
    writer = kafka.transactional_producer(isolated, f"{isolated.app_name}.lag-writer")
    produce(isolated, writer, lifecycle(f"u-{uuid.uuid4()}"))
    run_projector_until_caught_up(isolated)
    return writer


def status_json(settings) -> dict:
    done = tapeline_cli(settings, "status", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["projection_lag"]


def partition_of(settings, producer, job_id: str) -> int:
    return kafka.partition_for(job_id, kafka.partition_count(producer, settings.jobs_topic))


def events_of_two_jobs(settings, producer):
    """Two jobs on two different partitions of the lifecycle log (first 4 and first 3 events)."""
    first = lifecycle(f"u-{uuid.uuid4()}")[:4]
    while True:
        second = lifecycle(f"u-{uuid.uuid4()}")[:3]
        if partition_of(settings, producer, second[0].job_id) != partition_of(settings, producer, first[0].job_id):
            return first, second


def test_status_shows_events_and_seconds_behind_then_zero_after_the_projector_runs(isolated, producer):
    assert (status_json(isolated)["events"], status_json(isolated)["seconds"]) == (0, 0.0)
    first, second = events_of_two_jobs(isolated, producer)
    before = datetime.now(timezone.utc)
    produce(isolated, producer, first)
    produce(isolated, producer, second)
    after = datetime.now(timezone.utc)
    produce(isolated, producer, lifecycle(f"u-{uuid.uuid4()}")[:2], abort=True)  # aborted: never behind
    cli_start = datetime.now(timezone.utc)
    lag = status_json(isolated)
    cli_end = datetime.now(timezone.utc)

    assert (lag["events"], lag["exact"]) == (7, True)
    behind = {(p["topic"], p["partition"]): p for p in lag["partitions_behind"] if p["events"]}
    expected = {(isolated.jobs_topic, partition_of(isolated, producer, first[0].job_id)): 4,
                (isolated.jobs_topic, partition_of(isolated, producer, second[0].job_id)): 3}
    assert {key: p["events"] for key, p in behind.items()} == expected
    # Offsets count what read_committed skips: one commit marker per transaction, the aborted records
    # and the abort marker; events do not.
    assert lag["offsets"] == 7 + 2 + 3
    # Seconds: from the oldest unapplied record's broker time (appended between `before` and `after`)
    # to the measurement (during the CLI run); 1 ms of slack for the broker's millisecond timestamps.
    oldest = min(datetime.fromisoformat(p["oldest_unapplied_at"]) for p in behind.values())
    assert before.timestamp() - 0.001 <= oldest.timestamp() <= after.timestamp() + 0.001
    assert (cli_start - after).total_seconds() - 0.001 <= lag["seconds"] <= (cli_end - before).total_seconds() + 0.001

    text = tapeline_cli(isolated, "status")
    assert text.returncode == 0, text.stderr
    assert "projection lag: 7 events" in text.stdout

    run_projector_until_caught_up(isolated)
    lag = status_json(isolated)
    assert (lag["events"], lag["seconds"], lag["offsets"], lag["partitions_behind"]) == (0, 0.0, 0, [])
    assert "projection lag: 0 events, 0.0 s behind the log end" in tapeline_cli(isolated, "status").stdout


def test_beyond_the_scan_limit_events_are_an_upper_bound_from_offsets(isolated, producer):
    events = lifecycle(f"u-{uuid.uuid4()}")[:5]
    produce(isolated, producer, events)
    key = (isolated.jobs_topic, partition_of(isolated, producer, events[0].job_id))
    consumer = lag_reader(isolated)
    try:
        with connect(isolated.database_url, autocommit=True) as conn:
            exact = {(p.topic, p.partition): p for p in measure(isolated, conn, consumer).partitions}[key]
            bounded = {(p.topic, p.partition): p for p in measure(isolated, conn, consumer, scan_limit=2).partitions}[key]
    finally:
        consumer.close()
    assert (exact.events, exact.offsets, exact.exact) == (5, 6, True)
    assert (bounded.events, bounded.offsets, bounded.exact) == (6, 6, False)
    assert bounded.oldest_unapplied_at == exact.oldest_unapplied_at is not None  # the first record is still read
    run_projector_until_caught_up(isolated)


def gauge(health: HealthState, name: str, topic: str, partition: int) -> float | None:
    return health.registry.get_sample_value(name, {"topic": topic, "partition": str(partition)})


def test_the_projector_exports_lag_gauges(isolated, producer):
    events = lifecycle(f"u-{uuid.uuid4()}")[:3]
    topic, partition = isolated.jobs_topic, partition_of(isolated, producer, events[0].job_id)
    produce(isolated, producer, events)
    produced_at = time.time()
    # With the projector stopped, an observer on its own sees the three events waiting.
    health = HealthState("projector")
    observer = LagObserver(isolated, health, interval_s=0.2).start()
    try:
        wait_for(lambda: gauge(health, "tapeline_projection_lag_events", topic, partition) == 3, 30,
                 "the lag gauge to show 3 events")
        seconds = gauge(health, "tapeline_projection_lag_seconds", topic, partition)
        assert 0.0 < seconds <= time.time() - produced_at + 1.0
        assert health.deep()["projection_lag"]["events"] == 3
        assert b'tapeline_projection_lag_events{partition="%d",topic="%s"} 3.0' % (partition, topic.encode()) \
            in health.metrics()
    finally:
        observer.stop()
    # The projector's own observer: once it has applied them, 0 events and 0 seconds.
    stop = threading.Event()
    projector = build_projector(isolated, lag_interval_s=0.2)
    thread = threading.Thread(target=projector.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: gauge(projector.health, "tapeline_projection_lag_events", topic, partition) == 0
                 and gauge(projector.health, "tapeline_projection_lag_seconds", topic, partition) == 0, 60,
                 "the projector's gauge to reach 0")
        deep = projector.health.deep()["projection_lag"]
        assert (deep["events"], deep["seconds"], deep["exact"]) == (0, 0.0, True)
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()


def test_a_served_projector_process_exports_the_gauges_on_metrics(isolated, producer):
    """`tapeline run --role projector` with a health port: /metrics has both gauges for every
    partition it reads, at 0 once it has applied what was produced while it was down."""
    events = lifecycle(f"u-{uuid.uuid4()}")[:3]
    produce(isolated, producer, events)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--role", "projector"],
                               env={**settings_env(isolated), "TAPELINE_HEALTH_PORT": str(port)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def metrics() -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                return response.read().decode()
        except OSError:
            return ""

    try:
        jobs = [(isolated.jobs_topic, p) for p in range(isolated.jobs_partitions)]
        uploads = [(isolated.uploads_topic, p) for p in range(isolated.uploads_partitions)]
        pattern = 'tapeline_projection_lag_{}{{partition="{}",topic="{}"}} 0.0'
        wait_for(lambda: all(pattern.format(kind, p, t) in metrics() for t, p in jobs + uploads
                             for kind in ("events", "seconds")), 60,
                 "every partition's lag gauges at 0 on the projector's /metrics")
    finally:
        process.terminate()
        process.wait(30)
    assert process.returncode == 0
    lag = status_json(isolated)
    assert (lag["events"], lag["offsets"]) == (0, 0)

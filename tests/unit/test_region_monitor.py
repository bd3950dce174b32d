"""Region B's lag as metrics (regions/monitor.py): what a measurement sets on the gauges the
alerts read (compose/alerts.yml group tapeline-region-b), the ages computed at scrape time, a failed
measurement keeping the last values and not moving the measured timestamp, and the `/health/deep`
section the dashboard's panel reads. The measurement's reads are `region status`'s own
(regions/measure.py, regions/object_audit.py), tested against real services in
tests/integration/test_region_mirror.py and test_region_media.py."""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone

from prometheus_client import CollectorRegistry, generate_latest

from domain.replication import ObjectTotals
from tapeline.health import HealthState
from regions.mirror_lag import PartitionCount, RegionLag, partition_lag
from regions.monitor import RegionGauges, RegionSample, region_section

T0 = datetime(2026, 12, 5, 12, 0, tzinfo=timezone.utc)


class Clock:
    def __init__(self, at: datetime) -> None:
        self.at = at.timestamp()

    def __call__(self) -> float:
        return self.at


def lag(*counts: PartitionCount, at: datetime = T0) -> RegionLag:
    return RegionLag(at, [partition_lag(c) for c in counts])


def objects(pending: int = 0, oldest: datetime | None = None) -> ObjectTotals:
    return ObjectTotals(named=10 + pending, replicated=10, replicated_bytes=1000, pending=pending,
                        pending_bytes=50 * pending, pending_bytes_known=True, oldest_pending_named_at=oldest,
                        pending_by_reason={"unread": pending} if pending else {})


# jobs partition 0: 5 committed in A, 2 in B, A's newest at +40 s, the newest B holds (A's 2nd) at +10 s
JOBS_BEHIND = PartitionCount("tapeline.jobs", 0, committed_a=5, span_a=7, records_b=2,
                             newest_a_ms=int(T0.timestamp() * 1000) + 40_000,
                             mirrored_a_ms=int(T0.timestamp() * 1000) + 10_000)
JOBS_CAUGHT_UP = PartitionCount("tapeline.jobs", 1, committed_a=3, span_a=4, records_b=3, newest_a_ms=1, mirrored_a_ms=1)
UPLOADS_BEHIND = PartitionCount("tapeline.uploads", 0, committed_a=4, span_a=4, records_b=0,
                                newest_a_ms=int(T0.timestamp() * 1000) + 5_000,
                                mirrored_a_ms=int(T0.timestamp() * 1000))


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_a_measurement_sets_the_gauges_the_alerts_read():
    registry, clock = CollectorRegistry(), Clock(T0)
    gauges = RegionGauges(registry, clock=clock)
    sample = RegionSample(T0, lag(JOBS_BEHIND, JOBS_CAUGHT_UP, UPLOADS_BEHIND), objects(3, T0 - timedelta(seconds=100)),
                          True, T0 - timedelta(seconds=2))
    gauges.publish(sample)
    assert value(registry, "tapeline_region_lag_events", topic="tapeline.jobs") == 3
    assert value(registry, "tapeline_region_lag_events", topic="tapeline.uploads") == 4
    assert value(registry, "tapeline_region_lag_seconds", topic="tapeline.jobs") == 30.0
    assert value(registry, "tapeline_region_lag_seconds", topic="tapeline.uploads") == 5.0
    assert value(registry, "tapeline_region_lag_exact") == 1
    assert value(registry, "tapeline_region_objects_pending") == 3
    assert value(registry, "tapeline_region_objects_pending_bytes") == 150
    assert value(registry, "tapeline_region_objects_replicated") == 10
    assert value(registry, "tapeline_region_objects_pending_oldest_seconds") == 100.0
    assert value(registry, "tapeline_region_mirror_heartbeat_age_seconds") == 2.0
    assert value(registry, "tapeline_region_lag_measured_timestamp_seconds") == T0.timestamp()
    assert value(registry, "tapeline_region_lag_measurements_total", result="complete") == 1
    assert value(registry, "tapeline_region_lag_measurements_total", result="failed") == 0
    # the ages grow between measurements (computed when scraped)
    clock.at += 60
    assert value(registry, "tapeline_region_objects_pending_oldest_seconds") == 160.0
    assert value(registry, "tapeline_region_mirror_heartbeat_age_seconds") == 62.0
    # every metric has its help text with a unit in the exposition
    text = generate_latest(registry).decode()
    assert "# HELP tapeline_region_lag_seconds Region B: how far" in text and "seconds" in text


def test_a_failed_measurement_keeps_the_last_figures_and_the_measured_time():
    registry, clock = CollectorRegistry(), Clock(T0)
    gauges = RegionGauges(registry, clock=clock)
    gauges.publish(RegionSample(T0, lag(JOBS_BEHIND), objects(1, T0), True, T0))
    later = T0 + timedelta(seconds=30)
    clock.at = later.timestamp()
    # region A's Kafka did not answer: no log lag; objects and heartbeat were read
    gauges.publish(RegionSample(later, None, objects(0), True, None, ["log lag not measured: KafkaException: down"]))
    assert value(registry, "tapeline_region_lag_events", topic="tapeline.jobs") == 3  # the last known figure
    assert value(registry, "tapeline_region_objects_pending") == 0
    assert value(registry, "tapeline_region_objects_pending_oldest_seconds") == 0.0  # nothing pending
    assert value(registry, "tapeline_region_mirror_heartbeat_age_seconds") == 30.0  # the last heartbeat seen
    assert value(registry, "tapeline_region_lag_measured_timestamp_seconds") == T0.timestamp()  # not moved
    assert value(registry, "tapeline_region_lag_measurements_total", result="failed") == 1


def test_no_heartbeat_seen_counts_from_the_start_and_a_topic_gone_loses_its_series():
    registry, clock = CollectorRegistry(), Clock(T0)
    gauges = RegionGauges(registry, clock=clock)
    assert value(registry, "tapeline_region_lag_measured_timestamp_seconds") == 0  # never measured
    clock.at += 45
    assert value(registry, "tapeline_region_mirror_heartbeat_age_seconds") == 45.0
    gauges.publish(RegionSample(T0, lag(JOBS_BEHIND, UPLOADS_BEHIND), objects(), True, None))
    gauges.publish(RegionSample(T0, lag(UPLOADS_BEHIND), objects(), True, None))
    assert value(registry, "tapeline_region_lag_events", topic="tapeline.jobs") is None
    assert value(registry, "tapeline_region_lag_events", topic="tapeline.uploads") == 4


def test_a_partition_too_long_to_count_is_an_upper_bound_with_unknown_seconds():
    registry = CollectorRegistry()
    gauges = RegionGauges(registry, clock=Clock(T0))
    uncounted = PartitionCount("tapeline.jobs", 0, committed_a=0, span_a=900_000, records_b=100, newest_a_ms=None,
                               mirrored_a_ms=None, counted=False)
    gauges.publish(RegionSample(T0, lag(uncounted), objects(), False, T0))
    assert value(registry, "tapeline_region_lag_events", topic="tapeline.jobs") == 899_900
    assert math.isnan(value(registry, "tapeline_region_lag_seconds", topic="tapeline.jobs"))
    assert value(registry, "tapeline_region_lag_exact") == 0


def test_the_deep_section_says_what_was_measured_and_when():
    health = HealthState("replicator", instance="r")
    assert region_section(None, None, 30.0) == {"measured_at": None, "complete_at": None, "every_s": 30.0, "lag": None,
                                                "objects": None, "heartbeat_at": None, "errors": []}
    sample = RegionSample(T0, lag(JOBS_BEHIND), objects(2, T0 - timedelta(seconds=7)), False,
                          T0 - timedelta(seconds=1))
    health.set_section("region_replication", region_section(sample, T0, 30.0))
    doc = json.loads(json.dumps(health.deep()))["region_replication"]  # JSON-ready, in /health/deep
    assert doc["measured_at"] == doc["complete_at"] == T0.isoformat()
    assert (doc["lag"]["events_behind"], doc["lag"]["seconds_behind"], doc["lag"]["exact"]) == (3, 30.0, True)
    assert doc["lag"]["topics"]["tapeline.jobs"]["events_behind"] == 3
    assert (doc["objects"]["pending"], doc["objects"]["oldest_pending_age_s"], doc["objects"]["exact"]) == (2, 7.0, False)
    assert doc["objects"]["oldest_pending_named_at"] == (T0 - timedelta(seconds=7)).isoformat()
    assert doc["heartbeat_at"] == (T0 - timedelta(seconds=1)).isoformat()
    failed = RegionSample(T0 + timedelta(seconds=30), None, None, None, None, ["objects not measured: x"])
    doc = region_section(failed, T0, 30.0)
    assert (doc["lag"], doc["objects"], doc["errors"], doc["complete_at"]) == (None, None, ["objects not measured: x"],
                                                                             T0.isoformat())


def test_a_replicator_whose_metrics_port_is_taken_runs_without_it():
    """`region replicate` with its port held by another process (a second replicator waiting on the lock):
    no server, no measurement, no exception (the replicator itself still runs); port 0: none at all."""
    import socket
    import threading

    from cli.region_commands import _serve_region_metrics
    from tapeline.settings import Settings

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = Settings(replicate_health_port=taken.getsockname()[1], health_host="127.0.0.1")
        stop = threading.Event()
        assert _serve_region_metrics(settings, settings.for_region("b"), stop, threading.Event()) is None
        assert not any(t.name == "tapeline-region-lag" for t in threading.enumerate())
    off = Settings(replicate_health_port=0)
    assert _serve_region_metrics(off, off.for_region("b"), threading.Event(), threading.Event()) is None

"""The lag report's totals and how a projector process publishes it (gauges, /health/deep)."""

from __future__ import annotations

from datetime import datetime, timezone

from tapeline.lag import LagReport, PartitionLag
from tapeline.health import HealthState

AT = datetime(2025, 1, 1, 12, 0, tzinfo=timezone.utc)
OLDEST = datetime(2025, 1, 1, 11, 59, 30, tzinfo=timezone.utc)
REPORT = LagReport(AT, [
    PartitionLag("t.jobs", 0, log_end=10, stored=10, offsets=0, events=0, seconds=0.0, oldest_unapplied_at=None),
    PartitionLag("t.jobs", 1, log_end=20, stored=14, offsets=6, events=5, seconds=30.0, oldest_unapplied_at=OLDEST),
    PartitionLag("t.uploads", 0, log_end=900, stored=100, offsets=800, events=800, seconds=12.5,
                 oldest_unapplied_at=OLDEST, exact=False),
])


def test_totals_sum_events_and_take_the_oldest_wait():
    assert (REPORT.events, REPORT.seconds, REPORT.exact) == (805, 30.0, False)
    doc = REPORT.as_dict()
    assert (doc["events"], doc["seconds"], doc["offsets"], doc["exact"]) == (805, 30.0, 806, False)
    assert [(p["topic"], p["partition"], p["events"], p["exact"]) for p in doc["partitions_behind"]] == \
        [("t.jobs", 1, 5, True), ("t.uploads", 0, 800, False)]
    assert doc["partitions_behind"][0]["oldest_unapplied_at"] == "2025-01-01T11:59:30+00:00"


def test_empty_report_is_zero_and_exact():
    empty = LagReport(AT, [])
    assert (empty.events, empty.seconds, empty.exact, empty.as_dict()["partitions_behind"]) == (0, 0.0, True, [])


def test_health_state_publishes_gauges_per_partition_and_the_deep_summary():
    health = HealthState("projector", "i1")
    assert health.deep()["projection_lag"] is None  # not measured yet
    health.set_projection_lag(REPORT)
    sample = health.registry.get_sample_value
    assert sample("tapeline_projection_lag_events", {"topic": "t.jobs", "partition": "1"}) == 5
    assert sample("tapeline_projection_lag_seconds", {"topic": "t.jobs", "partition": "1"}) == 30.0
    assert sample("tapeline_projection_lag_events", {"topic": "t.jobs", "partition": "0"}) == 0
    assert sample("tapeline_projection_lag_events", {"topic": "t.uploads", "partition": "0"}) == 800
    assert health.deep()["projection_lag"] == {"events": 805, "seconds": 30.0, "exact": False,
                                               "measured_at": "2025-01-01T12:00:00+00:00"}
    assert b"# TYPE tapeline_projection_lag_seconds gauge" in health.metrics()

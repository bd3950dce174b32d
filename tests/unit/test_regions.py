"""Region B's pure parts: the settings overlay (`Settings.for_region`), the mm2.properties rendering and
the lag arithmetic (`regions/mirror_lag.py`)."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

import pytest

from regions.mirror_lag import PartitionCount, RegionLag, partition_lag
from tapeline.settings import Settings
from regions.mirror import mirror_internal_topics, mm2_properties, mirrored_topics


def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("TAPELINE_"):
            monkeypatch.delenv(name)


def test_region_b_is_region_a_shifted_by_the_documented_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    a = Settings(home=Path("/srv/tl"))
    b = a.for_region("b")
    assert (b.region, b.kafka_bootstrap, b.kafka_controller_port) == ("b", "127.0.0.1:29092", 29093)
    assert b.database_url == "postgresql://tapeline:tapeline@127.0.0.1:5433/tapeline"
    assert b.s3_endpoint == "http://127.0.0.1:29000"
    assert b.home == Path("/srv/tl/region-b")
    assert b.kafka_jars == Path("/srv/tl/kafka/libs")  # region A's jars, not a second download
    assert b.kafka_brokers == 1
    replicated = Settings(kafka_brokers=3, topic_replication_factor=3, topic_min_insync_replicas=2).for_region("b")
    assert (replicated.kafka_brokers, replicated.replication_factor, replicated.min_insync_replicas) == (1, 1, 1)
    # Names are kept: the mirror keeps topic names, so region B's processors read the same ones.
    assert (b.all_topics(), b.app_name, b.s3_bucket) == (a.all_topics(), a.app_name, a.s3_bucket)
    assert a.for_region("a") is a
    assert a.region == "a" and a.kafka_bootstrap == "127.0.0.1:19092"  # region A is unchanged


def test_each_region_b_address_has_its_own_override(monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    monkeypatch.setenv("TAPELINE_REGION_B_KAFKA_BOOTSTRAP", "10.0.0.2:9092")
    monkeypatch.setenv("TAPELINE_REGION_B_KAFKA_CONTROLLER_PORT", "9093")
    monkeypatch.setenv("TAPELINE_REGION_B_DATABASE_URL", "postgresql://u:p@10.0.0.2:5432/tl")
    monkeypatch.setenv("TAPELINE_REGION_B_S3_ENDPOINT", "https://s3.b.example")
    monkeypatch.setenv("TAPELINE_REGION_B_HOME", "/var/lib/tl-b")
    b = Settings().for_region("b")
    assert (b.kafka_bootstrap, b.kafka_controller_port) == ("10.0.0.2:9092", 9093)
    assert (b.database_url, b.s3_endpoint, b.home) == ("postgresql://u:p@10.0.0.2:5432/tl", "https://s3.b.example",
                                                       Path("/var/lib/tl-b"))


def test_offsets_and_ports_follow_region_a(monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    a = Settings(kafka_bootstrap="localhost:9092,localhost:9094", kafka_controller_port=9093,
                 database_url="postgresql://me@db.local/jobs", s3_endpoint="http://minio", region_b_port_offset=100,
                 region_b_postgres_port=6543)
    b = a.for_region("b")
    assert (b.kafka_bootstrap, b.kafka_controller_port) == ("localhost:9192", 9193)
    assert b.database_url == "postgresql://me@db.local:6543/jobs"
    assert b.s3_endpoint == "http://minio:180"  # the scheme's default port + the offset


def test_regions_are_derived_from_region_a_only(monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    b = Settings().for_region("b")
    with pytest.raises(ValueError, match="derive regions from region A"):
        b.for_region("b")
    with pytest.raises(ValueError, match="unknown region"):
        Settings().for_region("c")
    with pytest.raises(ValueError, match="TAPELINE_REGION_B_DATABASE_URL"):
        Settings(database_url="host=127.0.0.1 dbname=tl").for_region("b")


def _java_properties(text: str) -> dict[str, str]:
    """The file as java.util.Properties reads these lines: `key = value`, `#` comments, `\\\\` -> `\\`."""
    values = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, _, value = line.partition("=")
        values[key.strip()] = re.sub(r"\\(.)", r"\1", value.strip())
    return values


def test_mm2_properties_mirror_every_contract_topic_a_to_b_committed_only(monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    a = Settings(topic_prefix="t1-x.y", app_name="tapeline-test-1")
    props = _java_properties(mm2_properties(a, a.for_region("b")))
    assert props["clusters"] == "a, b"
    assert (props["a.bootstrap.servers"], props["b.bootstrap.servers"]) == ("127.0.0.1:19092", "127.0.0.1:29092")
    assert (props["a->b.enabled"], props["b->a.enabled"]) == ("true", "false")
    assert props["replication.policy.class"] == "org.apache.kafka.connect.mirror.IdentityReplicationPolicy"
    assert props["a.consumer.isolation.level"] == "read_committed"
    assert props["sync.topic.configs.enabled"] == "false"  # B's topics keep B's own configs (LogAppendTime)
    assert props["offset-syncs.topic.location"] == "target"  # nothing is written into region A
    for name in ("replication.factor", "heartbeats.topic.replication.factor", "checkpoints.topic.replication.factor",
                 "offset-syncs.topic.replication.factor", "offset.storage.replication.factor",
                 "config.storage.replication.factor", "status.storage.replication.factor"):
        assert props[name] == "1"
    # MM2 reads `topics` as comma-separated regexes: each contract topic matches exactly, nothing else does.
    patterns = [re.compile(p.strip()) for p in props["a->b.topics"].split(",")]
    topics = mirrored_topics(a)
    assert {"t1-x.y.uploads", "t1-x.y.jobs", "t1-x.y.dlq", "t1-x.y.work.transcode.standard"} <= set(topics)
    assert topics == sorted(set(a.all_topics()) - {"t1-x.y.regions"})  # each region's epochs are its own
    for topic in topics:
        assert any(p.fullmatch(topic) for p in patterns), topic
    for stranger in ("t1-xXy.jobs", "t1-x.y.jobsX", "other.jobs", "t1-x.y.jobs.retry", "t1-x.y.regions"):
        assert not any(p.fullmatch(stranger) for p in patterns), stranger
    group = re.compile(props["a->b.groups"])
    assert group.fullmatch("tapeline-test-1.transcode") and not group.fullmatch("tapeline-test-10.transcode")


def test_mm2_properties_of_the_failback_mirror_b_to_a_take_aliases_and_direction_from_the_regions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _clean_env(monkeypatch)
    a = Settings(topic_prefix="t2", app_name="tapeline-test-2", kafka_brokers=3, topic_replication_factor=3,
                 topic_min_insync_replicas=2)
    b = a.for_region("b")
    props = _java_properties(mm2_properties(b, a))
    assert props["clusters"] == "b, a"
    assert (props["b.bootstrap.servers"], props["a.bootstrap.servers"]) == (b.kafka_bootstrap_servers,
                                                                            a.kafka_bootstrap_servers)
    assert (props["b->a.enabled"], props["a->b.enabled"]) == ("true", "false")
    assert "a->b.topics" not in props and "a.consumer.isolation.level" not in props
    assert props["b.consumer.isolation.level"] == "read_committed"  # B's aborted transactions never reach A
    assert props["a.producer.acks"] == "all"
    assert props["sync.topic.configs.enabled"] == "false"  # A's recreated topics keep A's own configs
    assert props["replication.factor"] == "3"  # the target's (region A runs three brokers here)
    patterns = [re.compile(p.strip()) for p in props["b->a.topics"].split(",")]
    assert all(any(p.fullmatch(t) for p in patterns) for t in mirrored_topics(b))
    assert not any(p.fullmatch("t2.regions") for p in patterns)  # the region epochs are never mirrored
    assert re.compile(props["b->a.groups"]).fullmatch("tapeline-test-2.publish")
    # What a rejoin deletes in A with its topics: the Connect and checkpoint topics of the flow from b.
    assert mirror_internal_topics("b") == ["mm2-offsets.b.internal", "mm2-status.b.internal",
                                           "mm2-configs.b.internal", "b.checkpoints.internal",
                                           "mm2-offset-syncs.b.internal"]
    with pytest.raises(ValueError):
        mm2_properties(a, a)


def _count(committed: int, span: int, in_b: int, newest: int | None = None, mirrored: int | None = None,
           counted: bool = True, topic: str = "t.jobs", partition: int = 0) -> PartitionCount:
    return PartitionCount(topic, partition, committed, span, in_b, newest, mirrored, counted)


def test_markers_and_aborted_records_in_a_are_not_events_behind() -> None:
    # One committed one-record transaction: A ends at offset 2 (record, marker), B at 1.
    assert partition_lag(_count(1, 2, 1, 5_000, 5_000)).events_behind == 0
    # Two committed records and an aborted transaction of three (3 records + 3 markers + 1 aborted marker).
    lag = partition_lag(_count(2, 9, 2, 9_000, 9_000))
    assert (lag.events_behind, lag.surplus_in_b, lag.seconds_behind, lag.exact) == (0, 0, 0.0, True)


def test_events_and_seconds_behind_are_counted_on_a_s_clock() -> None:
    lag = partition_lag(_count(10, 20, 7, newest=12_500, mirrored=10_000))
    assert (lag.events_behind, lag.seconds_behind) == (3, 2.5)
    nothing_yet = partition_lag(_count(4, 4, 0, newest=4_000, mirrored=1_000))
    assert (nothing_yet.events_behind, nothing_yet.seconds_behind) == (4, 3.0)
    twice = partition_lag(_count(5, 10, 7, newest=9_000, mirrored=None))
    assert (twice.events_behind, twice.surplus_in_b, twice.seconds_behind) == (0, 2, 0.0)


def test_a_partition_not_counted_reports_an_upper_bound() -> None:
    lag = partition_lag(_count(0, 1000, 400, counted=False))
    assert (lag.events_behind, lag.seconds_behind, lag.exact) == (600, None, False)


def test_totals_sum_events_and_take_the_largest_seconds() -> None:
    at = datetime(2026, 1, 1, tzinfo=timezone.utc)
    report = RegionLag(at, [partition_lag(_count(10, 12, 8, 5_000, 3_000, topic="t.jobs", partition=0)),
                            partition_lag(_count(3, 3, 3, 1_000, 1_000, topic="t.jobs", partition=1)),
                            partition_lag(_count(5, 5, 4, 9_000, 8_500, topic="t.uploads"))])
    assert (report.events_behind, report.seconds_behind, report.exact) == (3, 2.0, True)
    data = report.as_dict()
    assert data["topics"]["t.jobs"] == {"events_behind": 2, "surplus_in_b": 0, "seconds_behind": 2.0, "exact": True}
    assert data["topics"]["t.uploads"]["seconds_behind"] == 0.5
    assert "objects" not in data  # measured apart (regions/object_audit.py)
    unknown = RegionLag(at, [partition_lag(_count(0, 50, 0, counted=False))])
    assert (unknown.events_behind, unknown.seconds_behind, unknown.exact) == (50, None, False)
    assert RegionLag(at, []).as_totals() == {"events_behind": 0, "surplus_in_b": 0, "seconds_behind": 0.0,
                                             "exact": True}


def test_region_status_says_what_is_pending_and_why() -> None:
    from cli.region_commands import _objects_line

    up = {"up": True, "pid": 42, "log": "x"}
    line = _objects_line({"named": 5, "replicated": 3, "replicated_bytes": 900, "pending": 2, "pending_bytes": 70,
                          "pending_bytes_known": False, "oldest_pending_age_s": 12.5, "exact": True,
                          "pending_by_reason": {"sha256_mismatch": 1, "unread": 1}, "replicator": up})
    assert line == ("5 named by b's log, 3 replicated (900 bytes), 2 pending (70+ bytes; sha256_mismatch 1, unread 1; "
                    "oldest 12.5 s); replicator up (pid 42)")
    done = _objects_line({"named": 5, "replicated": 5, "replicated_bytes": 900, "pending": 0, "pending_bytes": 0,
                          "pending_bytes_known": True, "oldest_pending_age_s": None, "exact": False,
                          "pending_by_reason": {}, "replicator": {"up": False, "pid": None, "log": None}})
    assert done.startswith("5 named by b's log, 5 replicated (900 bytes), 0 pending (0 bytes) (log not read to its end")
    assert "replicator not running" in done
    assert _objects_line({"error": "ServiceUnavailable: no", "replicator": up}).startswith("not measured (")

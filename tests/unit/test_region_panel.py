"""The dashboard's Region replication panel (projections/region_panel.py): what it says when region B's
replicator does not answer, has not measured yet, or has measured (rows marked past their alert's
threshold, the thresholds being compose/alerts.yml's own); and that its source reads a real
replicator health server (tapeline/health.py) and says "not running" when nothing answers."""

from __future__ import annotations

import socket
from datetime import datetime, timedelta, timezone
from pathlib import Path

import yaml

from domain.replication import ObjectTotals
from projections import region_panel
from projections.region_panel import RegionPanelSource, panel
from tapeline.health import HealthServer, HealthState
from regions.mirror_lag import PartitionCount, RegionLag, partition_lag
from regions.monitor import RegionSample, region_section
from tapeline.settings import Settings

ALERTS = Path(__file__).resolve().parents[2] / "compose" / "alerts.yml"
NOW = datetime(2026, 12, 5, 12, 0, tzinfo=timezone.utc)
MS = int(NOW.timestamp() * 1000)


def section(behind: int = 2, seconds_s: int = 20, pending_age_s: float | None = None, heartbeat_age_s: float = 1.0,
            complete_age_s: float = 10.0, errors: tuple[str, ...] = ()) -> dict:
    count = PartitionCount("tapeline.jobs", 0, committed_a=10, span_a=12, records_b=10 - behind, newest_a_ms=MS,
                           mirrored_a_ms=MS - seconds_s * 1000)
    oldest = None if pending_age_s is None else NOW - timedelta(seconds=pending_age_s)
    totals = ObjectTotals(5, 4, 400, 1 if oldest else 0, 10, True, oldest, {"unread": 1} if oldest else {})
    sample = RegionSample(NOW - timedelta(seconds=complete_age_s), RegionLag(NOW, [partition_lag(count)]), totals, True,
                          NOW - timedelta(seconds=heartbeat_age_s), list(errors))
    return region_section(sample, NOW - timedelta(seconds=complete_age_s), 30.0)


def rows(view: dict) -> dict[str, tuple[str, bool]]:
    return {r["name"]: (r["value"], r["over"]) for r in view["rows"]}


def test_not_answering_says_region_b_is_not_running():
    view = panel(None, "Connection refused", "127.0.0.1:9490", NOW)
    assert view["state"] == "not_running" and view["rows"] == []
    assert view["text"].startswith("region B is not running (or its media replicator is not): no replicator answers "
                                   "at 127.0.0.1:9490 (Connection refused)")
    assert "tapeline stack up --region b" in view["text"]
    assert panel(region_section(None, None, 30.0), None, "a:1", NOW)["state"] == "not_measured"


def test_a_healthy_measurement_marks_nothing():
    view = panel(section(), None, "a:1", NOW)
    assert view["state"] == "measured"
    assert rows(view) == {"events behind": ("2", False), "seconds behind": ("20 s", False),
                          "objects pending": ("0", False), "objects replicated": ("4", False),
                          "mirror heartbeat": ("1 s ago", False),
                          "measured": ("2026-12-05 11:59:50 UTC (whole 10 s ago)", False)}
    assert view["text"] == "region B is behind region A within its alerts' thresholds"


def test_each_figure_past_its_alerts_threshold_is_marked():
    view = panel(section(behind=2, seconds_s=400, pending_age_s=2000, heartbeat_age_s=200, complete_age_s=400,
                         errors=("log lag not measured: x",)), None, "a:1", NOW)
    marked = {name for name, (_, over) in rows(view).items() if over}
    assert marked == {"seconds behind", "objects pending", "mirror heartbeat", "measured"}
    assert rows(view)["objects pending"] == ("1, oldest 2000 s", True)
    assert view["text"].startswith("past an alert's threshold: seconds behind, objects pending, mirror heartbeat")
    assert view["text"].endswith("not measured: log lag not measured: x")
    many = panel(section(behind=10), None, "a:1", NOW)  # 10 of 10 behind is not over 10,000
    assert rows(many)["events behind"] == ("10", False)


def test_the_thresholds_are_the_alerts():
    rules = {r["alert"]: r["expr"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
    assert f"> {region_panel.LAG_S:g}" in rules["TapelineRegionLagSeconds"]
    assert f"> {region_panel.LAG_EVENTS:g}" in rules["TapelineRegionLagEvents"]
    assert f"> {region_panel.PENDING_S:g}" in rules["TapelineRegionObjectsPendingTooLong"]
    assert f"> {region_panel.HEARTBEAT_S:g}" in rules["TapelineRegionMirrorHeartbeatStale"]
    assert f"> {region_panel.MEASURED_S:g}" in rules["TapelineRegionLagNotMeasured"]


def test_no_panel_without_a_replicator_port_or_without_a_mirrored_region_b():
    assert RegionPanelSource.for_settings(Settings(replicate_health_port=0)) is None
    assert RegionPanelSource.for_settings(Settings(region_b_mirror=False)) is None
    assert RegionPanelSource.for_settings(Settings(replicate_health_port=19490)).address == "127.0.0.1:19490"


def test_the_source_reads_a_replicator_health_server_and_says_when_none_answers():
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert RegionPanelSource(f"127.0.0.1:{port}").get(NOW)["state"] == "not_running"
    health = HealthState("replicator")
    server = HealthServer(health, "127.0.0.1", 0).start()
    try:
        source = RegionPanelSource(f"127.0.0.1:{server.port}", cache_s=0.0)
        view = source.get(NOW)
        assert view["state"] == "not_running" and "is not the media replicator" in view["text"]  # a processor's port
        health.set_section("region_replication", section())
        assert rows(source.get(NOW))["events behind"] == ("2", False)
    finally:
        server.stop()


def test_a_one_region_install_is_no_alarm(tmp_path):
    """Issue 45: the overview of a one-region install showed "region B is not running" in red on every
    visit. With nothing of region B set up and nothing answering, the panel is one neutral line."""
    view = panel(None, "Connection refused", "127.0.0.1:9490", NOW, set_up=False)
    assert view["state"] == "one_region" and view["rows"] == []
    assert view["text"].startswith("one region: no region B is set up") and "not running" not in view["text"]
    assert panel(section(), None, "a:1", NOW, set_up=False)["state"] == "measured"  # an answer is shown all the same
    alone = Settings(home=tmp_path / "a")
    assert not region_panel.region_b_set_up(alone)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    source = RegionPanelSource.for_settings(alone.model_copy(update={"replicate_health_port": port}))
    assert source.get(NOW)["state"] == "one_region"
    (tmp_path / "a" / "region-b").mkdir(parents=True)
    (tmp_path / "a" / "region-b" / "stack.json").write_text("{}")  # `tapeline stack up --region b` ran here
    assert region_panel.region_b_set_up(alone)
    assert RegionPanelSource.for_settings(alone.model_copy(update={"replicate_health_port": port})).get(NOW)["state"] \
        == "not_running"
    assert region_panel.region_b_set_up(Settings(home=tmp_path / "c", region_b_database_url="postgresql://b:5433/x"))

"""The local monitoring's generated configuration (devstack/monitoring.py): `promtool check
config` accepts the Prometheus configuration `stack up --with-monitoring` writes (with the shipped rules
and the file_sd target list), and the targets follow the supervisor's health ports."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from tapeline.settings import Settings
from devstack.monitoring import ALERT_RULES, prometheus_config, scrape_targets
from cli.supervisor import ROLES


def test_the_written_configuration_passes_promtool(tmp_path: Path):
    settings = Settings(home=tmp_path, monitoring_interval_s=1.0, health_port_base=19400, serve_port=18400,
                        publish_workers=2)
    targets = tmp_path / "targets.json"
    targets.write_text(json.dumps(scrape_targets(settings)))
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps(prometheus_config(settings, targets)))
    binary = shutil.which("promtool")
    assert binary, "promtool is missing: `apt-get install -y prometheus` (scripts/bootstrap.sh installs it)"
    checked = subprocess.run([binary, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 20 rules found" in checked.stdout + checked.stderr, checked.stdout + checked.stderr
    body = json.loads(config.read_text())
    assert body["rule_files"] == [str(ALERT_RULES)]
    assert body["global"]["evaluation_interval"] == "1000ms"
    assert body["global"]["external_labels"] == {"tapeline_dashboard": f"http://{settings.serve_host}:{settings.serve_port}"}
    assert body["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == [f"127.0.0.1:{settings.alertmanager_port}"]


def test_a_rules_file_setting_replaces_the_shipped_rules(tmp_path):
    own = tmp_path / "team-alerts.yml"
    assert prometheus_config(Settings(alert_rules_file=str(own)), tmp_path / "t.json")["rule_files"] == [str(own)]
    assert prometheus_config(Settings(), tmp_path / "t.json")["rule_files"] == [str(ALERT_RULES)]


def test_targets_are_the_supervisor_health_ports_and_the_api():
    settings = Settings(health_port_base=19400, serve_port=18400, transcode_workers=2, publish_workers=2)
    groups = scrape_targets(settings)
    roles = {g["labels"].get("role"): g["targets"][0] for g in groups if g["labels"]["job"] == "tapeline-processors"}
    assert roles == {**{role: f"127.0.0.1:{19400 + i}" for i, role in enumerate(ROLES)},
                     "transcode#2": f"127.0.0.1:{19400 + len(ROLES)}", "publish#2": f"127.0.0.1:{19401 + len(ROLES)}"}
    assert [g["targets"] for g in groups if g["labels"]["job"] == "tapeline-api"] == [["127.0.0.1:18400"]]
    # Without a base the README's 9400 (what `TAPELINE_HEALTH_PORT_BASE=9400 tapeline run` serves).
    assert scrape_targets(Settings(health_port_base=0))[0]["targets"] == ["127.0.0.1:9400"]



def test_region_b_replicator_is_scraped_at_its_health_port_unless_off(tmp_path):
    def replicator(**values) -> list[list[str]]:
        settings = Settings(**{"region_b_home": tmp_path, **values})  # region B set up here (its home exists)
        return [g["targets"] for g in scrape_targets(settings) if g["labels"]["job"] == "tapeline-region-replicator"]

    assert replicator() == [["127.0.0.1:9490"]]
    assert replicator(replicate_health_port=19490, health_host="0.0.0.0") == [["127.0.0.1:19490"]]
    assert replicator(replicate_health_port=19490, health_host="10.0.0.5") == [["10.0.0.5:19490"]]
    assert replicator(replicate_health_port=0) == []  # no server: nothing to scrape
    assert replicator(region_b_mirror=False) == []  # region B independent: no replicator runs
    assert replicator(region_b_home=tmp_path / "never-set-up") == []  # no region B on this machine: its alert would fire

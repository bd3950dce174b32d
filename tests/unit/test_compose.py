"""docker-compose.yml with Prometheus and Grafana (issue 8, item 7), checked without a Docker engine:
`docker-compose config` (Debian's docker-compose 1.29 validates offline), and the files it mounts
agree with the code (scrape targets = the supervisor's health ports, Grafana's SQL reads only
relations the migrations create, every panel names a provisioned data source)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tapeline.settings import Settings
from cli.supervisor import ROLES

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DASHBOARD = ROOT / "compose" / "grafana" / "dashboards" / "tapeline.json"


def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_docker_compose_config_accepts_the_file():
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is missing: `apt-get install -y docker-compose` (scripts/bootstrap.sh installs it)"
    done = subprocess.run([binary, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_prometheus_scrapes_every_processor_child_and_the_api():
    found = services()
    env = found["tapeline"]["environment"]
    base = int(env["TAPELINE_HEALTH_PORT_BASE"])
    assert env["TAPELINE_HEALTH_HOST"] == "0.0.0.0"  # reachable from the prometheus container
    config = yaml.safe_load((ROOT / "compose" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert jobs["tapeline-processors"] == [f"tapeline:{base + i}" for i in range(len(ROLES))]
    serve = found["tapeline-serve"]["command"]
    assert jobs["tapeline-api"] == [f"tapeline-serve:{serve[serve.index('--port') + 1]}"]
    # region B's replicator is not a service of docker-compose.yml: not scraped (its down alert would fire)
    assert "tapeline-region-replicator" not in jobs


def test_every_bind_mount_exists_in_the_repository():
    mounts = [(name, volume.split(":")[0]) for name, service in services().items()
              for volume in service.get("volumes", []) if volume.startswith("./")]
    assert {name for name, _ in mounts} == {"postgres", "prometheus", "grafana", "alertmanager"}
    for name, source in mounts:
        assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"


def test_grafana_panels_use_provisioned_sources_and_existing_relations():
    datasources = yaml.safe_load((ROOT / "compose/grafana/provisioning/datasources/tapeline.yml").read_text())
    uids = {d["uid"] for d in datasources["datasources"]}
    dashboard = json.loads(DASHBOARD.read_text())
    migrations = "\n".join(p.read_text() for p in sorted((ROOT / "projections/sql/migrations").glob("*.sql")))
    created = set(re.findall(r"CREATE (?:TABLE|VIEW) (\w+)", migrations))
    titles = [p["title"] for p in dashboard["panels"]]
    assert {"Jobs by state", "Stalled now", "Stage durations (completed stages in range)", "Dead letters"} <= set(titles)
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] in uids, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == panel["datasource"]["uid"]
            if "rawSql" in target:
                relations = set(re.findall(r"\bFROM (\w+)", target["rawSql"]))
                assert relations and relations <= created, (panel["title"], relations - created)


def grafana_sql() -> list[tuple[str, str]]:
    """(panel title, SQL) of every PostgreSQL panel, Grafana's time macro expanded to the last 6 hours
    (for tests/integration/test_grafana_queries.py)."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], re.sub(r"\$__timeFilter\((\w+)\)", r"\1 > now() - interval '6 hours'", t["rawSql"]))
            for panel in dashboard["panels"] for t in panel["targets"] if "rawSql" in t]


def test_the_three_broker_override_makes_one_replicated_cluster():
    """docker-compose.brokers3.yml (issue 24 item 1): three KRaft nodes in one quorum, production's
    replication, and every Tapeline service bootstrapping from all three."""
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is missing: `apt-get install -y docker-compose` (scripts/bootstrap.sh installs it)"
    done = subprocess.run([binary, "-f", str(COMPOSE), "-f", str(ROOT / "docker-compose.brokers3.yml"), "config"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    merged = yaml.safe_load(done.stdout)["services"]
    nodes = {name: merged[name]["environment"] for name in ("kafka", "kafka-2", "kafka-3")}
    assert {str(env["KAFKA_NODE_ID"]) for env in nodes.values()} == {"1", "2", "3"}
    assert {env["KAFKA_CONTROLLER_QUORUM_VOTERS"] for env in nodes.values()} == {"1@kafka:9093,2@kafka-2:9093,3@kafka-3:9093"}
    assert len({env["CLUSTER_ID"] for env in nodes.values()}) == 1
    for env in nodes.values():
        assert (str(env["KAFKA_DEFAULT_REPLICATION_FACTOR"]), str(env["KAFKA_MIN_INSYNC_REPLICAS"]),
                str(env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"])) == ("3", "2", "2")
    for name in ("tapeline-init", "tapeline", "tapeline-serve"):
        env = merged[name]["environment"]
        assert env["TAPELINE_KAFKA_BOOTSTRAP"] == "kafka:9092,kafka-2:9092,kafka-3:9092", name
        assert str(env["TAPELINE_TOPIC_REPLICATION_FACTOR"]) == "3" and "TAPELINE_DATABASE_URL" in env, name

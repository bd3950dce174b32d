"""Alerts fire for real (issue 23 item 3): `tapeline stack up --with-monitoring` starts Debian's
Prometheus and Alertmanager, a record the projector cannot read becomes a dead letter, the API's
/metrics reports it pending, Prometheus evaluates the rule TapelineDeadLettersPending of
compose/alerts.yml and Alertmanager's API lists the alert firing; and a real job whose transcode no
worker claims (a handoff stall) fires TapelineHandoffStalled.

The rules are the shipped ones with one change: the `for:` of the rule under test is shortened
(written to a copy that `TAPELINE_ALERT_RULES_FILE` names), so the suite does not wait the shipped
1 and 5 minutes; that each rule holds for its shipped `for:` before it fires is proved by promtool
(compose/prometheus-tests/alerts_test.yml, tests/unit/test_alert_rules.py). Here what is proved is
the path: real metrics from real processes, scraped, evaluated, and routed to Alertmanager, with the
shipped labels, annotations and dashboard links, and not before the (shortened) `for:` has passed.

The scrape and evaluation interval is shortened too (TAPELINE_MONITORING_INTERVAL_S=5 s instead of
15 s; not less: a scrape of the API's /metrics takes over a second on a busy 2-core machine, and a
scrape that times out makes the series stale, which restarts the rule's `for:`). Prometheus,
Alertmanager, the projector and `tapeline serve` are real processes; the services are the shared
Kafka and PostgreSQL (`stack up` reuses them and, with its own home directory, stops only what it
started).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from devstack.monitoring import ALERT_RULES

from tapeline.samples import sample_video
from tests.conftest import settings_env, wait_for
from tests.integration.helpers import free_ports
from tests.integration.test_dead_letters import produce_raw

pytestmark = pytest.mark.integration

ALERT = "TapelineDeadLettersPending"


def free_port() -> int:
    return free_ports(1)[0]


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def metric(base: str, name: str) -> float | None:
    """One unlabelled sample of the API's /metrics, or None while it is not there."""
    for line in httpx.get(f"{base}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def rules_holding_for(tmp_path, alert: str, seconds: int) -> str:
    """A copy of the shipped rules in which `alert` holds for `seconds` instead of its shipped `for:`
    (nothing else changed); the copy's path, for TAPELINE_ALERT_RULES_FILE."""
    body = yaml.safe_load(ALERT_RULES.read_text())
    rule = next(r for g in body["groups"] for r in g["rules"] if r.get("alert") == alert)
    assert "for" in rule, f"{alert} has no for: to shorten"
    rule["for"] = f"{seconds}s"
    copy = tmp_path / "alerts.yml"
    copy.write_text(yaml.safe_dump(body, sort_keys=False))
    return str(copy)


DEAD_LETTER_FOR_S = 20
HANDOFF_FOR_S = 30


def test_a_dead_letter_fires_its_alert_in_alertmanager(isolated, tmp_path):
    settings = isolated
    prometheus, alertmanager, api, health = free_port(), free_port(), free_port(), free_port()
    env = {**settings_env(settings), "TAPELINE_HOME": str(tmp_path / "home"), "TAPELINE_MONITORING_INTERVAL_S": "5",
           "TAPELINE_PROMETHEUS_PORT": str(prometheus), "TAPELINE_ALERTMANAGER_PORT": str(alertmanager),
           "TAPELINE_SERVE_PORT": str(api), "TAPELINE_HEALTH_PORT_BASE": str(health),
           "TAPELINE_ALERT_RULES_FILE": rules_holding_for(tmp_path, ALERT, DEAD_LETTER_FOR_S)}
    started = time.monotonic()
    up = cli(env, "stack", "up", "--with-monitoring")
    assert up.returncode == 0, up.stdout + up.stderr
    processes = []
    try:
        status = json.loads(cli(env, "stack", "status", "--json").stdout)
        for name, port in (("prometheus", prometheus), ("alertmanager", alertmanager)):
            assert status[name]["up"] and status[name]["started_by_stack"], status[name]
            assert status[name]["address"] == f"http://127.0.0.1:{port}/"

        # The projector is the processor at the base port (supervisor.ROLES[0]); the API serves /metrics.
        for name, args, extra in (("projector", ["run", "--role", "projector"], {"TAPELINE_HEALTH_PORT": str(health)}),
                                  ("serve", ["serve"], {})):
            log = open(tmp_path / f"{name}.log", "ab")
            processes.append((name, log, subprocess.Popen([sys.executable, "-m", "cli.main", *args],
                                                          env={**env, **extra}, stdout=log, stderr=log,
                                                          start_new_session=True)))
        base = f"http://127.0.0.1:{api}"

        def api_ready():
            try:
                return metric(base, "tapeline_dead_letters_pending") == 0.0
            except httpx.HTTPError:
                return False
        wait_for(api_ready, 60, "tapeline serve's /metrics with no dead letter pending")

        # Prometheus scrapes both for real: the targets the stack wrote are up.
        def scraped():
            targets = httpx.get(f"http://127.0.0.1:{prometheus}/api/v1/targets", timeout=5).json()["data"]
            up_now = {t["scrapeUrl"] for t in targets["activeTargets"] if t["health"] == "up"}
            return {f"http://127.0.0.1:{api}/metrics", f"http://127.0.0.1:{health}/metrics"} <= up_now
        wait_for(scraped, 30, "Prometheus scraping the API and the projector")

        # The condition, for real: a record on the lifecycle topic that is not an event.
        produce_raw(settings, settings.jobs_topic, b"poison-alert", b"not avro at all")
        wait_for(lambda: metric(base, "tapeline_dead_letters_pending") == 1.0, 30, "the dead letter pending in /metrics")
        appeared = time.monotonic()
        assert not firing(alertmanager), "nothing fires before the rule's `for:` has passed"

        try:
            alert = wait_for(lambda: firing(alertmanager), 90, f"{ALERT} in Alertmanager's /api/v2/alerts",
                             interval_s=1.0)
        except BaseException:
            for what in ("alerts", "targets"):  # why not: the rule's state and the scrapes' errors
                print(what, httpx.get(f"http://127.0.0.1:{prometheus}/api/v1/{what}", timeout=5).text[:3000])
            raise
        waited = time.monotonic() - appeared
        assert waited >= DEAD_LETTER_FOR_S - 5, f"the rule's for: was honoured (fired {waited:.0f} s after the dead letter)"
        assert alert["labels"]["severity"] == "warning"
        assert alert["annotations"]["summary"] == "1 dead letter(s) waiting for an operator"
        assert alert["annotations"]["dashboard"] == f"{base}/dead-letters"  # a link to tapeline serve's page
        assert alert["status"]["state"] == "active"
        print(f"{ALERT} fired {waited:.0f} s after the dead letter appeared, {time.monotonic() - started:.0f} s in all")
    finally:
        for name, log, proc in processes:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
            print(f"--- {name}\n" + (tmp_path / f"{name}.log").read_text(errors="replace")[-2000:])
        down = cli(env, "stack", "down")
        print(down.stdout + down.stderr)
    assert "prometheus: stopping pid" in down.stderr and "alertmanager: stopping pid" in down.stderr, down.stderr
    assert "kafka: not started by the stack; leaving it alone" in down.stderr  # the shared services stay up


def firing(port: int) -> dict | None:
    """The active TapelineDeadLettersPending alert Alertmanager holds, or None."""
    alerts = httpx.get(f"http://127.0.0.1:{port}/api/v2/alerts", params={"active": "true"}, timeout=5).json()
    return next((a for a in alerts if a["labels"].get("alertname") == ALERT), None)


HANDOFF = "TapelineHandoffStalled"


def test_a_stalled_real_job_fires_its_alert_in_alertmanager(isolated, tmp_path):
    """A real job stalls: intake accepts it and queues its transcode, but no transcode worker runs. The
    real watchdog (ticking the log clock) sees the handoff stall and re-sends the work item, the
    API's /metrics reports `tapeline_stalls{kind="handoff"}`, the dashboard's strip links the job at
    once, and after the rule's (shortened) `for:` Alertmanager's API lists TapelineHandoffStalled
    firing, with a link to the Stalled page."""
    settings = isolated.model_copy(update={"handoff_timeout_s": 10.0, "tick_interval_s": 1.0})
    prometheus, alertmanager, api = free_port(), free_port(), free_port()
    env = {**settings_env(settings), "TAPELINE_HOME": str(tmp_path / "home"), "TAPELINE_MONITORING_INTERVAL_S": "5",
           "TAPELINE_PROMETHEUS_PORT": str(prometheus), "TAPELINE_ALERTMANAGER_PORT": str(alertmanager),
           "TAPELINE_SERVE_PORT": str(api),
           "TAPELINE_ALERT_RULES_FILE": rules_holding_for(tmp_path, HANDOFF, HANDOFF_FOR_S)}
    up = cli(env, "stack", "up", "--with-monitoring")
    assert up.returncode == 0, up.stdout + up.stderr
    processes = []
    try:
        for name, args in (("projector", ["run", "--role", "projector"]), ("intake", ["run", "--role", "intake"]),
                           ("watchdog", ["run", "--role", "watchdog"]), ("serve", ["serve"])):
            log = open(tmp_path / f"{name}.log", "ab")
            processes.append((name, log, subprocess.Popen([sys.executable, "-m", "cli.main", *args], env=env,
                                                          stdout=log, stderr=log, start_new_session=True)))
        base = f"http://127.0.0.1:{api}"
        submitted = cli(env, "submit", str(sample_video("carphone_pristine.mp4")), "--json")
        assert submitted.returncode == 0, submitted.stderr
        job_id = json.loads(submitted.stdout)["job_id"]

        def handoffs() -> float | None:
            try:
                for line in httpx.get(f"{base}/metrics", timeout=5).text.splitlines():
                    if line.startswith('tapeline_stalls{kind="handoff"}'):
                        return float(line.split()[1])
            except httpx.HTTPError:
                return None
            return None
        wait_for(lambda: (handoffs() or 0) >= 1, 120, "the job's handoff stall in the API's /metrics")
        appeared = time.monotonic()
        strip = {p["kind"]: p for p in httpx.get(f"{base}/api/problems", timeout=10).json()["problems"]}
        assert {"job_id": job_id, "href": f"/jobs/{job_id}"} in strip["stalled_handoffs"]["jobs"], strip

        def fired():
            alerts = httpx.get(f"http://127.0.0.1:{alertmanager}/api/v2/alerts", params={"active": "true"},
                               timeout=5).json()
            return next((a for a in alerts if a["labels"].get("alertname") == HANDOFF), None)
        assert not fired(), "nothing fires before the rule's `for:` has passed"
        alert = wait_for(fired, 120, f"{HANDOFF} in Alertmanager's /api/v2/alerts", interval_s=1.0)
        waited = time.monotonic() - appeared
        assert waited >= HANDOFF_FOR_S - 5, f"the rule's for: was honoured (fired {waited:.0f} s after the stall)"
        assert alert["annotations"]["summary"] == "1 queued stage(s) nobody claimed for 5 minutes"
        assert alert["annotations"]["dashboard"] == f"{base}/stalled"
        events = json.loads(cli(env, "timeline", job_id, "--json").stdout)
        assert any(e["event_type"] == "StallDetected" for e in events), "the watchdog saw the stall and re-sent"
        print(f"{HANDOFF} fired {waited:.0f} s after the stall appeared")
    finally:
        for name, log, proc in processes:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
            print(f"--- {name}\n" + (tmp_path / f"{name}.log").read_text(errors="replace")[-1500:])
        print(cli(env, "stack", "down").stderr)

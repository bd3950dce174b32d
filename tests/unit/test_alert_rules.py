"""The operations alerts (issue 23 item 3, the rules): `compose/alerts.yml` passes `promtool check
rules`, its unit tests (`compose/prometheus-tests/alerts_test.yml`) pass `promtool test rules`, every
metric a rule reads is one Tapeline exports, every alert has a test, and every runbook link names a
section of docs/operating.md. promtool comes with Debian's `prometheus` package (scripts/bootstrap.sh)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "compose" / "alerts.yml"
RULE_TESTS = ROOT / "compose" / "prometheus-tests" / "alerts_test.yml"
EXPORTERS = ("tapeline/health.py", "projections/api.py", "regions/monitor.py")


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    assert binary, "promtool is missing: `apt-get install -y prometheus` (scripts/bootstrap.sh installs it)"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_the_rules_are_valid_and_their_unit_tests_pass():
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0 and f"SUCCESS: {len(rules())} rules found" in checked.stdout, checked.stdout + checked.stderr
    tested = promtool("test", "rules", str(RULE_TESTS))
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_every_alert_is_tested_reads_exported_metrics_and_links_a_runbook_section():
    exported = "\n".join((ROOT / path).read_text() for path in EXPORTERS)
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    tested = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    guide = (ROOT / "docs" / "operating.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", guide, re.M)}
    for rule in rules():
        name = rule["alert"]
        assert name in tested, f"{name} has no promtool test that makes it fire"
        for metric in set(re.findall(r"\btapeline_[a-z_]+", rule["expr"])):
            base = metric.removesuffix("_total")
            assert f'"{base}"' in exported, f"{name} reads {metric}, which no Tapeline process exports"
        runbook = rule["annotations"]["runbook"]
        assert runbook.startswith("docs/operating.md#") and runbook.split("#", 1)[1] in anchors, (name, runbook)
        assert rule["annotations"]["summary"] and rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["dashboard"].startswith("{{ $externalLabels.tapeline_dashboard }}/"), name

"""The dashboard's active problems decided from facts (projections/problems.py, pure)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import yaml

from projections.problems import ALERT_LINES, JOB_LINKS, LAG_S, STORAGE_NEAR, active_problems

ALERTS = Path(__file__).resolve().parents[2] / "compose" / "alerts.yml"

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=timezone.utc)


def stall(kind: str, job: str) -> dict:
    return {"kind": kind, "job_id": job}


def decide(stalls=(), pending=0, letters=(), providers=(), clock=NOW, tick_s=5.0):
    return {p.kind: p for p in active_problems(list(stalls), pending, list(letters), list(providers), clock, NOW, tick_s)}


def test_all_well_is_an_empty_strip_and_waits_by_design_are_not_problems():
    assert decide(stalls=[stall("waiting", "j1"), stall("needs_review", "j2")]) == {}


def test_each_condition_is_one_line_with_its_count_words_and_links():
    found = decide(stalls=[stall("lease_expired", "a"), stall("no_progress", "b"), stall("worker_exited", "a"),
                           stall("handoff", "h"), stall("expected_work_missing", "m")],
                   pending=7, letters=[{"job_id": f"d{i}"} for i in range(7)] + [{"job_id": None}],
                   providers=[{"provider": "webhook", "state": "open"}, {"provider": "s3", "state": "closed"}])
    assert list(found) == ["stalled_attempts", "dead_letters", "stalled_handoffs", "expected_work_missing",
                           "providers_open"]
    attempts = found["stalled_attempts"]
    assert (attempts.count, attempts.href, attempts.jobs) == (3, "/stalled", ("a", "b"))
    assert attempts.text.startswith("3 attempts have stalled")
    letters = found["dead_letters"]
    assert (letters.count, letters.href, len(letters.jobs)) == (7, "/dead-letters", JOB_LINKS)
    assert letters.job_links[0] == ("d0", "/jobs/d0")
    assert found["stalled_handoffs"].text == "1 queued stage not picked up by any worker in time"
    assert found["expected_work_missing"].jobs == ("m",)
    breaker = found["providers_open"]
    assert breaker.count == 1 and "(webhook)" in breaker.text and breaker.href == "/jobs?stage=publish"


def test_the_watchdog_line_after_four_ticks_but_never_under_twenty_seconds():
    assert "watchdog_not_ticking" not in decide(clock=NOW - timedelta(seconds=19), tick_s=1.0)
    assert "watchdog_not_ticking" in decide(clock=NOW - timedelta(seconds=21), tick_s=1.0)
    assert "watchdog_not_ticking" not in decide(clock=NOW - timedelta(seconds=39), tick_s=10.0)
    line = decide(clock=NOW - timedelta(seconds=41), tick_s=10.0)["watchdog_not_ticking"]
    assert line.text.startswith("the log clock has not moved for 41 s")
    assert decide(clock=None)["watchdog_not_ticking"].text.startswith("no watchdog tick has reached the log yet")


def test_storage_near_and_at_its_limit():
    assert decide_with(storage=(899, 1000)) == {}
    near = decide_with(storage=(900, 1000))["storage_near_limit"]
    assert near.text.startswith("object storage is at 90 % of its budget (900 of 1000 bytes)") and near.href == "/"
    full = decide_with(storage=(1200, 1000))
    assert "storage_near_limit" not in full and "new uploads are refused (507)" in full["storage_full"].text


def test_projection_lag_over_a_minute():
    assert decide_with(lag_s=60.0) == {}
    assert decide_with(lag_s=61.0)["projection_lagging"].text.startswith("the projections are 61 s behind the log")


def test_failing_and_disabled_webhook_endpoints_link_their_jobs():
    since = NOW - timedelta(minutes=3)
    found = decide_with(endpoints=[
        {"endpoint_id": "ep_a", "submitter": "alice", "enabled": True, "failing_since": since, "jobs": ["j1", "j2"]},
        {"endpoint_id": "ep_b", "submitter": "bob", "enabled": True, "failing_since": since, "jobs": ["j2", "j3"]},
        {"endpoint_id": "ep_c", "submitter": "carol", "enabled": False, "failing_since": since, "jobs": []}])
    failing, disabled = found["webhook_endpoints_failing"], found["webhook_endpoints_disabled"]
    assert (failing.count, failing.jobs, failing.href) == (2, ("j1", "j2", "j3"), "/webhooks")
    assert failing.text.startswith("2 customer webhook endpoints are failing every delivery (ep_a of alice, ep_b of bob)")
    assert (disabled.count, disabled.jobs) == (1, ())
    assert "disabled after failing for too long (ep_c of carol)" in disabled.text and "webhooks enable" in disabled.text


def test_every_alert_has_its_line_or_a_reason_and_the_thresholds_are_the_alerts():
    rules = {r["alert"]: r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
    assert set(rules) == set(ALERT_LINES), "an alert without a problems-strip line (or a reason) in ALERT_LINES"
    assert f">= {STORAGE_NEAR}" in rules["TapelineStorageNearLimit"]["expr"]
    assert f"> {LAG_S:g}" in rules["TapelineProjectionLagging"]["expr"]
    # each line the mapping names is one active_problems can show
    everything = decide_with(
        stalls=[stall(k, "j") for k in ("lease_expired", "handoff", "expected_work_missing")], pending=1,
        providers=[{"provider": "webhook", "state": "open"}], clock=None, lag_s=61.0, storage=(1, 1),
        endpoints=[{"endpoint_id": "e", "submitter": "s", "enabled": on, "failing_since": NOW, "jobs": []}
                   for on in (True, False)])
    shown = set(everything) | {"storage_near_limit"}  # full and near are one line at a time
    assert {line for line in ALERT_LINES.values() if line} <= shown, set(ALERT_LINES.values()) - shown


def decide_with(stalls=(), pending=0, letters=(), providers=(), clock=NOW, tick_s=5.0, **more):
    return {p.kind: p for p in active_problems(list(stalls), pending, list(letters), list(providers), clock, NOW,
                                               tick_s, **more)}

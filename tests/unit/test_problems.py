"""The dashboard's active problems decided from facts (projections/problems.py, pure)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from projections.problems import JOB_LINKS, active_problems

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

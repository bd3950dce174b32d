"""The pure circuit breaker and quota windows (domain/policy/breaker.py)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from domain.policy.breaker import Breaker, BreakerPolicy, admit, on_abandoned, on_failure, on_success, quota_wait

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
POLICY = BreakerPolicy(base_cooldown_s=5.0, max_cooldown_s=60.0, probe_timeout_s=20.0)


def s(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def fail(breaker: Breaker, job: str, at: float, status: int | None = 503, retry_after: float | None = None) -> Breaker:
    changed = on_failure(breaker, job, s(at), POLICY, http_status=status, retry_after_s=retry_after, detail="boom")
    assert changed is not None
    return changed


def test_closed_admits_every_post_and_a_success_changes_nothing():
    assert admit(Breaker(), "a", T0, POLICY).decision == "post"
    assert on_success(Breaker(), "a") is None


def test_a_429_opens_for_exactly_its_retry_after():
    opened = fail(Breaker(), "a", 0, status=429, retry_after=2.0)
    assert (opened.state, opened.until, opened.failures, opened.version, opened.http_status) == \
        ("open", s(2), 1, 1, 429)
    assert opened.reason == "post failed: boom"
    waiting = admit(opened, "b", s(1.999), POLICY)
    assert (waiting.decision, waiting.until, waiting.change) == ("wait", s(2), None)


def test_5xx_cooldowns_double_per_consecutive_failure_up_to_the_cap():
    assert [POLICY.cooldown_s(n, None) for n in (1, 2, 3, 4, 5, 6)] == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0]
    assert POLICY.cooldown_s(3, 0.5) == 0.5  # Retry-After wins, even when shorter


def test_after_the_cooldown_one_probe_then_others_wait_for_it():
    opened = fail(Breaker(), "a", 0)
    probe = admit(opened, "b", s(5), POLICY)
    assert probe.decision == "probe"
    half = probe.change
    assert (half.state, half.probe_job, half.until, half.version, half.failures) == ("half_open", "b", s(25), 2, 1)
    other = admit(half, "c", s(6), POLICY)
    assert (other.decision, other.until, other.change) == ("wait", s(25), None)
    again = admit(half, "b", s(7), POLICY)  # the probe's own retry stays the probe
    assert (again.decision, again.change) == ("probe", None)


def test_the_probes_success_closes_and_resets_failures():
    half = admit(fail(Breaker(), "a", 0), "b", s(5), POLICY).change
    closed = on_success(half, "b")
    assert (closed.state, closed.until, closed.failures, closed.probe_job, closed.version) == ("closed", None, 0, None, 3)
    assert on_success(half, "c") is None  # a late success of an older post does not close it


def test_the_probes_failure_reopens_with_a_longer_cooldown():
    half = admit(fail(Breaker(), "a", 0), "b", s(5), POLICY).change
    reopened = fail(half, "b", 6)
    assert (reopened.state, reopened.until, reopened.failures, reopened.probe_job) == ("open", s(16), 2, None)
    assert reopened.reason.startswith("probe failed")
    twice = fail(admit(reopened, "c", s(16), POLICY).change, "c", 17)
    assert (twice.until, twice.failures) == (s(37), 3)


def test_a_lapsed_probe_is_taken_over():
    half = admit(fail(Breaker(), "a", 0), "b", s(5), POLICY).change
    takeover = admit(half, "c", s(25), POLICY)
    assert takeover.decision == "probe"
    assert (takeover.change.probe_job, takeover.change.until, takeover.change.version) == ("c", s(45), 3)


def test_late_failures_while_open_only_extend_the_cooldown():
    opened = fail(Breaker(), "a", 0, status=429, retry_after=10.0)
    assert on_failure(opened, "b", s(1), POLICY, http_status=503, retry_after_s=None, detail="x") is None  # ends s(6)
    longer = fail(opened, "b", 1, status=429, retry_after=30.0)
    assert (longer.state, longer.until, longer.failures, longer.version) == ("open", s(31), 1, 2)


def test_no_answer_counts_as_a_failure():
    opened = fail(Breaker(), "a", 0, status=None)
    assert (opened.state, opened.http_status, opened.until) == ("open", None, s(5))


@pytest.mark.parametrize("window_s", [5.0, 60.0])
def test_quota_counts_posts_until_a_window_after_they_ended(window_s):
    ends = [s(0), s(1)]
    full = quota_wait(ends, s(2), [("minute", window_s, 2)])
    assert (full.window, full.limit, full.used, full.until) == ("minute", 2, 2, s(window_s))
    assert quota_wait(ends, s(window_s), [("minute", window_s, 2)]) is None  # the first left the window
    assert quota_wait(ends, s(2), [("minute", window_s, 3)]) is None


def test_quota_takes_the_window_that_frees_last_and_skips_unset_limits():
    ends = [s(0), s(10), s(20)]
    wait = quota_wait(ends, s(21), [("minute", 30.0, 3), ("day", 100.0, 2), ("none", 5.0, None)])
    assert (wait.window, wait.used, wait.until) == ("day", 3, s(110))  # the 2nd oldest of 3 frees the day window
    assert quota_wait(ends, s(21), [("minute", 30.0, None)]) is None


def test_a_zero_quota_never_admits():
    assert quota_wait([], T0, [("day", 60.0, 0)]).until == s(60)


def test_a_probe_that_stopped_without_an_answer_lapses_at_once():
    half = admit(fail(Breaker(), "a", 0), "b", s(5), POLICY).change
    assert on_abandoned(half, "c", s(6)) is None  # not the probe
    lapsed = on_abandoned(half, "b", s(6))
    assert (lapsed.state, lapsed.probe_job, lapsed.until, lapsed.version) == ("half_open", None, s(6), 3)
    assert admit(lapsed, "c", s(6), POLICY).change.probe_job == "c"

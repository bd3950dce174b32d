"""Provider events (issue 9 item 4): the golden v1 records decode field for field, a `PublishDeferred`
does not use up an attempt in the fold, and per-stage worker processes of `run --role all`."""

from __future__ import annotations

from datetime import datetime, timezone

from domain.lifecycle import attempts_used
from projections.provider_status import describe
from domain import events as ev
from domain.codec import default_codec
from cli.supervisor import ROLES, child_env, instances
from tests.golden import assert_decodes_as_expected, load
from tests.unit.test_fold import fold_all, happy_path, new

codec = default_codec()


def test_golden_provider_events_decode_to_the_expected_events():
    golden = load("providers-v1")
    assert [r["event_type"] for r, _, _ in golden] == ["ProviderBreakerChanged", "PublishDeferred",
                                                        "ProviderBreakerChanged", "ProviderBreakerChanged",
                                                        "PublishDeferred"]
    for record, value, expected in golden:
        assert value[2:10].hex() == record["writer_fingerprint"]
        assert_decodes_as_expected(record, value, expected)
    opened = ev.Event.from_record(codec.decode(golden[0][1]))
    assert (opened.to_state, opened.http_status, opened.version, opened.dedup_key.rsplit(":", 1)[1]) == \
        ("open", 429, 1, "webhook.1")
    quota = ev.Event.from_record(codec.decode(golden[4][1]))
    assert (quota.wait, quota.window, quota.window_s, quota.limit, quota.used) == ("quota", "minute", 60.0, 1, 1)


def test_a_deferred_publish_attempt_is_not_counted_against_the_budget():
    events = happy_path()[:7]  # ... publish attempt 1 started
    token = "tok-p"
    until = datetime(2026, 11, 29, 13, 0, tzinfo=timezone.utc)
    events += [
        new(ev.PublishDeferred, stage="publish", token=token, provider="webhook", wait="quota", until=until,
            window="minute", window_s=60.0, limit=2, used=2),
        new(ev.AttemptFailed, stage="publish", token=token, error_class="provider_throttled", retryable=True,
            reason="webhook quota reached"),
        new(ev.RetryScheduled, stage="publish", token=token, next_attempt=2, not_before=until,
            error_class="provider_throttled"),
    ]
    row, outcomes = fold_all(events)
    assert all(o.applied for o in outcomes)
    assert (row["state"], row["yields"], row["attempt"]) == ("retry_scheduled", 1, 1)
    assert attempts_used(row) == 0 and attempts_used(row, 2) == 1  # attempt 2 will be the first counted one


def test_stage_workers_are_extra_children_with_their_own_health_ports():
    plan = instances(ROLES, {"publish": 3, "transcode": 2})
    assert [(name, role) for name, role, _ in plan] == [
        ("projector", "projector"), ("intake", "intake"), ("transcode", "transcode"), ("transcode#2", "transcode"),
        ("publish", "publish"), ("publish#2", "publish"), ("publish#3", "publish"), ("watchdog", "watchdog"),
        ("notify", "notify")] + [(role, role) for role in ROLES[6:]]  # then the registry's other stages
    ports = [child_env(role, 9400, extra)["TAPELINE_HEALTH_PORT"] for _, role, extra in plan]
    n = len(ROLES)
    assert ports == [str(9400 + i) for i in (0, 1, 2, n, 3, n + 1, n + 2, 4, 5, *range(6, n))]
    assert len(set(ports)) == len(ports)
    assert [name for name, _, _ in instances(ROLES)] == list(ROLES)  # default: one per role


def test_the_status_line_of_a_provider():
    item = {"provider": "webhook", "state": "open", "until": "2026-11-29T12:00:05.123456+00:00", "failures": 2,
            "http_status": 503, "probe_job": None, "posts_minute": 1, "quota_minute": 30, "window_minute_s": 60.0,
            "posts_day": 7, "quota_day": None, "window_day_s": 86400.0, "last_wait": "quota",
            "last_wait_window": "minute", "last_wait_until": "2026-11-29T12:00:09.5+00:00", "deferrals": 3}
    assert describe(item) == ("webhook: open until 12:00:05.123 UTC (2 failure(s), HTTP 503); posts 1/30 per 60 s, "
                              "7/- per 86400 s; 3 deferral(s), last: quota (minute) until 12:00:09.500 UTC")
    half = dict(item, state="half_open", probe_job="job-1", last_wait=None)
    assert describe(half) == ("webhook: half_open: probe by job job-1 until 12:00:05.123 UTC; posts 1/30 per 60 s, "
                              "7/- per 86400 s")

"""The pure rules of customer notifications (domain/policy/webhooks.py)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from domain.policy.webhooks import (ALL_TYPES, DEFAULT_RETRY_SCHEDULE_S, check_event_types, check_url_shape,
                                    delivery_id, next_try, refused_address, should_disable)
from tapeline.settings import Settings

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize("address, kind", [
    ("10.0.0.1", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"), ("fd00::1", "private"),
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("0.0.0.0", "unspecified"), ("100.64.0.1", "not globally"),
    ("224.0.0.1", "multicast"), ("::ffff:10.0.0.1", "private")])
def test_non_global_addresses_are_refused(address, kind):
    why = refused_address(address)
    assert why is not None and kind in why
    assert refused_address(address, allow_private=True) is None


def test_loopback_alone_may_be_allowed():
    assert refused_address("127.0.0.1", allow_loopback=True) is None
    assert refused_address("10.0.0.1", allow_loopback=True) is not None


def test_a_refusal_names_the_address_and_the_setting_that_would_allow_it():
    from domain.errors import WebhookRefused
    from tapeline.webhook_endpoints import checked_addresses

    settings = Settings()
    with pytest.raises(WebhookRefused) as named:
        checked_addresses("http://localhost:8080/h", settings, lambda host, port: ["127.0.0.1"])
    assert str(named.value) == ("webhook URL http://localhost:8080/h refused: localhost resolves to 127.0.0.1, and "
                                "127.0.0.1 is a loopback address (allowed only with "
                                "TAPELINE_NOTIFY_ALLOW_LOOPBACK=true or TAPELINE_NOTIFY_ALLOW_PRIVATE=true)")
    with pytest.raises(WebhookRefused) as literal:
        checked_addresses("http://10.0.0.5/h", settings, lambda host, port: ["10.0.0.5"])
    assert str(literal.value) == ("webhook URL http://10.0.0.5/h refused: 10.0.0.5 is a private address "
                                  "(allowed only with TAPELINE_NOTIFY_ALLOW_PRIVATE=true)")
    allowed = settings.model_copy(update={"notify_allow_loopback": True})
    assert checked_addresses("http://localhost:8080/h", allowed, lambda host, port: ["127.0.0.1"]) == ["127.0.0.1"]


EMBEDDING_LOOPBACK = ["::127.0.0.1", "::ffff:127.0.0.1", "::ffff:0:127.0.0.1", "64:ff9b::127.0.0.1",
                      "2002:7f00:1::", "2002:7f00:1:1::5", "2001:0:808:808::80ff:fffe"]
"""IPv6 addresses that carry the IPv4 loopback: IPv4-compatible, -mapped and -translated, NAT64's
well-known prefix, 6to4, Teredo (client 127.0.0.1, obfuscated)."""


@pytest.mark.parametrize("address", EMBEDDING_LOOPBACK)
def test_an_ipv6_address_carrying_a_loopback_ipv4_is_judged_by_it(address):
    """Issue 44 item 6: `[::127.0.0.1]`, `[::ffff:0:127.0.0.1]`, NAT64 and 6to4 forms were accepted
    (Python calls them global). The IPv4 address inside is judged with the same allowances."""
    why = refused_address(address)
    assert why is not None and "127.0.0.1" in why and "loopback" in why, why
    assert refused_address(address, allow_private=True) is None
    from domain.errors import WebhookRefused
    from tapeline.webhook_endpoints import checked_addresses
    with pytest.raises(WebhookRefused, match="TAPELINE_NOTIFY_ALLOW"):  # the URL form, resolved for real
        checked_addresses(f"http://[{address}]:8080/hook", Settings())


@pytest.mark.parametrize("address", ["::10.1.2.3", "::ffff:0:192.168.1.1", "64:ff9b::169.254.169.254",
                                     "2002:a9fe:a9fe::1", "2002:c0a8:101::", "64:ff9b::100.64.0.1"])
def test_an_ipv6_address_carrying_a_private_ipv4_is_refused(address):
    why = refused_address(address)
    assert why is not None and "embeds" in why, why
    assert refused_address(address, allow_loopback=True) is not None
    assert refused_address(address, allow_private=True) is None


def test_the_loopback_allowance_covers_the_translated_forms_of_loopback():
    for address in ("::ffff:127.0.0.1", "::ffff:0:127.0.0.1", "64:ff9b::127.0.0.1", "::127.0.0.1", "::1"):
        assert refused_address(address, allow_loopback=True) is None, address


@pytest.mark.parametrize("address", ["64:ff9b::8.8.8.8", "::ffff:8.8.8.8", "2002:808:808::1"])
def test_an_ipv6_address_carrying_a_global_ipv4_is_allowed(address):
    assert refused_address(address) is None


@pytest.mark.parametrize("address", ["64:ff9b:1::a00:1", "100::1", "::1:2:3:4:5"])
def test_reserved_ipv6_ranges_are_refused(address):
    """NAT64's local-use prefix (RFC 8215), discard-only and the rest of ::/8 are not global."""
    assert refused_address(address) is not None


@pytest.mark.parametrize("address", ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946", "8.8.8.8"])
def test_global_addresses_are_allowed(address):
    assert refused_address(address) is None


@pytest.mark.parametrize("url", ["ftp://x/y", "http:///nohost", "https://user:pw@example.com/", "http://x:99999/"])
def test_malformed_urls_are_refused(url):
    with pytest.raises(ValueError):
        check_url_shape(url)


def test_the_webhook_id_is_stable_per_event_and_endpoint():
    key = "job-1:publish:1:JobCompleted"
    assert delivery_id(key, "ep_a") == delivery_id(key, "ep_a")
    assert delivery_id(key, "ep_a") != delivery_id(key, "ep_b") != delivery_id(key + "x", "ep_b")
    assert delivery_id(key, "ep_a").startswith("msg_")


def test_the_default_schedule_is_standard_webhooks_and_lasts_about_a_day():
    assert Settings().notify_retry_schedule_s == DEFAULT_RETRY_SCHEDULE_S
    assert 24 * 3600 < sum(DEFAULT_RETRY_SCHEDULE_S) < 30 * 3600
    assert next_try(1, NOW, DEFAULT_RETRY_SCHEDULE_S).retry_at == NOW + timedelta(seconds=5)
    assert next_try(7, NOW, DEFAULT_RETRY_SCHEDULE_S).retry_at == NOW + timedelta(hours=10)
    assert next_try(8, NOW, DEFAULT_RETRY_SCHEDULE_S).retry_at is None  # the 8th try failed: dead-lettered


def test_an_endpoint_is_disabled_only_after_failing_long_enough():
    assert not should_disable(None, NOW, 60)
    assert not should_disable(NOW - timedelta(seconds=59), NOW, 60)
    assert should_disable(NOW - timedelta(seconds=60), NOW, 60)


def test_event_types_are_checked():
    assert check_event_types([]) == list(ALL_TYPES)
    assert check_event_types(["job.failed", "job.failed"]) == ["job.failed"]
    with pytest.raises(ValueError, match="job.exploded"):
        check_event_types(["job.exploded"])


def test_the_notification_audit_names_each_broken_promise():
    from domain import events as ev
    from devstack.chaos import audit_notifications
    from tests.fakeclock import FixedClock

    clock = FixedClock()

    def event(cls, msg_id, **fields):
        common = dict(job_id="j", stage="notify", attempt=0, recorded_by="t", correlation_id="j", sequence=msg_id,
                      delivery_id=msg_id, endpoint_id="ep", notifier_token="n")
        return cls.new(clock.stamp(), **common, **fields)

    intended = [event(ev.NotificationIntended, m, notification_type="job.completed", source_event_id="e",
                      source_dedup_key=m) for m in ("a", "b", "c")]
    delivered = [event(ev.NotificationDelivered, m, try_number=1, http_status=200, elapsed_s=0.1) for m in ("a", "b")]
    assert audit_notifications(intended + delivered, {"a": [1, 2], "b": [1]}, 0) == []  # "a" redelivered: allowed
    assert audit_notifications(intended + delivered + delivered[:1], {"a": [1], "b": [1], "x": [1]}, 2) == [
        "2 POST(s) not signed with the endpoint's secret", "a: 2 NotificationDelivered committed",
        "x: answered 2xx, not recorded delivered", "x: received without a NotificationIntended"]
    assert audit_notifications(intended + delivered, {"a": [1]}, 0) == ["b: recorded delivered, never received"]
    at = delivered[0].occurred_at.timestamp()
    ok, failed = {"status": 200, "at": at - 1}, {"status": 500, "at": at - 2}
    # a 500 then a 200 is one success; a POST after the record, a 2xx never recorded, a lost one: each named
    assert audit_notifications(intended + delivered, {"a": [failed, ok], "b": [ok]}, 0, settled=False) == []
    assert audit_notifications(intended + delivered, {"a": [failed], "b": [ok, {"status": 200, "at": at + 5}],
                                                      "c": [ok]}, 0, settled=True) == [
        "a: recorded delivered, never answered 2xx", "b: 1 POST(s) after its delivery was recorded",
        "c: answered 2xx, not recorded delivered", "c: intended, never recorded delivered"]
    twice = event(ev.NotificationIntended, "z", notification_type="job.completed", source_event_id="e",
                  source_dedup_key="a")  # the event of "a" intended again under another webhook-id
    assert audit_notifications(intended + delivered + [twice], {"a": [1], "b": [1]}, 0) == [
        "a to ep: 2 webhook-ids ['a', 'z']"]


def test_a_post_is_pinned_to_the_address_that_was_checked():
    from domain.policy.webhooks import pinned

    plain = pinned("http://hooks.example.com/in?x=1", "93.184.216.34")
    assert (plain.url, plain.host, plain.sni_hostname) == ("http://93.184.216.34/in?x=1", "hooks.example.com", None)
    tls = pinned("https://Hooks.Example.com:8443/in", "2606:2800:220:1::248")
    assert tls.url == "https://[2606:2800:220:1::248]:8443/in"
    assert (tls.host, tls.sni_hostname) == ("Hooks.Example.com:8443", "hooks.example.com")
    with pytest.raises(ValueError):
        pinned("ftp://hooks.example.com/in", "93.184.216.34")

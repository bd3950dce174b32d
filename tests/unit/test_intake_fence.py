"""A fenced region refuses uploads (docs/regions.md "What clients see during and after a failover"):
the pure decision (`domain/regions.py` `intake_refusal`), the cached read of the region epochs
(`regions/authority.py` `AuthorityCache`, `IntakeFence`), the public addresses (`Settings.intake_address`,
`for_region`) and published URLs under `public_base_url` (`tapeline/objectstore.py` `published_url`)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from pydantic import ValidationError

from domain import events as ev
from domain.errors import RegionFenced
from domain.regions import Authority, authority, failover_event, intake_refusal
from regions.authority import AuthorityCache, IntakeFence, RegionView
from tapeline.objectstore import ObjectStore, object_url, published_url
from tapeline.settings import Settings

NOW = datetime(2026, 12, 5, 20, 40, 7, tzinfo=timezone.utc)
URLS = {"a": "https://a.intake.example", "b": "https://b.intake.example/"}


def to_region(current: Authority, to: str, failover_id: str = "fo-1", minutes: int = 0) -> ev.RegionFailedOver:
    return failover_event(current, to, reason="region a lost power", operator="ops", planned=False,
                          recorded_by="failover@t", failover_id=failover_id,
                          stamp=ev.Stamp(NOW + timedelta(minutes=minutes), f"e{minutes}"))


def test_the_active_region_accepts_and_any_other_is_refused_with_where_to_send_uploads():
    start = authority([])
    assert intake_refusal("a", start, URLS, 300) is None
    fence = to_region(start, "b")
    now = authority([fence])
    assert intake_refusal("b", now, URLS, 300) is None

    refusal = intake_refusal("a", now, URLS, 300)
    assert (refusal.status, refusal.error, refusal.retry_after_s) == (503, "region_fenced", 300)
    assert refusal.headers() == {"Retry-After": "300"}
    body = refusal.body()
    assert body == {"error": "region_fenced", "reason": refusal.reason, "retry_after_s": 300, "region": "a",
                    "active_region": "b", "epoch": 1, "failover_id": "fo-1",
                    "upload_to": "https://b.intake.example/uploads"}
    assert refusal.reason == ("region a is fenced: failover fo-1 made region b the active region at region epoch 1 "
                              "(2026-12-05 20:40:07 UTC); send uploads to region b: https://b.intake.example/uploads")


def test_after_a_failback_the_old_active_region_is_the_one_refused():
    to_b = to_region(authority([]), "b")
    back = to_region(authority([to_b]), "a", failover_id="fo-2", minutes=30)
    now = authority([back, to_b])
    assert intake_refusal("a", now, URLS, 5) is None
    body = intake_refusal("b", now, URLS, 5).body()
    assert (body["active_region"], body["epoch"], body["failover_id"], body["upload_to"]) == \
        ("a", 2, "fo-2", "https://a.intake.example/uploads")


def test_the_standby_refuses_before_any_failover_and_an_unknown_address_is_said_plainly():
    body = intake_refusal("b", authority([]), URLS, 60).body()
    assert (body["active_region"], body["epoch"], body["failover_id"]) == ("a", 0, None)
    assert body["reason"].startswith("region b is the standby: region a holds the job history")
    unknown = intake_refusal("b", authority([]), {}, 60).body()
    assert unknown["upload_to"] is None and unknown["reason"].endswith("send uploads to region a's intake")


def test_other_refusals_keep_their_three_fields():
    from domain.policy.admission import Refusal

    assert Refusal(429, "in_flight_cap", "too many", 7).body() == {"error": "in_flight_cap", "reason": "too many",
                                                                   "retry_after_s": 7}


class Reads:
    """A `read` for the cache: returns the views given in turn (an exception is raised), counts calls."""

    def __init__(self, *views) -> None:
        self.views, self.calls = list(views), 0

    def __call__(self) -> RegionView:
        self.calls += 1
        view = self.views.pop(0) if len(self.views) > 1 else self.views[0]
        if isinstance(view, Exception):
            raise view
        return view


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def view(records=(), unreachable=(), asked=("a", "b")) -> RegionView:
    return RegionView(authority(records), {"a": list(records)} if "a" not in unreachable else {},
                      list(unreachable), list(asked))


def test_the_cache_reads_at_most_once_per_interval():
    fence = to_region(authority([]), "b")
    reads, clock = Reads(view(), view([fence])), Clock()
    cache = AuthorityCache(reads, 5.0, clock)
    assert cache.current().active == "a" and reads.calls == 1
    for step in (0.0, 1.0, 4.999):  # within the interval: the first read answers, however many calls
        clock.t = 1000.0 + step
        assert cache.current().active == "a"
    assert reads.calls == 1
    clock.t = 1005.0  # the interval has passed: read again, and the fence is seen
    assert cache.current().active == "b" and reads.calls == 2
    clock.t = 1009.9
    assert cache.current().active == "b" and reads.calls == 2
    clock.t = 1010.0
    cache.current()
    assert reads.calls == 3


def test_an_unreadable_authority_is_unknown_at_first_and_keeps_the_last_one_read_later():
    fence = to_region(authority([]), "b")
    nobody = view(unreachable=("a", "b"))
    reads, clock = Reads(nobody, RuntimeError("kafka"), view([fence]), nobody, RuntimeError("kafka")), Clock()
    cache = AuthorityCache(reads, 5.0, clock)
    assert cache.current() is None  # no region answered: unknown
    clock.t += 5
    assert cache.current() is None  # the read raised: still unknown, and the caller is not failed
    clock.t += 5
    assert cache.current().active == "b"
    clock.t += 5
    assert cache.current().active == "b"  # nobody answers now: the fence read before holds
    clock.t += 5
    assert cache.current().active == "b" and reads.calls == 5
    clock.t += 1  # a failed read waits out the interval too
    cache.current()
    assert reads.calls == 5


def test_a_region_that_answers_without_records_is_region_a_at_epoch_0():
    cache = AuthorityCache(Reads(view(unreachable=("b",))), 5.0, Clock())
    assert cache.current() == Authority("a", 0)


def test_the_intake_fence_refuses_in_region_a_once_the_fence_is_read_and_accepts_while_unknown():
    a = Settings(serve_port=8400, region_check_interval_s=2.0, intake_retry_after_max_s=120)
    regions = {"a": a, "b": a.for_region("b")}
    fence = to_region(authority([]), "b")
    clock = Clock()
    reads = Reads(view(unreachable=("a", "b")), view([fence], unreachable=("b",)))
    gate = IntakeFence("a", regions, clock=clock, read=reads)
    assert gate.refusal() is None  # nothing answers: uploads are accepted as before
    clock.t += 2.0
    body = gate.refusal().body()
    assert (body["active_region"], body["upload_to"], body["retry_after_s"]) == \
        ("b", "http://127.0.0.1:18400/uploads", 120)
    b_gate = IntakeFence("b", regions, clock=clock, read=Reads(view([fence])))
    assert b_gate.refusal() is None


def test_intake_addresses_are_derived_by_the_one_rule_and_overridable():
    a = Settings(serve_host="0.0.0.0", serve_port=8500)
    assert a.intake_address == "http://127.0.0.1:8500"
    assert a.for_region("b").intake_address == "http://127.0.0.1:18500"
    given = Settings(intake_public_url="https://a.example/", region_b_intake_public_url="https://b.example")
    assert given.intake_address == "https://a.example"
    assert given.for_region("b").intake_address == "https://b.example"
    assert Settings(intake_public_url="https://a.example:8443").for_region("b").intake_address == \
        "https://a.example:18443"
    for bad in ("ftp://a.example", "a.example", "https://"):
        with pytest.raises(ValidationError):
            Settings(intake_public_url=bad)
    with pytest.raises(ValidationError):
        Settings(public_base_url="media.example.com")


def test_published_urls_name_the_public_base_url_when_set_and_the_endpoint_otherwise():
    key = "published/j1/720p/index.m3u8"
    assert published_url("", "http://127.0.0.1:19000", "media", key, "path") == \
        object_url("http://127.0.0.1:19000", "media", key, "path") == f"http://127.0.0.1:19000/media/{key}"
    assert published_url("https://media.example.com/v", "http://127.0.0.1:19000", "media", key, "virtual") == \
        f"https://media.example.com/v/{key}"
    assert Settings().public_base_url == ""
    region_a = Settings(public_base_url="https://media.example.com/", s3_endpoint="http://127.0.0.1:19000")
    region_b = region_a.for_region("b")
    assert region_b.s3_endpoint != region_a.s3_endpoint  # each region's own origin ...
    # ... and one address for clients: the URL handed out is the same in both regions.
    assert ObjectStore(region_a).public_url(key) == ObjectStore(region_b).public_url(key) == \
        f"https://media.example.com/{key}"
    assert ObjectStore(Settings()).public_url(key) == f"http://127.0.0.1:19000/tapeline-media/{key}"


def test_a_fenced_answer_to_submit_url_is_a_region_fenced_error_not_a_wait():
    import httpx

    from producers.http_submit import IntakeClient

    body = intake_refusal("a", authority([to_region(authority([]), "b")]), URLS, 300).body()
    waits = []

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json=body, headers={"Retry-After": "300"})

    client = IntakeClient("http://a.intake.test", "tok")
    client.close()
    client.http = httpx.Client(base_url="http://a.intake.test", transport=httpx.MockTransport(answer))
    with pytest.raises(RegionFenced) as raised:
        client.upload(Path(__file__), retries=5, on_wait=lambda *a: waits.append(a))
    client.close()
    assert waits == [] and raised.value.active_region == "b"
    assert raised.value.upload_to == "https://b.intake.example/uploads"


def test_while_one_caller_reads_the_others_get_the_last_authority_at_once_but_wait_for_the_first_read():
    import threading

    fence = to_region(authority([]), "b")
    release, reading = threading.Event(), threading.Event()
    answers = [view(), view([fence])]

    def slow_read() -> RegionView:
        reading.set()
        assert release.wait(10)
        return answers.pop(0)

    clock = Clock()
    cache = AuthorityCache(slow_read, 5.0, clock)
    seen: list = []
    first = threading.Thread(target=lambda: seen.append(("first", cache.current())))
    first.start()
    assert reading.wait(10)
    waiter = threading.Thread(target=lambda: seen.append(("waiter", cache.current())))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and seen == []  # before the first read ended nobody is answered unchecked
    release.set()
    first.join(10)
    waiter.join(10)
    assert sorted(seen) == [("first", Authority("a", 0)), ("waiter", Authority("a", 0))]

    release.clear()
    reading.clear()
    clock.t += 5.0
    second = threading.Thread(target=lambda: seen.append(("second", cache.current())))
    second.start()
    assert reading.wait(10)
    assert cache.current() == Authority("a", 0)  # a read is under way: the last authority, without waiting
    release.set()
    second.join(10)
    assert seen[-1] == ("second", authority([fence])) and cache.current().active == "b"

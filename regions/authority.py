"""The region epochs on Kafka (`<prefix>.regions`), and the guard that keeps a fenced region's
processors from writing (docs/regions.md "Failover"; the rule is `domain/regions.py`).

Each region's Kafka has its own `<prefix>.regions` topic (one partition, LogAppendTime, kept for
ever, never mirrored). `tapeline region failover` writes its `RegionFailedOver` to every region that
answers; a processor reads the topic of every region that answers, takes the highest epoch, and runs
only when it names its own region. A fence found only in the other region is copied into the
processor's own region, so the next start sees it even while the other region does not answer.

Limit, said plainly: a region that comes back while it cannot reach the other one, and never saw
the fence, cannot know it was fenced; its processors then write to its own log, which no longer
reaches the active region (the mirror into the active region is stopped by the failover, and
`stack up --region b` never starts it toward an active region B). A deployment that must rule this
out keeps the region record in a store both regions must reach (a quorum across three sites).
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import structlog

from domain import events as ev
from domain.codec import default_codec
from domain.errors import ServiceUnavailable
from domain.policy.admission import Refusal
from domain.regions import Authority, REGION_EVENT_KEY, authority, fence_reason, intake_refusal
from tapeline.kafka import bootstrap_listens
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.region")

FENCED_EXIT_CODE = 3
"""`tapeline run` exits with this code when its region is fenced (the supervisor does not restart it)."""


def read_region_records(settings: Settings, timeout_s: float = 5.0) -> list[ev.RegionFailedOver] | None:
    """Every `RegionFailedOver` on the region's `<prefix>.regions`; None when the topic does not
    exist. Raises ServiceUnavailable when the region's Kafka does not answer within `timeout_s`."""
    from tapeline import kafka_scan

    client = kafka_scan.committed_reader(settings, "regions-read", **{"allow.auto.create.topics": False})
    try:
        try:
            topics = kafka_scan.existing_topics(client, timeout_s)
        except ServiceUnavailable as exc:
            raise ServiceUnavailable(f"region {settings.region}'s Kafka does not answer: {exc}") from exc
        if settings.regions_topic not in topics:
            return None
        deadline = time.monotonic() + timeout_s
        while True:  # a topic created a moment ago has no leader yet (NOT_LEADER_FOR_PARTITION)
            try:
                low, high = kafka_scan.offsets(client, settings.regions_topic, 0, timeout_s)
                break
            except ServiceUnavailable as exc:
                if time.monotonic() >= deadline:
                    raise ServiceUnavailable(f"region {settings.region}'s {settings.regions_topic} has no "
                                             f"answer: {exc}") from exc
                time.sleep(0.2)
        if high <= low:
            return []
        records, codec = [], default_codec()

        def take(message: Any) -> bool:
            event = ev.Event.from_record(codec.decode(message.value(), topic=message.topic(),
                                                      partition=message.partition(), offset=message.offset()))
            if isinstance(event, ev.RegionFailedOver):
                records.append(event)
            return True

        position = (settings.regions_topic, 0)
        if position in kafka_scan.scan(client, {position: (low, high)}, take, max(0.0, deadline - time.monotonic())):
            return records
        raise ServiceUnavailable(f"region {settings.region}'s {settings.regions_topic} not read within {timeout_s:g} s")
    finally:
        client.close()


def write_region_record(settings: Settings, event: ev.RegionFailedOver, timeout_s: float = 15.0) -> None:
    """Append `event` to the region's `<prefix>.regions` (acks=all, idempotent; the topic exists:
    `ensure_topics`). Raises ServiceUnavailable when it is not acknowledged within `timeout_s`."""
    from tapeline import kafka

    producer = kafka.idempotent_producer(settings, **{"message.timeout.ms": int(timeout_s * 1000)})
    failures: list[str] = []
    producer.produce(settings.regions_topic, key=REGION_EVENT_KEY.encode(),
                     value=default_codec().encode(event.to_record()), partition=0,
                     on_delivery=lambda error, _message: error and failures.append(str(error)))
    if producer.flush(timeout_s) or failures:
        raise ServiceUnavailable(f"the region record was not written to region {settings.region}: "
                                 f"{failures[0] if failures else 'not acknowledged'}")


@dataclass
class RegionView:
    """What the reachable regions' topics say: the authority, the records per region that answered
    and has the topic, the regions that did not answer, and the regions that were asked."""

    authority: Authority
    records: dict[str, list[ev.RegionFailedOver]] = field(default_factory=dict)
    unreachable: list[str] = field(default_factory=list)
    asked: list[str] = field(default_factory=list)

    @property
    def answered(self) -> bool:
        """Whether at least one region asked answered (with or without a `<prefix>.regions` topic)."""
        return bool(set(self.asked) - set(self.unreachable))


def read_regions(regions: dict[str, Settings], timeout_s: float = 5.0) -> RegionView:
    """Read `<prefix>.regions` of every region in `regions` (`{"a": ..., "b": ...}`) that answers."""
    records: dict[str, list[ev.RegionFailedOver]] = {}
    unreachable = []
    for name, settings in regions.items():
        if not bootstrap_listens(settings):
            unreachable.append(name)
            continue
        try:
            found = read_region_records(settings, timeout_s)
            if found is not None:
                records[name] = found
        except ServiceUnavailable as exc:
            log.warning("region not read", region=name, error=str(exc))
            unreachable.append(name)
    return RegionView(authority([r for rs in records.values() for r in rs]), records, unreachable, list(regions))


def check_region(region: str, regions: dict[str, Settings], timeout_s: float = 5.0) -> str | None:
    """Why processors of `region` must not write (`domain/regions.py` `fence_reason`), or None.

    A fence read only from the other region is copied into `region`'s own topic when it answers, so
    a later start sees it there. A region that cannot be read counts as holding no record."""
    view = read_regions(regions, timeout_s)
    reason = fence_reason(region, view.authority)
    record = view.authority.record
    own = view.records.get(region)
    if record is not None and own is not None and all(r.event_id != record.event_id for r in own):
        try:
            write_region_record(regions[region], record, timeout_s=timeout_s)
            log.warning("region record copied into this region", region=region, epoch=record.epoch,
                        to_region=record.to_region)
        except ServiceUnavailable as exc:
            log.warning("region record not copied", region=region, error=str(exc))
    return reason


class RegionGuard:
    """Checks every `interval_s` seconds, in its own thread, that `region` still holds the job
    history; calls `on_fenced(reason)` once when it does not. A check that cannot read a region
    changes nothing (the processors' own writes fail while their Kafka does not answer)."""

    def __init__(self, region: str, regions: dict[str, Settings], interval_s: float,
                 on_fenced: Callable[[str], None]) -> None:
        self.region, self.regions, self.interval_s, self.on_fenced = region, regions, interval_s, on_fenced
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="region-guard", daemon=True)

    def start(self) -> "RegionGuard":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                reason = check_region(self.region, self.regions)
            except Exception as exc:  # a check never stops the processors by failing
                log.warning("region check failed", error=f"{type(exc).__name__}: {exc}")
                continue
            if reason is not None:
                self.reason = reason
                log.error("region fenced: stopping", region=self.region, reason=reason)
                self.on_fenced(reason)
                return


class AuthorityCache:
    """The region authority as last read, read again at most every `interval_s` seconds, so a caller
    on a hot path (every upload) costs a Kafka read once per interval, not once per call.

    `read()` returns a `RegionView` (`read_regions`); `clock()` is monotonic seconds (injected for
    tests). `current()` is the authority, or None while nothing could be read: no read yet answered,
    i.e. every region was unreachable or the read raised. A read that fails keeps the last authority
    read (a fence does not go away because its topic stopped answering for a moment); a failed read
    also waits out `interval_s`. Thread-safe, one read at a time: while it runs, other callers get
    the authority read before without waiting; only before the first read has ended do they wait
    for it (no upload is let through unchecked while the process starts)."""

    def __init__(self, read: Callable[[], RegionView], interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.read, self.interval_s, self.clock = read, interval_s, clock
        self._authority: Authority | None = None
        self._read_at: float | None = None
        self._done_once = False
        self._lock = threading.Lock()

    def current(self) -> Authority | None:
        """The authority (read now when the last read is `interval_s` or more old), or None when unknown."""
        if self._fresh():
            return self._authority
        if not self._lock.acquire(blocking=not self._done_once):
            return self._authority  # another caller is reading: the authority read before, meanwhile
        try:
            if self._fresh():  # read by the caller this one waited for
                return self._authority
            self._read_at = self.clock()
            try:
                view = self.read()
            except Exception as exc:  # an unreadable authority never fails the caller
                log.warning("region authority not read", error=f"{type(exc).__name__}: {exc}")
                return self._authority
            finally:
                self._done_once = True
            if view.answered:
                self._authority = view.authority
            else:
                log.warning("region authority not read: no region answered", unreachable=view.unreachable)
            return self._authority
        finally:
            self._lock.release()

    def _fresh(self) -> bool:
        """Whether a read has ended and the last one started less than `interval_s` ago."""
        return self._done_once and self._read_at is not None and self.clock() - self._read_at < self.interval_s


class IntakeFence:
    """Whether this region's intake may take an upload, for `tapeline serve`'s `POST /uploads` and
    its `/health/ready` (docs/regions.md "What clients see during and after a failover").

    `region` is this region's name, `regions` every region's settings (`{"a": ..., "b": ...}`,
    `cli/helpers.py` `region_settings`): their `<prefix>.regions` topics are read through an
    `AuthorityCache` at most every `region_check_interval_s` (this region's setting) seconds, and the
    answer is `domain/regions.py` `intake_refusal` with each region's `Settings.intake_address` and a
    `Retry-After` of `intake_retry_after_max_s`. While no region's Kafka answers (the authority
    cannot be read) uploads are accepted, as before region epochs existed: the upload then fails on
    its own when this region's Kafka does not take it. `clock` (monotonic seconds) and `read` (a
    `RegionView`) are injected for tests; by default `read_regions(regions, timeout_s=3)`."""

    def __init__(self, region: str, regions: dict[str, Settings], clock: Callable[[], float] = time.monotonic,
                 read: Callable[[], RegionView] | None = None) -> None:
        own = regions[region]
        self.region = region
        self.urls = {name: settings.intake_address for name, settings in regions.items()}
        self.retry_after_s = max(1, int(own.intake_retry_after_max_s))
        self.cache = AuthorityCache(read or (lambda: read_regions(regions, timeout_s=3.0)),
                                    own.region_check_interval_s, clock)

    def refusal(self) -> Refusal | None:
        """The 503 `region_fenced` refusal while this region is not the active one, else None (also
        while the authority cannot be read). Blocks for a Kafka read at most once per interval."""
        current = self.cache.current()
        return None if current is None else intake_refusal(self.region, current, self.urls, self.retry_after_s)


def unanswered(settings: Settings, *, s3: bool = False) -> str | None:
    """Why the region of `settings` cannot be worked on: its Kafka, its PostgreSQL or (with `s3`) its
    S3 endpoint does not answer, as one sentence; None when all of them answer."""
    import psycopg

    from tapeline.kafka import cluster_answers
    from tapeline.objectstore import endpoint_answers

    answers, why = cluster_answers(settings)
    if not answers:
        return f"region {settings.region}'s Kafka ({settings.kafka_bootstrap_servers}) does not answer: {why}"
    try:
        psycopg.connect(settings.database_url, connect_timeout=5).close()
    except psycopg.Error as exc:
        return f"region {settings.region}'s PostgreSQL does not answer: {exc}"
    if s3:
        answers, why = endpoint_answers(settings)
        if not answers:
            return f"region {settings.region}'s S3 ({settings.s3_endpoint}) does not answer: {why}"
    return None


def new_failover_id() -> str:
    """A failover's id (the `correlation_id` of its record)."""
    return str(uuid.uuid4())

"""The notifier (`tapeline run --role notify`): customer notifications by webhook, a side effect
reconciled and fenced like a publish post (docs/design.md "Notifications").

One leader per deployment (a PostgreSQL advisory lock on its own session, as the watchdog's) writes
with the fixed transactional id `<app>.notify`: a new leader's `init_transactions` fences the old
one, whose next record fails with `Fenced` and stops it. Each incarnation draws a claim token, kept
in every event it records (`notifier_token`).

It follows the lifecycle log through its projection: the applied evidence of the notified event
types (`domain/policy/webhooks.py` NOTIFICATION_TYPES), so a fenced (superseded) or duplicate event
never notifies anyone. Each loop:
  Step 1. intend: for every such event and every enabled endpoint of the job's submitter that wants
          its type and has no delivery for it yet, `NotificationIntended` (its `delivery_id`, the
          `webhook-id`, derived from the event's dedup key and the endpoint), in one transaction;
  Step 2. dead-letter the deliveries of removed endpoints;
  Step 3. hand every due delivery (pending, or a retry whose time came) to a thread, at most
          `notify_max_in_flight_per_endpoint` per endpoint and `notify_workers` in all (the query
          reads only that many per endpoint, so a slow endpoint's backlog never hides another's).
One delivery (`deliver`), reconcile then act:
  a. wait until the projection has applied the job's lifecycle partition (up to its last stable
     offset and past this process's own writes), then read the delivery: delivered or dead-lettered
     -> nothing to do, ever; a try count other than the one scheduled -> another pass owns it;
  b. prove leadership (the lock's session answers) and check the URL's addresses again;
  c. POST the signed body to the address checked in b (the URL's host kept in `Host` and TLS, so a
     DNS answer that changed since the check cannot redirect it; Standard Webhooks headers; no
     redirects, a timeout, at most `notify_response_limit_bytes` of the answer read);
  d. record `NotificationDelivered` (2xx) or `NotificationFailed` with its retry time, plus
     `NotificationDeadLettered` when the schedule is spent and `WebhookEndpointDisabled` when the
     endpoint has failed without a success for `notify_disable_after_s`, in one transaction; then
     apply the delivery events to `webhook_deliveries` at once (the projector's trigger applies the
     same function again, idempotently).
A crash between c and d (after the receiver's 2xx, before the record) sends the same delivery again
with the same `webhook-id`: receivers dedupe on it, as the convention asks. A delivery recorded as
delivered is never sent again. Crash points `notify.*` mark the boundaries (tests only).
Nothing in the pipeline waits on the notifier: it is its own role and only reads the projections.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter as Tally
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any, Callable

import httpx
import structlog
from standardwebhooks import Webhook

from domain import events as ev
from domain.lifecycle import PAYLOAD_OMITS
from domain.links import web_url
from domain.errors import Fenced, ServiceUnavailable, WebhookRefused
from domain.policy.webhooks import NOTIFICATION_TYPES, delivery_id, next_try, pinned, should_disable
from processors.runtime import Outgoing, Runtime, transact
from processors.claim import new_claim_token
from processors.watchdog import leader_key
from tapeline import webhook_endpoints as webhooks
from tapeline.partitioner import partition_for
from tapeline.crashpoints import crash_point
from tapeline.health import HealthState
from tapeline.ports import Clock, EventLog, EventLogError, JobStore
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.notify")

NOTIFY_LOCK = 0x7A9E_0040
"""First key of the advisory lock the notifier leader holds (second: `hashtext` of `leader_key`)."""

BATCH = 500
"""Events intended, and due deliveries read, per loop at most."""

DELIVERY_EVENTS = ("NotificationIntended", "NotificationDelivered", "NotificationFailed", "NotificationDeadLettered")

PAYLOAD_FIELDS = ("master_url", "media_duration_s", "error_class", "reason", "operator", "upload_id", "refunded",
                  "serving_region", "from_region")
"""Fields of the notified lifecycle event copied into the webhook's `data` (when it has them)."""


def webhook_body(delivery: dict[str, Any]) -> bytes:
    """The JSON body of a delivery: `type`, `timestamp` (the lifecycle event's broker time) and
    `data` (job id, event id and type, stage, attempt, the event's own notable fields). The same
    bytes on every try. Pure."""
    payload = delivery.get("source_payload") or {}
    if isinstance(payload, str):
        payload = json.loads(payload)
    data = {"job_id": delivery["job_id"], "event_id": delivery["source_event_id"],
            "event_type": delivery.get("source_event_type"), "stage": delivery.get("source_stage"),
            "attempt": delivery.get("source_attempt")}
    data.update({k: payload[k] for k in PAYLOAD_FIELDS if payload.get(k) is not None})
    if "master_url" in data and web_url(data["master_url"]) is None:  # http(s) only (domain/links.py)
        del data["master_url"]
    stamp = delivery.get("source_broker_ts")
    body = {"type": delivery["notification_type"], "timestamp": stamp.isoformat() if stamp else None, "data": data}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def signed_headers(secret: str, msg_id: str, body: bytes, now: datetime) -> dict[str, str]:
    """The Standard Webhooks headers of one POST (`webhook-signature` = v1,HMAC-SHA256 of
    `id.timestamp.body` with the endpoint's secret)."""
    return {"webhook-id": msg_id, "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": Webhook(secret).sign(msg_id, now, body),
            "content-type": "application/json", "user-agent": "Tapeline-Webhooks/1"}


class PostResult:
    """What one POST gave: the status (None: no answer) and, when it failed, why."""

    def __init__(self, status: int | None, reason: str | None, elapsed_s: float) -> None:
        self.status, self.reason, self.elapsed_s = status, reason, elapsed_s

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def post(client: httpx.Client, url: str, body: bytes, headers: dict[str, str], timeout_s: float,
         limit_bytes: int, address: str | None = None) -> PostResult:
    """One POST: redirects are answers (a failure), not followed; the answer's body is read up to
    `limit_bytes` and for at most `timeout_s` in all; every error is a failure with its reason.
    `address`: the IP literal the URL's host was checked at (`webhooks.checked_addresses`); the
    connection goes there, with the URL's host in `Host` and in TLS (`pinned`)."""
    started = time.monotonic()
    extensions: dict[str, str] = {}
    if address is not None:
        target = pinned(url, address)
        url, headers = target.url, {**headers, "Host": target.host}
        if target.sni_hostname:
            extensions["sni_hostname"] = target.sni_hostname
    try:
        with client.stream("POST", url, content=body, headers=headers, follow_redirects=False,
                           extensions=extensions) as response:
            kept = b""
            for chunk in response.iter_raw():
                kept += chunk[: max(0, limit_bytes - len(kept))]
                if len(kept) >= limit_bytes or time.monotonic() - started > timeout_s:
                    break
            status = response.status_code
    except httpx.TimeoutException as exc:
        return PostResult(None, f"timeout after {timeout_s:g} s ({type(exc).__name__})", time.monotonic() - started)
    except httpx.HTTPError as exc:
        return PostResult(None, f"no answer: {type(exc).__name__}: {exc}"[:500], time.monotonic() - started)
    elapsed = time.monotonic() - started
    if 200 <= status < 300:
        return PostResult(status, None, elapsed)
    what = "a redirect (not followed)" if 300 <= status < 400 else "a failure"
    text = kept.decode("utf-8", "replace").strip()
    return PostResult(status, f"HTTP {status}, {what}" + (f": {text[:200]}" if text else ""), elapsed)


class Notifier:
    """The notifier process (see the module docstring)."""

    def __init__(self, settings: Settings, *, leader: JobStore, jobs: JobStore, events: EventLog, clock: Clock,
                 new_store: Callable[[], JobStore], health: HealthState | None = None, storage: Any = None,
                 resolver: Callable[[str, int], list[str]] = webhooks.resolve) -> None:
        """`leader`: a job store of its own whose session holds the leader lock; `jobs`: the one the
        loop reads through; `new_store`: makes the job store each delivery thread opens for itself
        (a session is not shared between threads); `events`: the lifecycle log;
        `clock`: stamps events and decides when retries are due. (`storage` is unused: the notifier
        writes no objects.)"""
        self.settings, self.leader, self.jobs, self.events, self.clock = settings, leader, jobs, events, clock
        self.new_store = new_store
        self.health = health or HealthState("notify", settings.instance_id)
        self.resolver = resolver
        self.token = new_claim_token()
        self.in_flight: dict[str, str] = {}  # delivery id -> endpoint id
        self.per_endpoint: Tally[str] = Tally()
        self._state_lock = threading.Lock()
        self._produce_lock = threading.Lock()  # a transactional producer runs one transaction at a time
        self._kafka_lock = threading.Lock()  # the offsets client is not shared between threads
        self._leader_lock = threading.Lock()
        self._local = threading.local()
        self._stores: list[JobStore] = []
        self.runtime: Runtime | None = None
        self.producer = None
        self.fenced: Fenced | None = None

    # -- the loop -----------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        settings = self.settings
        self.leader.open()
        self.health.mark_ready()  # a standby waiting for the lock is healthy too
        try:
            while not stop.is_set():
                if self.leader.one("watchdog_try_leader", {"lock_class": NOTIFY_LOCK,
                                                           "key": leader_key(settings)})["got"]:
                    break
                stop.wait(settings.notify_poll_s)
            if stop.is_set():
                return
            log.info("notifier is the leader", token=self.token)
            self.runtime = Runtime(settings, "notify", health=self.health, stop=stop, events=self.events,
                                   jobs=self.jobs)
            self.producer = self.events.transactional_producer(f"{settings.app_name}.notify")
            client = httpx.Client(timeout=httpx.Timeout(settings.notify_timeout_s), follow_redirects=False,
                                  trust_env=False)
            pool = ThreadPoolExecutor(settings.notify_workers, thread_name_prefix="notify")
            try:
                while not stop.is_set() and self.fenced is None:
                    with self._leader_lock:
                        self.leader.run("session_alive")
                    try:
                        self.step(pool, client)
                    except (ServiceUnavailable, EventLogError) as exc:  # the transaction was aborted
                        log.warning("notifier step skipped", error=str(exc))
                    stop.wait(settings.notify_poll_s)
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
                client.close()
                for store in self._stores:
                    store.close()
                self.runtime.close()
            if self.fenced is not None:
                raise self.fenced
        finally:
            self.leader.close()

    def step(self, pool: ThreadPoolExecutor, client: httpx.Client) -> None:
        """Steps 1-3 once."""
        settings, now = self.settings, self.clock.now()
        # Step 1
        kinds = list(NOTIFICATION_TYPES)
        new = self.jobs.all("notify_new_deliveries", {"event_types": kinds,
                                                       "notification_types": [NOTIFICATION_TYPES[k] for k in kinds],
                                                       "since": now - timedelta(seconds=settings.notify_lookback_s),
                                                       "limit": BATCH})
        if new:
            intended = [self._intended(row) for row in new]
            self._record(self.jobs, intended, "notify.intended")
            log.info("notifications intended", count=len(intended))
        # Step 2
        for row in self.jobs.all("notify_orphaned_deliveries", {"limit": BATCH}):
            with self._state_lock:
                if row["delivery_id"] in self.in_flight:
                    continue
            self._record(self.jobs, [self._event(ev.NotificationDeadLettered, row["job_id"], row["delivery_id"],
                                                 delivery_id=row["delivery_id"], endpoint_id=row["endpoint_id"],
                                                 tries=row["tries"], reason="the endpoint was removed")],
                         "notify.dead_lettered")
        # Step 3
        for row in self.jobs.all("notify_due_deliveries", {"now": now, "limit": BATCH,
                                                           "per_endpoint": settings.notify_max_in_flight_per_endpoint}):
            with self._state_lock:
                if (row["delivery_id"] in self.in_flight or len(self.in_flight) >= settings.notify_workers
                        or self.per_endpoint[row["endpoint_id"]] >= settings.notify_max_in_flight_per_endpoint):
                    continue
                self.in_flight[row["delivery_id"]] = row["endpoint_id"]
                self.per_endpoint[row["endpoint_id"]] += 1
            future = pool.submit(self.deliver, row, client)
            future.add_done_callback(lambda f, row=row: self._done(row, f))
        self._gauges()

    def _done(self, row: dict[str, Any], future: Future) -> None:
        with self._state_lock:
            self.in_flight.pop(row["delivery_id"], None)
            self.per_endpoint[row["endpoint_id"]] -= 1
        error = future.exception()
        if isinstance(error, Fenced):
            self.fenced = error
            log.error("notifier fenced: a newer leader exists; stopping", error=str(error))
        elif error is not None:
            log.error("delivery failed unexpectedly; retried at the next pass", delivery_id=row["delivery_id"],
                      error=f"{type(error).__name__}: {error}")

    # -- one delivery -------------------------------------------------------------------------------
    def deliver(self, due: dict[str, Any], client: httpx.Client) -> str:
        """Steps a-d for one due delivery; returns what happened (skipped | delivered | failed)."""
        settings, store = self.settings, self._store()
        # Step a
        self._wait_caught_up(store, due["job_id"])
        row = store.one("notify_delivery", {"delivery_id": due["delivery_id"]})
        if row is None or row["state"] in ("delivered", "dead_lettered") or row["tries"] != due["tries"]:
            return "skipped"
        if row["url"] is None or not row["enabled"]:
            return "skipped"
        try_number = row["tries"] + 1
        body = webhook_body(row)
        # Step b
        with self._leader_lock:
            self.leader.run("session_alive")
        try:
            addresses = webhooks.checked_addresses(row["url"], settings, self.resolver)
        except WebhookRefused as exc:
            result = PostResult(None, f"refused: {exc}"[:500], 0.0)
        else:
            # Step c: to the address just checked, not to whatever the host resolves to next
            crash_point("notify.before_post")
            now = self.clock.now()
            result = post(client, row["url"], body, signed_headers(row["secret"], row["delivery_id"], body, now),
                          settings.notify_timeout_s, settings.notify_response_limit_bytes, address=addresses[0])
            crash_point("notify.after_post")
            self.health.webhook_post_seconds.observe(result.elapsed_s)
        # Step d
        now = self.clock.now()
        ids = dict(delivery_id=row["delivery_id"], endpoint_id=row["endpoint_id"])
        if result.ok:
            self._record(store, [self._event(ev.NotificationDelivered, row["job_id"], row["delivery_id"], **ids,
                                             try_number=try_number, http_status=result.status,
                                             elapsed_s=round(result.elapsed_s, 6))], "notify.delivered")
            store.run("webhook_endpoint_succeeded", {"endpoint_id": row["endpoint_id"], "now": now})
            self.health.webhook_posts.labels(outcome="delivered").inc()
            log.info("webhook delivered", delivery_id=row["delivery_id"], job_id=row["job_id"],
                     endpoint_id=row["endpoint_id"], status=result.status, try_number=try_number)
            return "delivered"
        self.health.webhook_posts.labels(outcome="failed").inc()
        retry = next_try(try_number, now, settings.notify_retry_schedule_s)
        out = [self._event(ev.NotificationFailed, row["job_id"], f"{row['delivery_id']}.{try_number}", **ids,
                           try_number=try_number, http_status=result.status, reason=result.reason or "failed",
                           retry_at=retry.retry_at)]
        if retry.retry_at is None:
            out.append(self._event(ev.NotificationDeadLettered, row["job_id"], row["delivery_id"], **ids,
                                   tries=try_number, reason=result.reason or "failed"))
        streak = store.one("webhook_endpoint_failed", {"endpoint_id": row["endpoint_id"], "now": now})
        disable = streak is not None and streak["enabled"] and should_disable(
            streak["failing_since"], now, settings.notify_disable_after_s)
        if disable:
            why = (f"failing without a success since {streak['failing_since']:%Y-%m-%d %H:%M:%S} UTC "
                   f"(notify_disable_after_s = {settings.notify_disable_after_s:g}); last: {result.reason}")[:500]
            out.append(self._event(ev.WebhookEndpointDisabled, row["job_id"], f"{row['endpoint_id']}.disabled",
                                   endpoint_id=row["endpoint_id"], submitter=streak["submitter"],
                                   failing_since=streak["failing_since"], reason=why))
        self._record(store, out, "notify.failed")
        if disable:
            webhooks.set_enabled(store, row["endpoint_id"], False, out[-1].reason, for_failing=True)
            log.warning("webhook endpoint disabled", endpoint_id=row["endpoint_id"], reason=out[-1].reason)
        log.info("webhook failed", delivery_id=row["delivery_id"], job_id=row["job_id"],
                 endpoint_id=row["endpoint_id"], try_number=try_number, reason=result.reason,
                 retry_at=retry.retry_at.isoformat() if retry.retry_at else None)
        return "failed"

    # -- helpers ------------------------------------------------------------------------------------
    def _intended(self, row: dict[str, Any]) -> ev.Event:
        """The `NotificationIntended` of one (lifecycle event, endpoint) row of `notify_new_deliveries`."""
        msg_id = delivery_id(row["dedup_key"], row["endpoint_id"])
        return self._event(ev.NotificationIntended, row["job_id"], msg_id, delivery_id=msg_id,
                           endpoint_id=row["endpoint_id"], notification_type=row["notification_type"],
                           source_event_id=row["event_id"], source_dedup_key=row["dedup_key"])

    def _event(self, cls: type[ev.Event], job_id: str, sequence: str, **fields: Any) -> ev.Event:
        return cls.new(self.clock.stamp(), job_id=job_id, stage="notify", attempt=0,
                       recorded_by=self.runtime.recorded_by, correlation_id=job_id, sequence=sequence,
                       notifier_token=self.token, **fields)

    def _record(self, store: JobStore, events: list[ev.Event], name: str) -> None:
        """Commit `events` on the leader's fenced producer (raises `Fenced`), then apply the delivery
        events to `webhook_deliveries`."""
        jobs_topic = self.settings.jobs_topic
        outgoing: list[Outgoing] = [(jobs_topic, e) for e in events]
        with self._produce_lock:
            transact(self.producer, lambda: self.runtime.produce(self.producer, outgoing), name=name)
        for event in events:
            if event.event_type in DELIVERY_EVENTS:
                store.run("apply_webhook_delivery", {
                    "payload": event.model_dump_json(exclude=PAYLOAD_OMITS),
                    "event_type": event.event_type, "job_id": event.job_id, "occurred_at": event.occurred_at})

    def _store(self) -> JobStore:
        """This thread's own job store (its own PostgreSQL session), opened on first use."""
        store = getattr(self._local, "store", None)
        if store is None:
            store = self._local.store = self.new_store()
            store.open()
            with self._state_lock:
                self._stores.append(store)
        return store

    def _wait_caught_up(self, store: JobStore, job_id: str) -> None:
        """Wait until the projection applied the job's lifecycle partition up to its last stable offset
        and past this process's own writes there (`Runtime.wait_caught_up` on this thread's session)."""
        topic, runtime = self.settings.jobs_topic, self.runtime
        with self._kafka_lock:
            partition = partition_for(job_id, runtime.partitions(topic))
            target = max(runtime.written.get((topic, partition), -1) + 1,
                         runtime.events.last_stable_offset(topic, partition))
        store.wait_applied(topic, partition, target, self.settings.caught_up_timeout_s, stop=runtime.stop)

    def _gauges(self) -> None:
        row = self.jobs.one("webhook_delivery_states")
        for state in ("pending", "retry_scheduled", "failed", "delivered", "dead_lettered"):
            self.health.webhook_deliveries.labels(state=state).set(row["states"].get(state, 0))
        self.health.webhook_endpoints_failing.set(row["failing_endpoints"])
        self.health.webhook_endpoints_disabled.set(row["disabled_endpoints"])
        self.health.webhook_endpoints_disabled_failing.set(row["disabled_failing_endpoints"])

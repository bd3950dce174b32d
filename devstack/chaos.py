"""The chaos harness shared by `tests/faults/test_crash_points.py` and `bench/chaos.py`: a real
provider server process, reading the committed log and the bucket, and the audit that says whether
a run kept the product's promises (no duplicate side effect, no lost job, projections equal to the
log).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import psycopg
from confluent_kafka import KafkaError, Message, TopicPartition

from domain import lifecycle
from domain import events as ev
from domain.codec import default_codec
from tapeline import kafka
from domain.errors import ServiceUnavailable
from domain.lifecycle import TERMINAL_STATES
from tapeline.objectstore import ObjectStore
from tapeline.postgres import q
from tapeline.settings import Settings



class ProviderProcess:
    """`python -m devstack.provider_server` as a real child process on a free port."""

    def __init__(self, directory: Path, mode: str = "nodedupe", timeout_s: float = 20.0) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.record = directory / f"posts-{self.port}.jsonl"
        self.process = subprocess.Popen([sys.executable, "-m", "devstack.provider_server", "--port", str(self.port),
                                         "--mode", mode, "--record", str(self.record)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise ServiceUnavailable(f"the provider server on {self.url} did not start")
            time.sleep(0.1)

    def _answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def posts(self, job_id: str | None = None) -> list[dict[str, Any]]:
        """Every post the server received (optionally of one job), in order."""
        posts = httpx.get(f"{self.url}/posts", timeout=5).json()
        return [p for p in posts if job_id is None or p["payload"]["job_id"] == job_id]

    def requests(self) -> list[dict[str, Any]]:
        """Every `POST /posts` request the server received, refused ones included, in order."""
        return httpx.get(f"{self.url}/requests", timeout=5).json()

    def control(self, **change: Any) -> None:
        """Inject faults (see devstack/provider_server.py `/_control`)."""
        httpx.post(f"{self.url}/_control", json=change, timeout=5).raise_for_status()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


def committed_messages(settings: Settings, topic: str | None = None, timeout_s: float = 30.0) -> list[Message]:
    """Every committed record of a topic (default: the lifecycle log), from offset 0 to the end.
    Raises `ServiceUnavailable` when the end is not reached within `timeout_s` seconds."""
    topic = topic or settings.jobs_topic
    consumer = kafka.consumer(settings, f"assert-{uuid.uuid4().hex[:8]}", **{"enable.partition.eof": True})
    partitions = kafka.partition_count(consumer, topic)
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    messages, at_end = [], set()
    deadline = time.monotonic() + timeout_s
    try:
        while len(at_end) < partitions and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None:
                continue
            if message.error():
                if message.error().code() == KafkaError._PARTITION_EOF:
                    at_end.add(message.partition())
                continue
            messages.append(message)
    finally:
        consumer.close()
    if len(at_end) < partitions:
        raise ServiceUnavailable(f"did not reach the end of {topic} within {timeout_s:.0f} s")
    return messages


def keys_under(settings: Settings, prefix: str) -> set[str]:
    """Every object key under `prefix` in the bucket."""
    store = ObjectStore(settings)
    keys, token = set(), None
    while True:
        page = store.s3.list_objects_v2(Bucket=store.bucket, Prefix=prefix,
                                        **({"ContinuationToken": token} if token else {}))
        keys |= {item["Key"] for item in page.get("Contents", [])}
        if not page.get("IsTruncated"):
            return keys
        token = page["NextContinuationToken"]


def fold_log(messages: list[Message]) -> dict[str, dict[str, Any]]:
    """The job rows a fold over committed lifecycle records gives: the projector's rules (dedup key
    applied once, `lifecycle.evolve` in log order per partition), in memory."""
    codec, rows, applied = default_codec(), {}, set()
    for message in messages:
        event = ev.Event.from_record(codec.decode(message.value()))
        if isinstance(event, ev.WatchdogTick) or event.dedup_key in applied:
            continue
        ts = datetime.fromtimestamp(message.timestamp()[1] / 1000, tz=timezone.utc)
        outcome = lifecycle.evolve(rows.get(event.job_id), event, ts)
        if outcome.applied and outcome.row is not None:
            rows[event.job_id] = outcome.row
            applied.add(event.dedup_key)
    return rows


@dataclass
class Audit:
    """What a chaos run left behind. `violations` lists every broken promise, one line each."""

    jobs: int = 0
    completed: int = 0
    needs_review: list[str] = field(default_factory=list)
    dead_lettered: list[str] = field(default_factory=list)
    duplicates: int = 0  # extra posts, extra JobCompleted, published objects not in the one output set
    lost: int = 0  # jobs not ended, ended without a reason, or missing from the projection
    violations: list[str] = field(default_factory=list)


def audit(settings: Settings, jobs: dict[str, str], posts: list[dict[str, Any]]) -> Audit:
    """Check every job of a run (`jobs`: job id -> label, e.g. its crash point) against the log, the
    projection, the bucket and the provider's record of posts (`posts`)."""
    messages = committed_messages(settings)
    codec = default_codec()
    events = [ev.Event.from_record(codec.decode(m.value())) for m in messages]
    folded = fold_log(messages)
    with psycopg.connect(settings.database_url, row_factory=psycopg.rows.dict_row) as conn:
        projected = {r["job_id"]: r for r in conn.execute(q("all_job_rows")).fetchall()}
    result = Audit(jobs=len(jobs))
    for job_id, label in jobs.items():
        row = projected.get(job_id)
        if row is None or row["state"] not in ("completed", "dead_lettered", "needs_review"):
            result.lost += 1
            result.violations.append(f"{label}: job {job_id} is {row['state'] if row else 'missing'}")
            continue
        state = row["state"]
        mine = [p for p in posts if p["payload"]["job_id"] == job_id]
        completions = [e for e in events if e.job_id == job_id and isinstance(e, ev.JobCompleted)]
        if state == "completed" and row.get("reused_from"):
            # Reused another job's published outputs (ResultReused): no post, no output set of its own.
            result.completed += 1
            extra = len(mine) + max(0, len(completions) - 1) + len(keys_under(settings, f"published/{job_id}/"))
        elif state == "completed":
            result.completed += 1
            extra = max(0, len(mine) - 1) + max(0, len(completions) - 1)
            publishes = [e for e in events if e.job_id == job_id and isinstance(e, ev.AttemptSucceeded)
                         and e.stage == "publish" and e.claim_token == row["claim_token"]]
            if len(mine) == 0:
                result.violations.append(f"{label}: completed job {job_id} was never posted")
            if len(publishes) != 1:
                result.violations.append(f"{label}: {len(publishes)} applied publish successes for {job_id}")
            else:
                stray = keys_under(settings, f"published/{job_id}/") - {o.key for o in publishes[0].outputs}
                extra += len(stray)
        else:
            (result.needs_review if state == "needs_review" else result.dead_lettered).append(label)
            extra = len(mine) + len(completions)
            if not row["reason"]:
                result.lost += 1
                result.violations.append(f"{label}: {state} job {job_id} has no reason")
        if extra:
            result.duplicates += extra
            result.violations.append(f"{label}: {extra} duplicate side effect(s) for {job_id} "
                                     f"({len(mine)} posts, {len(completions)} completions)")
        for column in ("state", "stage", "attempt", "claim_token", "error_class", "master_url"):
            if folded.get(job_id, {}).get(column) != row[column]:
                result.violations.append(f"{label}: projection {column}={row[column]!r} but the log folds to "
                                         f"{folded.get(job_id, {}).get(column)!r}")
    return result


def audit_notifications(events: list[ev.Event], posts: dict[str, list[Any]], unsigned: int,
                        settled: bool = False) -> list[str]:
    """Violations of the customer-notification promise (issue 23: exactly one successful delivery per
    event, every delivery signed) in a run's committed lifecycle events and what a receiver saw
    (`posts`: webhook-id -> the verified POSTs with it, dicts with the `status` the receiver answered
    and its wall-clock `at`, seconds; `unsigned`: POSTs whose Standard Webhooks signature did not
    verify). Pure. The promise:

    - every POST is signed (`unsigned` is 0);
    - one notification per (lifecycle event, endpoint): every `NotificationIntended` of it carries the
      same webhook-id;
    - every notification recorded delivered is recorded so exactly once, and the receiver answered
      one of its POSTs 2xx; nothing the receiver answered 2xx is left unrecorded;
    - nothing is POSTed after its delivery was recorded (its committed `NotificationDelivered`);
    - nothing is received that was never intended;
    - `settled` (the run ended with every endpoint answering 2xx): every intended notification is
      recorded delivered.
    A webhook-id answered 2xx more than once is allowed: a crash between the receiver's 2xx and the
    record resends it with the same id, for the receiver to dedupe (the Standard Webhooks convention).
    """
    violations = [f"{unsigned} POST(s) not signed with the endpoint's secret"] if unsigned else []
    delivered: dict[str, list[ev.Event]] = {}
    intended: dict[str, set[tuple[str, str]]] = {}
    notification: dict[tuple[str, str], set[str]] = {}
    for event in events:
        if isinstance(event, ev.NotificationDelivered):
            delivered.setdefault(event.delivery_id, []).append(event)
        elif isinstance(event, ev.NotificationIntended):
            source = (event.source_dedup_key, event.endpoint_id)
            intended.setdefault(event.delivery_id, set()).add(source)
            notification.setdefault(source, set()).add(event.delivery_id)
    for (source, endpoint), ids in notification.items():
        if len(ids) != 1:
            violations.append(f"{source} to {endpoint}: {len(ids)} webhook-ids {sorted(ids)}")
    for msg_id, records in delivered.items():
        if len(records) != 1:
            violations.append(f"{msg_id}: {len(records)} NotificationDelivered committed")
        received = posts.get(msg_id, [])
        if not received:
            violations.append(f"{msg_id}: recorded delivered, never received")
        elif not any(_ok(post) for post in received):
            violations.append(f"{msg_id}: recorded delivered, never answered 2xx")
        done_at = min(r.occurred_at for r in records).timestamp()
        late = [post for post in received if isinstance(post, dict) and post.get("at", 0.0) > done_at]
        if late:
            violations.append(f"{msg_id}: {len(late)} POST(s) after its delivery was recorded")
    for msg_id, received in posts.items():
        if msg_id not in delivered and any(_ok(post) for post in received):
            violations.append(f"{msg_id}: answered 2xx, not recorded delivered")
        if msg_id not in intended:
            violations.append(f"{msg_id}: received without a NotificationIntended")
    if settled:
        violations += [f"{msg_id}: intended, never recorded delivered" for msg_id in intended if msg_id not in delivered]
    return violations


def _ok(post: Any) -> bool:
    """Whether the receiver answered this POST 2xx (a POST without a recorded status counts as 2xx)."""
    status = post.get("status", 200) if isinstance(post, dict) else 200
    return 200 <= status < 300

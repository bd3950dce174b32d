"""The HTTP intake's service: the state of one intake process and its PostgreSQL and Kafka calls.

`IntakeService` holds a writer connection pool, the object store, one idempotent producer, the
storage gauge, the claim keeper and a thread pool for blocking calls. `admit` reads the counts
and claims the upload in one transaction under the admission lock (the rules are
`domain/policy/admission.py` `admission`); `renew`, `published` and `release` keep the claim's row
(`producers/intake_claims.py`); `publish` sends the `UploadCompleted`. The route is
`producers/http_intake.py`; the request body is `producers/intake_body.py`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import psycopg
import structlog
from psycopg_pool import ConnectionPool

from domain import events as ev
from domain.codec import default_codec
from domain.errors import ServiceUnavailable
from domain.lifecycle import TERMINAL_STATES
from domain.policy.admission import Refusal, admission
from producers.intake_claims import Claim, ClaimKeeper
from tapeline import kafka
from tapeline.objectstore import ObjectStore, StorageGauge
from tapeline.postgres import session_options, q
from tapeline.rows import tier_backlogs
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.http_intake")


class IntakeService:
    """The state of one intake process: a writer connection pool (the login role, not the read
    API's read-only role: it writes `intake_uploads`), the object store, one idempotent producer,
    the storage gauge and a thread pool for blocking calls. `open()` before use, `close()` after."""

    def __init__(self, settings: Settings, fence: Callable[[], Refusal | None] | None = None) -> None:
        self.settings = settings
        self.fence = fence
        """Why this region takes no upload now (`regions/authority.py` `IntakeFence.refusal`: 503
        `region_fenced` while another region holds the job history), or None; unset: never fenced."""
        self.store = ObjectStore(settings)
        self.gauge = StorageGauge(settings, self.store)
        self.pool = ConnectionPool(settings.database_url, min_size=1, max_size=8, open=False, timeout=10.0,
                                   name="tapeline-intake",
                                   kwargs={"autocommit": True, "row_factory": psycopg.rows.dict_row,
                                           "connect_timeout": 10,
                                           "options": session_options(settings.db_schema)})
        self.executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="intake")
        self._producer = None
        self._partitions: int | None = None
        self._producer_lock = threading.Lock()
        self.codec = default_codec()
        self.keeper = ClaimKeeper(settings)
        self.starting: Counter[str] = Counter()
        """Per submitter, its requests whose bodies are being read before admission (not yet moving);
        changed on the event loop only."""

    def open(self) -> None:
        self.pool.open(wait=False)
        self.keeper.start()

    def close(self) -> None:
        self.keeper.stop()
        self.pool.close()
        if self._producer is not None:
            self._producer.flush(10.0)
        self.executor.shutdown(wait=False, cancel_futures=True)

    def fenced(self) -> Refusal | None:
        """The refusal every upload gets while this region is fenced (`fence`), else None. Blocking:
        at most one read of the region epochs per `region_check_interval_s`."""
        return self.fence() if self.fence is not None else None

    async def call(self, fn, *args):
        """Run a blocking call on the intake's own threads. An upload takes one only for a call of its
        own (admission, a part already received going to S3, the publish), never to wait for its body."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # -- PostgreSQL ------------------------------------------------------------------------------

    def row_by_key(self, submitter: str, key: str) -> dict[str, Any] | None:
        """The `intake_uploads` row of (submitter, key), with `abandoned` (an uploading claim that
        lapsed) and `expired` (published longer ago than the key's retention), or None."""
        with self.pool.connection() as conn:
            return conn.execute(q("intake_upload_by_key"), self._key_params(submitter, key)).fetchone()

    def _key_params(self, submitter: str, key: str) -> dict[str, Any]:
        return {"submitter": submitter, "key": key, "lease_s": self.settings.intake_claim_lease_s,
                "retention_s": self.settings.intake_key_retention_s}

    def projected_upload(self, upload_id: str) -> dict[str, Any] | None:
        """The projection's `uploads` row of `upload_id` (its sha256 and size), or None."""
        with self.pool.connection() as conn:
            return conn.execute(q("upload_by_id"), {"upload_id": upload_id}).fetchone()

    def admit(self, submitter: str, key: str | None, upload_id: str, priority: str, profile: str,
              filename: str) -> Refusal | Claim | bool:
        """Admission then claim, in one transaction under the admission lock. Returns a `Refusal`,
        the `Claim` when the upload is claimed, or False when its Idempotency-Key was claimed first
        by another request (read its row and replay). Lapsed claims and expired keys are deleted
        first (`expire`), so the key of an intake that died mid-upload can be claimed again."""
        storage = self.gauge.bytes() if self.settings.storage_limit_bytes is not None else None
        window = self.settings.intake_throughput_window_s
        counted = {"window_s": self.settings.intake_timeout_s, "lease_s": self.settings.intake_claim_lease_s}
        with self.pool.connection() as conn, conn.transaction():
            conn.execute(q("intake_admission_lock"))
            self.expire(conn)
            if key is not None and conn.execute(q("intake_upload_by_key"), self._key_params(submitter, key)).fetchone():
                return False
            backlog = tier_backlogs(conn.execute(q("tier_backlog"), {"window_s": window}).fetchall(), window)
            pending = {r["tier"]: int(r["pending"]) for r in conn.execute(q("intake_pending_by_tier"), counted)}
            in_flight = int(conn.execute(q("submitter_in_flight"), {"submitter": submitter, **counted,
                                                                    "ended_states": sorted(TERMINAL_STATES)}
                                         ).fetchone()["in_flight"])
            held = int(conn.execute(q("submitter_tier_load"), {"submitter": submitter, "tier": priority, **counted,
                                                               "ended_states": sorted(TERMINAL_STATES)}
                                    ).fetchone()["held"])
            refusal = admission(priority, backlog, pending, in_flight, storage, submitter, self.settings, held)
            if refusal is not None:
                return refusal
            claimed = conn.execute(q("intake_upload_claim"), {
                "upload_id": upload_id, "job_id": ev.job_id_for(upload_id), "submitter": submitter, "key": key,
                "priority": priority, "profile": profile, "filename": filename}).fetchone()
            return Claim(upload_id, claimed["created_at"], keyed=key is not None) if claimed else False

    def expire(self, conn: psycopg.Connection) -> None:
        """Delete lapsed claims (uploading, not renewed for `intake_claim_lease_s`: their intake
        died mid-upload) and published rows older than `intake_key_retention_s`. Under the
        admission lock, in the caller's transaction."""
        gone = [row["state"] for row in conn.execute(q("intake_uploads_expire"), {
            "lease_s": self.settings.intake_claim_lease_s,
            "retention_s": self.settings.intake_key_retention_s}).fetchall()]
        if gone:
            log.info("intake rows expired", abandoned_claims=gone.count("uploading"),
                     expired_keys=gone.count("published"))

    def renew(self, claim: Claim) -> bool:
        """Renew `claim` now (the check before publishing); False when it is gone (it lapsed, and
        admission deleted it or another request took its key over)."""
        with self.pool.connection() as conn:
            return conn.execute(q("intake_upload_renew"), {"upload_id": claim.upload_id,
                                                           "claimed_at": claim.claimed_at}).fetchone() is not None

    def published(self, claim: Claim, sha256: str, size: int, response: dict[str, Any]) -> None:
        """Record `claim`'s upload as published with the response its key answers from now on."""
        with self.pool.connection() as conn:
            conn.execute(q("intake_upload_published"), {"upload_id": claim.upload_id, "claimed_at": claim.claimed_at,
                                                        "sha256": sha256, "size_bytes": size,
                                                        "response": json.dumps(response)})

    def release(self, claim: Claim) -> None:
        """Delete `claim`'s row (the upload failed before it was published); never another claim's."""
        self.keeper.discard(claim)
        with self.pool.connection() as conn:
            conn.execute(q("intake_upload_release"), {"upload_id": claim.upload_id, "claimed_at": claim.claimed_at})

    # -- Kafka -----------------------------------------------------------------------------------

    def publish(self, event: ev.UploadCompleted, timeout_s: float = 30.0) -> None:
        """Publish `event` keyed by upload id, as `producers.submit.publish` does, through this
        process's idempotent producer; waits for its own acknowledgement. Raises `ServiceUnavailable`."""
        with self._producer_lock:
            if self._producer is None:
                self._producer = kafka.idempotent_producer(self.settings)
                self._partitions = kafka.partition_count(self._producer, self.settings.uploads_topic)
        producer, topic = self._producer, self.settings.uploads_topic
        done, errors = threading.Event(), []

        def delivered(err, _msg) -> None:
            if err:
                errors.append(str(err))
            done.set()

        producer.produce(topic, key=event.upload_id.encode(), value=self.codec.encode(event.to_record()),
                         partition=kafka.partition_for(event.upload_id, self._partitions), on_delivery=delivered)
        deadline = time.monotonic() + timeout_s
        while not done.is_set():
            producer.poll(0.05)  # serves every thread's delivery callbacks, ours included
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"Kafka at {self.settings.kafka_bootstrap} did not acknowledge the upload "
                                         f"within {timeout_s:.0f} s")
        if errors:
            raise ServiceUnavailable(f"Kafka refused the upload: {errors[0]}")

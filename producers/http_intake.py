"""The HTTP intake: `POST /uploads` on `tapeline serve` (issue 9).

A client streams a source as the request body; the intake streams it on to object storage
(`ObjectStore.upload_stream`: multipart above the chunk size, sha256 while streaming, never the
whole file in memory, stored as `normalised_content_type`), reads the stored object back (its size and
sha256 must be the body's, else 502 `storage_mismatch` and nothing is published), publishes the
same `UploadCompleted` as `tapeline submit`, then answers
202 `{job_id, upload_id, status_url}` with a `Location` header (the job's read-API URL).

    POST /uploads?priority=archive&profile=default&filename=clip.mp4
    Authorization: Bearer <token>          (TAPELINE_INTAKE_TOKENS maps tokens to submitter names)
    Idempotency-Key: <any string, at most 255 characters>   (optional)

A body must keep the pace of `domain/policy/body_rate.py` (`intake_body_*` settings): a client
that trickles or stops gets 408 `body_too_slow` and its slot is released.

Admission runs before a byte is stored, in one PostgreSQL transaction under an advisory lock, so
concurrent requests are counted exactly: the pure rules are `domain/policy/admission.py`
(`admission`: storage guard 507, the tier's capacity and the reserve for higher tiers 503, the
submitter's jobs in flight 429, each with `Retry-After` from the recent completion rate;
`check_request`: the parameters, 422 and 413). Every refusal is an answer given before anything was
stored. The daily quota stays with the intake processor (`JobRejected(quota_exceeded)`).

Idempotency: a request with an `Idempotency-Key` gets upload id `uuid5(IDEMPOTENCY_NAMESPACE,
submitter + key)`, so its job id is fixed by the key. Admission claims the row
`intake_uploads(submitter, key)`; a later request with the same key (even while the first is still
streaming) reads its own body through sha256 without storing it, waits for the first to finish and
answers the first's response (202, same body). Different parameters or a different body under the
key -> 422; the first request failed before publishing -> 409 (send again).

Claims are leases: while a request runs, the process's `ClaimKeeper` renews its row every third
of `intake_claim_lease_s` (30 s). An intake killed mid-upload leaves a row in `uploading` that
nobody renews; once the lease has passed it no longer counts against any capacity, a request with
its key is admitted again (same upload id, so the same job id) and admission deletes it. The
claim's identity is its `created_at`: the dead intake's row can only be released or renewed by its
own claim, a request whose claim lapsed does not publish (it renews once more right before, and
gives up when the row is gone), and each claim stores its body under its own object key.
Published rows answer their key for `intake_key_retention_s` (a day), then admission deletes them;
the key still maps to the same upload id, so a later retry is the same job to the pipeline.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator

import psycopg
import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from psycopg_pool import ConnectionPool
from starlette.requests import ClientDisconnect

from producers.submit import upload_completed
from tapeline.read import TierBacklog, tier_backlog
from tapeline.postgres import check_schema_name, q
from domain import events as ev
from domain.codec import default_codec
from tapeline import kafka
from domain.errors import ServiceUnavailable, StorageError
from tapeline.objectstore import ObjectStore, StorageGauge, normalised_content_type
from domain.policy.admission import Refusal, admission, body_reuse, check_request, key_reuse, retry_after  # noqa: F401 (retry_after: re-exported)
from domain.policy.body_rate import BodyRate
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.http_intake")
IDEMPOTENCY_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "tapeline:intake:idempotency-key")
"""Namespace of the upload ids derived from (submitter, Idempotency-Key)."""
QUEUED_CHUNKS = 16
"""Request-body chunks (about 64 KiB each) held between the HTTP reader and the S3 writer."""


def upload_id_for_key(submitter: str, key: str) -> str:
    """The upload id of (submitter, Idempotency-Key): the same pair always names the same upload."""
    return str(uuid.uuid5(IDEMPOTENCY_NAMESPACE, f"{submitter}\x00{key}"))


@dataclass
class Claim:
    """An admitted upload's `intake_uploads` row: its upload id and `created_at` (the claim's
    identity: a row deleted after it lapsed and claimed again has another). `lost` is set by the
    `ClaimKeeper` when a renewal finds the row gone."""

    upload_id: str
    claimed_at: Any  # datetime, as PostgreSQL returned it (compared exactly)
    keyed: bool = False  # made for an Idempotency-Key (its upload id is derived from the key)
    lost: bool = False

    @property
    def object_key_prefix(self) -> str:
        """`uploads/{upload_id}/{claim}/`: the claim's own place for its source object (`claim` is
        `created_at` in microseconds since the epoch), so a later claim of the same key (after this
        one lapsed, or after the key's retention) never overwrites a source a job was made from."""
        return f"uploads/{self.upload_id}/{round(self.claimed_at.timestamp() * 1_000_000)}/"


class ClaimKeeper:
    """Renews every live claim of one intake process in ONE `UPDATE` every third of
    `intake_claim_lease_s`, on its own thread and its own connection: never queued behind the
    uploads, which hold the request threads for their whole duration (with them, renewals starved
    once ~64 uploads were in flight and healthy claims lapsed). A claim whose row is gone (it
    lapsed and was deleted or taken over) gets `lost`. A failed renewal (the database down) is
    logged and retried at the next tick: a claim lapses only after a whole lease without one.
    `start()` once, `add`/`discard` per upload, `stop()` at shutdown."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.claims: dict[tuple[str, Any], Claim] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="intake-claim-keeper", daemon=True)
        self._conn: psycopg.Connection | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def add(self, claim: Claim) -> None:
        with self._lock:
            self.claims[(claim.upload_id, claim.claimed_at)] = claim

    def discard(self, claim: Claim) -> None:
        with self._lock:
            self.claims.pop((claim.upload_id, claim.claimed_at), None)

    def _run(self) -> None:
        interval = self.settings.intake_claim_lease_s / 3
        while not self._stop.wait(interval):
            try:
                self.renew_all()
            except psycopg.Error as exc:
                log.warning("upload claims not renewed", claims=len(self.claims), error=str(exc))
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
        if self._conn is not None:
            self._conn.close()

    def renew_all(self) -> None:
        """Renew every claim held now; mark those whose row is gone `lost` and forget them."""
        with self._lock:
            held = list(self.claims.values())
        if not held:
            return
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.settings.database_url, autocommit=True, connect_timeout=10,
                                         options=f"-c search_path={check_schema_name(self.settings.db_schema)}")
        alive = {(row[0], row[1]) for row in self._conn.execute(q("intake_uploads_renew"), {
            "upload_ids": [c.upload_id for c in held], "claimed_ats": [c.claimed_at for c in held]})}
        for claim in held:
            if (claim.upload_id, claim.claimed_at) in alive:
                continue
            with self._lock:  # a claim discarded meanwhile was published or released: not lost
                still_held = self.claims.pop((claim.upload_id, claim.claimed_at), None) is not None
            if still_held:
                claim.lost = True
                log.warning("upload claim lost (it lapsed and its row is gone)", upload_id=claim.upload_id)


def refusal_response(refusal: Refusal) -> JSONResponse:
    """The HTTP answer of a `Refusal`: its status, its JSON body and its `Retry-After` header."""
    return JSONResponse(refusal.body(), status_code=refusal.status, headers=refusal.headers())


class _QueueReader:
    """A file-like `read(size)` over chunks handed over by the event loop (`None` ends the body);
    `fail(exc)` makes the next read raise, so boto3 aborts the upload."""

    def __init__(self, chunks: "queue.Queue[bytes | None]") -> None:
        self.chunks = chunks
        self.buffer = bytearray()
        self.eof = False
        self.error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        self.error = error
        try:
            self.chunks.put_nowait(None)
        except queue.Full:
            pass

    def read(self, size: int = -1) -> bytes:
        while not self.eof and (size < 0 or len(self.buffer) < size):
            if self.error is not None:
                raise OSError(f"request body failed: {self.error}")
            try:
                chunk = self.chunks.get(timeout=1.0)
            except queue.Empty:
                continue
            if chunk is None:
                self.eof = True
            else:
                self.buffer += chunk
        if self.error is not None:
            raise OSError(f"request body failed: {self.error}")
        n = len(self.buffer) if size < 0 else min(size, len(self.buffer))
        out = bytes(self.buffer[:n])
        del self.buffer[:n]
        return out


class BodyTooLarge(Exception):
    """The request body passed `max_upload_bytes`."""


class BodyTooSlow(Exception):
    """The request body did not keep the pace of `domain/policy/body_rate.py` (answered 408)."""


class IntakeService:
    """The state of one intake process: a writer connection pool (the login role, not the read
    API's read-only role: it writes `intake_uploads`), the object store, one idempotent producer,
    the storage gauge and a thread pool for blocking calls. `open()` before use, `close()` after."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = ObjectStore(settings)
        self.gauge = StorageGauge(settings, self.store)
        self.pool = ConnectionPool(settings.database_url, min_size=1, max_size=8, open=False, timeout=10.0,
                                   name="tapeline-intake",
                                   kwargs={"autocommit": True, "row_factory": psycopg.rows.dict_row,
                                           "connect_timeout": 10,
                                           "options": f"-c search_path={check_schema_name(settings.db_schema)}"})
        self.executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="intake")
        self._producer = None
        self._partitions: int | None = None
        self._producer_lock = threading.Lock()
        self.codec = default_codec()
        self.keeper = ClaimKeeper(settings)

    def open(self) -> None:
        self.pool.open(wait=False)
        self.keeper.start()

    def close(self) -> None:
        self.keeper.stop()
        self.pool.close()
        if self._producer is not None:
            self._producer.flush(10.0)
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def call(self, fn, *args):
        """Run a blocking call on the intake's own threads (uploads hold one each for their duration)."""
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
            backlog = tier_backlog(conn, window)
            pending = {r["tier"]: int(r["pending"]) for r in conn.execute(q("intake_pending_by_tier"), counted)}
            in_flight = int(conn.execute(q("submitter_in_flight"), {"submitter": submitter, **counted}
                                         ).fetchone()["in_flight"])
            refusal = admission(priority, backlog, pending, in_flight, storage, submitter, self.settings)
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

    # -- the request body ------------------------------------------------------------------------

    async def _hand_over(self, chunks: queue.Queue, item: bytes | None, upload: asyncio.Future) -> None:
        while True:
            try:
                chunks.put_nowait(item)
                return
            except queue.Full:
                if upload.done():
                    return  # the writer stopped (failed): awaiting it raises
                await asyncio.sleep(0.002)

    async def stream_to_store(self, request: Request, key: str, content_type: str) -> tuple[str, int]:
        """Stream the request body to `key`; (hex sha256, bytes). At most `QUEUED_CHUNKS` chunks plus
        one multipart part are in memory. Raises `BodyTooLarge`, `ClientDisconnect` or `StorageError`."""
        chunks: queue.Queue = queue.Queue(maxsize=QUEUED_CHUNKS)
        reader = _QueueReader(chunks)
        upload = asyncio.ensure_future(self.call(self.store.upload_stream, reader, key, content_type))
        received, limit = 0, self.settings.max_upload_bytes
        try:
            async for chunk in self.body_chunks(request):
                if upload.done():
                    break  # the writer failed: awaiting it raises
                if not chunk:
                    continue
                received += len(chunk)
                if received > limit:
                    raise BodyTooLarge(f"the body passed max_upload_bytes = {limit}")
                await self._hand_over(chunks, chunk, upload)
            await self._hand_over(chunks, None, upload)
        except BaseException as exc:
            reader.fail(exc)
            try:
                await upload  # aborted by the failed read: its multipart upload is abandoned
            except Exception as aborted:  # noqa: BLE001 (the body's error, raised below, is the one to report)
                log.info("upload to object storage aborted", key=key, reason=str(aborted))
            raise
        return await upload

    async def hash_body(self, request: Request) -> tuple[str, int]:
        """Read the request body through sha256 without keeping it: (hex sha256, bytes), at the pace
        `body_chunks` asks. Raises `BodyTooLarge` past `max_upload_bytes`, `BodyTooSlow`, `ClientDisconnect`."""
        digest, size = hashlib.sha256(), 0
        async for chunk in self.body_chunks(request):
            digest.update(chunk)
            size += len(chunk)
            if size > self.settings.max_upload_bytes:
                raise BodyTooLarge(f"the body passed max_upload_bytes = {self.settings.max_upload_bytes}")
        return digest.hexdigest(), size

    async def body_chunks(self, request: Request) -> AsyncIterator[bytes]:
        """The request body's chunks, each awaited no longer than `BodyRate.read_deadline` allows
        (`domain/policy/body_rate.py`, from the `intake_body_*` settings). Raises `BodyTooSlow` when a
        chunk does not come in time (the caller answers 408 and releases the upload's slot),
        `ClientDisconnect` when the client went away."""
        rate = BodyRate(self.settings.intake_body_timeout_s, self.settings.intake_body_min_rate_bytes_s,
                        self.settings.intake_body_idle_timeout_s)
        loop = asyncio.get_running_loop()
        chunks = request.stream().__aiter__()
        started = last = loop.time()
        received = 0
        while True:
            wait_s = rate.read_deadline(started, last, received) - loop.time()
            try:
                chunk = await asyncio.wait_for(chunks.__anext__(), timeout=max(0.0, wait_s))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise BodyTooSlow(rate.explain(received, loop.time() - started)) from None
            last = loop.time()
            received += len(chunk)
            yield chunk


def _param(request: Request, name: str, default: str | None) -> str | None:
    return request.query_params.get(name) or request.headers.get(f"x-tapeline-{name}") or default


def intake_router(service: IntakeService) -> APIRouter:
    """`POST /uploads` over `service` (see the module docstring)."""
    settings = service.settings
    router = APIRouter(tags=["intake"])

    def submitter_of(request: Request) -> str | None:
        scheme, _, presented = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not presented:
            return None
        for token, name in settings.intake_tokens.items():
            if hmac.compare_digest(token.encode(), presented.strip().encode()):
                return name
        return None

    def accepted(response: dict[str, Any], replayed: bool = False) -> JSONResponse:
        headers = {"Location": response["status_url"]}
        if replayed:
            headers["Idempotent-Replayed"] = "true"
        return JSONResponse(response, status_code=202, headers=headers)

    def problem(status: int, error: str, reason: str, retry_after_s: int | None = None) -> JSONResponse:
        return refusal_response(Refusal(status, error, reason, retry_after_s))

    async def replay(request: Request, row: dict[str, Any], priority: str, profile: str, filename: str) -> Response:
        """A request under a key someone already used: the first's response, or why not."""
        reused = key_reuse(row, priority, profile, filename)
        if reused is not None:
            return refusal_response(reused)
        try:
            sha, size = await service.hash_body(request)
        except ClientDisconnect:
            return problem(400, "client_disconnected", "the request body ended early")
        except BodyTooSlow as exc:
            return problem(408, "body_too_slow", str(exc))
        except BodyTooLarge as exc:
            return problem(413, "limits_exceeded", str(exc))
        deadline = time.monotonic() + settings.intake_idempotency_wait_s
        while row is not None and row["state"] == "uploading" and not row["abandoned"]:
            if time.monotonic() > deadline:
                return problem(409, "idempotency_key_in_use", "the first request with this Idempotency-Key is "
                                                               "still uploading; retry later", 5)
            await asyncio.sleep(0.1)
            row = await service.call(service.row_by_key, row["submitter"], row["idempotency_key"])
        if row is None or row["abandoned"]:
            return problem(409, "idempotency_key_failed", "the first request with this Idempotency-Key failed before "
                                                           "it was published; send the upload again", 1)
        reused = body_reuse(row["sha256"], row["size_bytes"], sha, size)
        if reused is not None:
            return refusal_response(reused)
        return accepted(row["response"], replayed=True)

    @router.post("/uploads", status_code=202, responses={
        202: {"description": "Stored and published: `{job_id, upload_id, status_url}`, `Location` the status URL"},
        401: {"description": "No or unknown API token"}, 409: {"description": "Idempotency-Key's first request failed"},
        408: {"description": "The body came too slowly (intake_body_* settings); the upload's slot was released"},
        413: {"description": "Larger than max_upload_bytes"}, 422: {"description": "Bad parameters or key reuse"},
        502: {"description": "Object storage did not keep the body as sent (size or sha256 read back differ)"},
        429: {"description": "The submitter's jobs in flight are at its cap (Retry-After)"},
        503: {"description": "The tier is over capacity (Retry-After) or a service is down"},
        507: {"description": "Object storage is at its limit"}})
    async def post_upload(request: Request) -> Response:
        """Stream the request body to object storage as a new upload and publish `UploadCompleted`.

        Query parameters (or headers `X-Tapeline-<name>`): `priority` (archive, standard, index;
        default standard), `profile` (default `default`), `filename` (default `source`).

        The source is stored with `normalised_content_type(Content-Type)` (video/audio types kept,
        anything else `application/octet-stream`) and read back before the publish: a stored size
        or sha256 other than the body's is 502 `storage_mismatch`, nothing published."""
        submitter = submitter_of(request)
        if submitter is None:
            return problem(401, "unauthorized", "an API token is required: Authorization: Bearer <token> "
                                                "(one of TAPELINE_INTAKE_TOKENS)")
        priority = _param(request, "priority", "standard")
        profile = _param(request, "profile", "default")
        filename = _param(request, "filename", "source")
        key = request.headers.get("idempotency-key")
        invalid = check_request(priority, profile, filename, request.headers.get("content-length"), key, settings)
        if invalid is not None:
            return refusal_response(invalid)
        if key is not None:
            row = await service.call(service.row_by_key, submitter, key)
            if row is not None and not (row["abandoned"] or row["expired"]):  # `admit` deletes those
                return await replay(request, row, priority, profile, filename)
        upload_id = upload_id_for_key(submitter, key) if key is not None else str(uuid.uuid4())
        verdict = await service.call(service.admit, submitter, key, upload_id, priority, profile, filename)
        if verdict is False:  # another request with this key was admitted between our look-up and claim
            row = await service.call(service.row_by_key, submitter, key)
            if row is None:  # ... and released it again (it failed) before we looked: the key is free
                return problem(409, "idempotency_key_failed", "a request with this Idempotency-Key failed just "
                                                               "now before it was published; send the upload again", 1)
            return await replay(request, row, priority, profile, filename)
        if isinstance(verdict, Refusal):
            log.info("upload refused", submitter=submitter, priority=priority, status=verdict.status,
                     error=verdict.error, retry_after_s=verdict.retry_after_s)
            return refusal_response(verdict)
        claim: Claim = verdict
        service.keeper.add(claim)
        try:
            return await store_and_publish(request, claim, submitter, priority, profile, filename)
        finally:
            service.keeper.discard(claim)

    async def store_and_publish(request: Request, claim: Claim, submitter: str, priority: str, profile: str,
                                filename: str) -> Response:
        """The claimed upload: stream the body to the claim's own key, check the claim is still ours,
        publish `UploadCompleted`, record the response. Any failure before the publish releases the
        claim (its key can be sent again)."""
        upload_id = claim.upload_id
        object_key = f"{claim.object_key_prefix}{filename}"
        content_type = normalised_content_type(request.headers.get("content-type"))
        try:
            sha, size = await service.stream_to_store(request, object_key, content_type)
            if size == 0:
                await service.call(service.store.delete, object_key)
                await service.call(service.release, claim)
                return problem(422, "invalid_input", "the body is empty; send the video's bytes")
            # The event declares what was stored, not what was sent: read the object back first.
            mismatch = await service.call(service.store.stored_mismatch, object_key, size, sha)
            if mismatch is not None:
                await service.call(service.store.delete, object_key)
                await service.call(service.release, claim)
                log.error("stored upload differs from the body sent; nothing published", upload_id=upload_id,
                          key=object_key, mismatch=mismatch)
                return problem(502, "storage_mismatch", f"object storage did not keep the upload as sent "
                                                        f"({mismatch}); nothing was published, send it again")
            # Fencing: renew the claim now; if it lapsed and its row is gone (deleted by an admission,
            # perhaps claimed again by a retry of the key), another request may own the upload: never
            # publish over it. A renewed claim cannot lapse during the publish (the keeper renews it).
            if claim.lost or not await service.call(service.renew, claim):
                raise ServiceUnavailable("this upload's claim lapsed (not renewed for intake_claim_lease_s) and "
                                         "was given up; send it again")
            # A key names one upload for good: once its row has gone (the key's retention passed, or
            # a claim lapsed after its publish), the projection's `uploads` row still knows the body.
            known = await service.call(service.projected_upload, upload_id) if claim.keyed else None
            if known is not None:  # nothing to publish: the job exists; our copy of the body goes
                await service.call(service.store.delete, object_key)
                reused = body_reuse(known["sha256"], known["size_bytes"], sha, size)
                if reused is not None:
                    await service.call(service.release, claim)
                    return refusal_response(reused)
                response = {"job_id": known["job_id"], "upload_id": upload_id,
                            "status_url": f"/api/jobs/{known['job_id']}"}
                service.keeper.discard(claim)
                await service.call(service.published, claim, sha, size, response)
                return accepted(response, replayed=True)
            event = upload_completed(settings, upload_id, object_key, size, sha, filename, priority, submitter,
                                     recorded_by=f"http-intake@{settings.instance_id}", profile=profile)
            await service.call(service.publish, event)
        except BodyTooLarge as exc:
            await service.call(service.release, claim)
            return problem(413, "limits_exceeded", str(exc))
        except BodyTooSlow as exc:
            await service.call(service.release, claim)
            log.info("upload cut off: its body came too slowly", upload_id=upload_id, reason=str(exc))
            return problem(408, "body_too_slow", str(exc))
        except ClientDisconnect:
            await service.call(service.release, claim)
            log.info("client went away mid-upload", upload_id=upload_id)
            return problem(400, "client_disconnected", "the request body ended early")
        except (StorageError, ServiceUnavailable) as exc:
            await service.call(service.release, claim)
            log.warning("upload failed", upload_id=upload_id, error=str(exc))
            return problem(503, "unavailable", str(exc), int(settings.intake_retry_after_min_s) or 1)
        except BaseException:
            await asyncio.shield(service.call(service.release, claim))
            raise
        service.keeper.discard(claim)  # published: its row is no longer a claim to renew
        job_id = event.job_id
        response = {"job_id": job_id, "upload_id": upload_id, "status_url": f"/api/jobs/{job_id}"}
        await service.call(service.published, claim, sha, size, response)
        log.info("upload accepted", job_id=job_id, upload_id=upload_id, submitter=submitter, priority=priority,
                 size_bytes=size)
        return accepted(response)

    return router

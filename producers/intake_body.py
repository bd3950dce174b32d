"""The HTTP intake's request body: read on the event loop at the pace `domain/policy/body_rate.py`
asks, and either streamed on to object storage or hashed without being kept.

`RequestBody` reads a body chunk by chunk, each awaited no longer than the pace rule allows.
`until_moving` reads (and keeps) the first chunks until the body is moving (`BodyRate.moving`) or
ended: the route admits an upload, so it takes a tier slot, only after that, and a socket that
trickles or stops before it holds no slot and no thread (issue 44 item 3). `stream_to_store` then
sends the body to object storage: whole parts (`multipart_chunk_bytes`) are gathered on the event
loop and only a full part is handed to an intake thread (`ObjectStore.put_part`), so no thread ever
waits for a client's bytes; `hash_body` reads a body through sha256 only (a request under an
Idempotency-Key already used). A body past `max_upload_bytes` raises `BodyTooLarge` (413); a client
that trickles or stops raises `BodyTooSlow` (408; the caller releases its slot, if it had one).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from typing import Any, AsyncIterator, Awaitable, Callable

import structlog
from fastapi import Request

from domain.policy.body_rate import BodyRate
from tapeline.objectstore import ObjectStore
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.http_intake")
S3_MAX_PARTS = 10_000
"""Parts of one multipart upload S3 accepts (the AWS S3 limits page): the part size grows with
`max_upload_bytes` so the largest allowed body fits."""


class BodyTooLarge(Exception):
    """The request body passed `max_upload_bytes`."""


class BodyTooSlow(Exception):
    """The request body did not keep the pace of `domain/policy/body_rate.py` (answered 408)."""


class RequestBody:
    """One request's body, read on the event loop at the pace of `BodyRate` (the `intake_body_*`
    settings). `until_moving()` first, then `chunks()` once. Reads raise `BodyTooSlow` when a chunk
    does not come in time, `BodyTooLarge` past `max_upload_bytes`, `ClientDisconnect` when the client
    went away."""

    def __init__(self, request: Request, settings: Settings) -> None:
        self.rate = BodyRate(settings.intake_body_timeout_s, settings.intake_body_min_rate_bytes_s,
                             settings.intake_body_idle_timeout_s, settings.intake_body_rate_window_s)
        self.limit = settings.max_upload_bytes
        self._stream = request.stream().__aiter__()
        self._loop = asyncio.get_running_loop()
        self.started = self._last = self._loop.time()
        self.received = 0
        self.ended = False
        self._kept: deque[bytes] = deque()
        self._arrivals: deque[tuple[float, int]] = deque([(self.started, 0)])

    async def _read(self) -> bytes | None:
        """The next non-empty chunk, or None at the end of the body."""
        while not self.ended:
            wait_s = self.rate.read_deadline(self.started, self._last, self.received) - self._loop.time()
            try:
                chunk = await asyncio.wait_for(self._stream.__anext__(), timeout=max(0.0, wait_s))
            except StopAsyncIteration:
                self.ended = True
                return None
            except asyncio.TimeoutError:
                raise BodyTooSlow(self.rate.explain(self.received, self._loop.time() - self.started)) from None
            self._last = self._loop.time()
            self.received += len(chunk)
            if self.received > self.limit:
                raise BodyTooLarge(f"the body passed max_upload_bytes = {self.limit}")
            if chunk:
                return chunk
        return None

    async def until_moving(self) -> None:
        """Read, keeping the chunks for `chunks()`, until the body is moving (`BodyRate.moving`) or
        ended. Holds at most `BodyRate.window_bytes` plus one chunk (about 64 KiB) in memory."""
        while not self.rate.moving(self._arrivals, self.ended):
            chunk = await self._read()
            if chunk is None:
                continue  # ended: moving now
            self._kept.append(chunk)
            self._arrivals.append((self._last, self.received))
            while self._arrivals[0][0] < self._last - self.rate.window_s:
                self._arrivals.popleft()  # out of every window still to be judged (the newest stays)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's chunks: those `until_moving` kept, then the rest as they come."""
        while self._kept:
            yield self._kept.popleft()
        while (chunk := await self._read()) is not None:
            yield chunk

    async def excused(self, work: Awaitable[Any]) -> Any:
        """Await `work` (the intake's own I/O, while the body is not read); the time it takes does
        not count against the client's pace."""
        before = self._loop.time()
        try:
            return await work
        finally:
            spent = self._loop.time() - before
            self.started += spent
            self._last += spent


async def stream_to_store(body: RequestBody, key: str, content_type: str, settings: Settings, store: ObjectStore,
                          call: Callable[..., Awaitable]) -> tuple[str, int]:
    """Stream `body` to `key`; (hex sha256, bytes). The body is gathered on the event loop into
    parts of `multipart_chunk_bytes` (larger when `max_upload_bytes` needs more than 10,000 parts);
    a body within one part is one PutObject, a longer one a multipart upload whose full parts are
    sent one at a time by `call` (`IntakeService.call`, the intake's threads) while the body waits.
    At most one part (plus a chunk) is in memory. A failure aborts the multipart upload. Raises
    `BodyTooLarge`, `BodyTooSlow`, `ClientDisconnect` or `StorageError`."""
    part_bytes = max(settings.multipart_chunk_bytes, -(-settings.max_upload_bytes // S3_MAX_PARTS))
    digest, size = hashlib.sha256(), 0
    buffer = bytearray()
    upload_id: str | None = None
    parts: list[dict[str, Any]] = []
    try:
        async for chunk in body.chunks():
            digest.update(chunk)
            size += len(chunk)
            buffer += chunk
            if len(buffer) >= part_bytes:
                if upload_id is None:
                    upload_id = await body.excused(call(store.start_multipart, key, content_type))
                part = bytes(buffer[:part_bytes])
                del buffer[:part_bytes]
                parts.append(await body.excused(call(store.put_part, key, upload_id, len(parts) + 1, part)))
        if upload_id is None:
            await call(store.put_bytes, key, bytes(buffer), content_type)
        else:
            if buffer:
                parts.append(await call(store.put_part, key, upload_id, len(parts) + 1, bytes(buffer)))
            await call(store.complete_multipart, key, upload_id, parts)
    except BaseException:
        if upload_id is not None:
            try:
                await asyncio.shield(call(store.abort_multipart, key, upload_id))
            except Exception as aborted:  # noqa: BLE001 (the body's error, raised below, is the one to report)
                log.info("multipart upload not aborted; the watchdog's cleanup will", key=key, reason=str(aborted))
        raise
    return digest.hexdigest(), size


async def hash_body(body: RequestBody) -> tuple[str, int]:
    """Read `body` through sha256 without keeping it: (hex sha256, bytes), at its pace. Raises
    `BodyTooLarge` past `max_upload_bytes`, `BodyTooSlow`, `ClientDisconnect`."""
    digest = hashlib.sha256()
    async for chunk in body.chunks():
        digest.update(chunk)
    return digest.hexdigest(), body.received

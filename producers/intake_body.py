"""The HTTP intake's request body: read at the pace `domain/policy/body_rate.py` asks, and either
streamed on to object storage or hashed without being kept.

`stream_to_store` hands the body's chunks from the event loop to a blocking S3 writer
(`ObjectStore.upload_stream`: multipart above the chunk size, sha256 while streaming, never the
whole file in memory); `hash_body` reads a body through sha256 only (a request under an
Idempotency-Key already used). A body past `max_upload_bytes` raises `BodyTooLarge` (413); a
client that trickles or stops raises `BodyTooSlow` (408, its slot is released by the caller).
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
from typing import AsyncIterator, Awaitable, Callable

import structlog
from fastapi import Request

from domain.policy.body_rate import BodyRate
from tapeline.objectstore import ObjectStore
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.http_intake")
QUEUED_CHUNKS = 16
"""Request-body chunks (about 64 KiB each) held between the HTTP reader and the S3 writer."""


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


async def _hand_over(chunks: queue.Queue, item: bytes | None, upload: asyncio.Future) -> None:
    while True:
        try:
            chunks.put_nowait(item)
            return
        except queue.Full:
            if upload.done():
                return  # the writer stopped (failed): awaiting it raises
            await asyncio.sleep(0.002)


async def stream_to_store(request: Request, key: str, content_type: str, settings: Settings, store: ObjectStore,
                          call: Callable[..., Awaitable]) -> tuple[str, int]:
    """Stream the request body to `key`; (hex sha256, bytes). At most `QUEUED_CHUNKS` chunks plus
    one multipart part are in memory; `call` runs the blocking S3 writer on the intake's threads
    (`IntakeService.call`). Raises `BodyTooLarge`, `BodyTooSlow`, `ClientDisconnect` or `StorageError`."""
    chunks: queue.Queue = queue.Queue(maxsize=QUEUED_CHUNKS)
    reader = _QueueReader(chunks)
    upload = asyncio.ensure_future(call(store.upload_stream, reader, key, content_type))
    received, limit = 0, settings.max_upload_bytes
    try:
        async for chunk in body_chunks(request, settings):
            if upload.done():
                break  # the writer failed: awaiting it raises
            if not chunk:
                continue
            received += len(chunk)
            if received > limit:
                raise BodyTooLarge(f"the body passed max_upload_bytes = {limit}")
            await _hand_over(chunks, chunk, upload)
        await _hand_over(chunks, None, upload)
    except BaseException as exc:
        reader.fail(exc)
        try:
            await upload  # aborted by the failed read: its multipart upload is abandoned
        except Exception as aborted:  # noqa: BLE001 (the body's error, raised below, is the one to report)
            log.info("upload to object storage aborted", key=key, reason=str(aborted))
        raise
    return await upload


async def hash_body(request: Request, settings: Settings) -> tuple[str, int]:
    """Read the request body through sha256 without keeping it: (hex sha256, bytes), at the pace
    `body_chunks` asks. Raises `BodyTooLarge` past `max_upload_bytes`, `BodyTooSlow`, `ClientDisconnect`."""
    digest, size = hashlib.sha256(), 0
    async for chunk in body_chunks(request, settings):
        digest.update(chunk)
        size += len(chunk)
        if size > settings.max_upload_bytes:
            raise BodyTooLarge(f"the body passed max_upload_bytes = {settings.max_upload_bytes}")
    return digest.hexdigest(), size


async def body_chunks(request: Request, settings: Settings) -> AsyncIterator[bytes]:
    """The request body's chunks, each awaited no longer than `BodyRate.read_deadline` allows
    (`domain/policy/body_rate.py`, from the `intake_body_*` settings). Raises `BodyTooSlow` when a
    chunk does not come in time (the caller answers 408 and releases the upload's slot),
    `ClientDisconnect` when the client went away."""
    rate = BodyRate(settings.intake_body_timeout_s, settings.intake_body_min_rate_bytes_s,
                    settings.intake_body_idle_timeout_s)
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

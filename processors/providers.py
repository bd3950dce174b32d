"""Publish targets: the provider interface and its two implementations.

A provider takes a job's published outputs somewhere a person sees them. Each has
`publish(request, idempotency_key) -> ProviderPost` and `lookup(idempotency_key) -> ProviderPost | None`,
and says whether it `dedupes` by idempotency key (a repeated key returns the first post instead of
making a second). The publish stage calls them under the reconcile-then-act protocol in
`processors/publish.py`; a provider never decides on its own whether a post is safe.

- `OriginProvider`: the object-store origin. "Posting" is promoting the attempt's objects to
  `published/{job_id}/` with conditional writes (`If-None-Match: *`, sha256 compared on 412) and
  writing the master playlist, whose metadata carries the idempotency key, so it dedupes by nature.
- `WebhookProvider`: an HTTP endpoint (a CMS, a social platform) that receives
  `POST {url}/posts` with an `Idempotency-Key` header and answers `GET {url}/posts/lookup`.
  Whether it dedupes is configuration (`webhook_dedupes`): most real endpoints do not promise it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import httpx

from domain import events as ev
from domain.errors import ProviderError, ProviderLookupFailed, StorageError
from tapeline.objects import PUBLISHED_PREFIX, attempt_path
from tapeline.settings import Settings
from tapeline.ports import Clock, JobStore, ObjectStorage

AUDIO_BITRATE_BPS = 128_000


@dataclass(frozen=True)
class PublishRequest:
    """What a provider is asked to publish: the job, its attempt outputs and renditions."""

    job_id: str
    outputs: list[ev.OutputFile]
    renditions: list[ev.Rendition]
    audio_playlist_key: str | None
    media_duration_s: float
    master_url: str | None = None  # set for providers after the origin (what they announce)


@dataclass(frozen=True)
class ProviderPost:
    """A post at a provider: its reference (the provider's id), a URL, and for the origin the
    published objects and renditions."""

    provider_ref: str
    url: str | None
    outputs: tuple[ev.OutputFile, ...] = ()
    renditions: tuple[ev.Rendition, ...] = ()
    created: bool = True  # False when the provider returned an existing post (deduped)


class Provider(Protocol):
    name: str
    dedupes: bool

    def publish(self, request: PublishRequest, idempotency_key: str) -> ProviderPost: ...

    def lookup(self, idempotency_key: str) -> ProviderPost | None: ...


def published_prefix(job_id: str) -> str:
    return f"{PUBLISHED_PREFIX}{job_id}/"


def promotable(outputs: list[ev.OutputFile]) -> list[ev.OutputFile]:
    """The objects publish promotes, of the outputs earlier stages handed on: the attempt-scoped
    ones (`work/{job}/{stage}/{attempt}/...`, renditions, thumbnails). Others stay where their stage
    put them: the archive stage's copy of the source and its manifest (`archive/{job}/...`) are
    preserved, never published. Pure."""
    return [o for o in outputs if attempt_path(o.key) is not None]


def relative_key(key: str) -> str:
    """`work/{job}/{stage}/{attempt}/720p/seg_00000.ts` -> `720p/seg_00000.ts`."""
    scoped = attempt_path(key)
    if scoped is None:
        raise StorageError(f"{key} is not an attempt-scoped key")
    return scoped[1]


def master_playlist(renditions: list[ev.Rendition], sizes: dict[str, int], duration_s: float, has_audio: bool) -> str:
    """The HLS master playlist (RFC 8216 section 4.3.4): one variant per rendition, audio as a group.

    BANDWIDTH is the rendition's average bitrate (bytes of its objects over the duration) plus
    audio, with 10% headroom, in bits per second.
    """
    lines = ["#EXTM3U", "#EXT-X-VERSION:3", "#EXT-X-INDEPENDENT-SEGMENTS"]
    if has_audio:
        lines.append('#EXT-X-MEDIA:TYPE=AUDIO,GROUP-ID="audio",NAME="default",DEFAULT=YES,AUTOSELECT=YES,'
                     'URI="audio/index.m3u8"')
    for rendition in renditions:
        video_bps = int(sizes.get(rendition.name, 0) * 8 / max(duration_s, 0.001))
        bandwidth = int((video_bps + (AUDIO_BITRATE_BPS if has_audio else 0)) * 1.1)
        codecs = "avc1.640028,mp4a.40.2" if has_audio else "avc1.640028"
        audio = ',AUDIO="audio"' if has_audio else ""
        lines.append(f"#EXT-X-STREAM-INF:BANDWIDTH={bandwidth},RESOLUTION={rendition.width}x{rendition.height},"
                     f'CODECS="{codecs}"{audio}')
        lines.append(f"{rendition.name}/index.m3u8")
    return "\n".join(lines) + "\n"


class OriginProvider:
    """The object-store origin: conditional writes make a repeat harmless, so it dedupes."""

    name = "origin"
    dedupes = True

    def __init__(self, store: ObjectStorage) -> None:
        self.store = store

    def publish(self, request: PublishRequest, idempotency_key: str,
                on_progress: Callable[[int, int], None] | None = None) -> ProviderPost:
        """Promote exactly `request.outputs` (sha256-checked) and write the master playlist.
        `on_progress(done, total)` runs before each object and before the master playlist (`done` =
        `total`): the caller heartbeats there (a long rendition ladder is hundreds of objects, longer
        than a lease) and checks that the job was not cancelled meanwhile (it raises to stop).

        Raises `StorageError` when an object does not match its recorded sha256 or a different
        object already sits at a published key (published bytes are never overwritten).
        """
        store, prefix = self.store, published_prefix(request.job_id)
        published, sizes = [], {}
        for done, output in enumerate(request.outputs, start=1):
            if on_progress is not None:
                on_progress(done - 1, len(request.outputs))
            body = store.get_bytes(output.key)
            if hashlib.sha256(body).hexdigest() != output.sha256:
                raise StorageError(f"{output.key} does not match the sha256 its attempt recorded")
            relative = relative_key(output.key)
            store.put_if_absent(prefix + relative, body, output.content_type)
            published.append(output.model_copy(update={"key": prefix + relative}))
            rendition = relative.split("/", 1)[0]
            sizes[rendition] = sizes.get(rendition, 0) + len(body)
        if on_progress is not None:
            on_progress(len(request.outputs), len(request.outputs))
        has_audio = request.audio_playlist_key is not None
        master = master_playlist(request.renditions, sizes, request.media_duration_s, has_audio).encode()
        master_key = prefix + "master.m3u8"
        created = store.put_if_absent(master_key, master, "application/vnd.apple.mpegurl",
                                      metadata={"idempotency-key": idempotency_key})
        published.append(ev.OutputFile(key=master_key, sha256=hashlib.sha256(master).hexdigest(),
                                       size_bytes=len(master), content_type="application/vnd.apple.mpegurl"))
        renditions = [r.model_copy(update={"playlist_key": f"{prefix}{r.name}/index.m3u8",
                                           "url": store.public_url(f"{prefix}{r.name}/index.m3u8")})
                      for r in request.renditions]
        return ProviderPost(master_key, store.public_url(master_key), tuple(published), tuple(renditions), created)

    def lookup(self, idempotency_key: str) -> ProviderPost | None:
        """The origin's post is its master playlist; the key's job id is its first part."""
        master_key = published_prefix(idempotency_key.split(":", 1)[0]) + "master.m3u8"
        metadata = self.store.head_metadata(master_key)
        if metadata is None or metadata.get("idempotency-key") != idempotency_key:
            return None
        return ProviderPost(master_key, self.store.public_url(master_key), created=False)


class WebhookProvider:
    """An HTTP endpoint receiving posts with an `Idempotency-Key` header (see devstack/provider_server.py)."""

    name = "webhook"

    def __init__(self, url: str, dedupes: bool, timeout_s: float = 10.0) -> None:
        self.url, self.dedupes = url.rstrip("/"), dedupes
        self.http = httpx.Client(timeout=timeout_s)

    @classmethod
    def from_settings(cls, settings: Settings) -> "WebhookProvider | None":
        if not settings.webhook_url:
            return None
        return cls(settings.webhook_url, settings.webhook_dedupes, settings.webhook_timeout_s)

    def publish(self, request: PublishRequest, idempotency_key: str) -> ProviderPost:
        """POST the job's master URL and renditions. Raises `ProviderError` (provider_throttled,
        with the provider's `Retry-After` in seconds when given) for 429, 5xx or no answer; the
        error's `sent` says whether the request may have reached the provider."""
        body = {"job_id": request.job_id, "master_url": request.master_url,
                "renditions": [{"name": r.name, "width": r.width, "height": r.height, "url": r.url}
                               for r in request.renditions]}
        try:
            response = self.http.post(f"{self.url}/posts", json=body, headers={"Idempotency-Key": idempotency_key})
        except httpx.ConnectError as exc:
            error = ProviderError(f"webhook {self.url} refused the connection: {exc}")
            error.sent = False  # nothing reached the provider
            raise error from exc
        except httpx.HTTPError as exc:
            error = ProviderError(f"webhook {self.url} did not answer: {exc}")
            error.sent = True  # it may have arrived
            raise error from exc
        if response.status_code in (200, 201):
            return self._post(response.json(), created=response.status_code == 201)
        retry_after = _retry_after(response)
        error = ProviderError(f"webhook answered {response.status_code}: {response.text[:200]}",
                              retry_after_s=retry_after)
        error.sent = response.status_code != 429  # 429: refused before processing (RFC 6585)
        error.http_status = response.status_code
        if response.status_code == 429 or response.status_code >= 500:
            raise error
        error.error_class = "unknown"  # another 4xx: our request is wrong; retrying will not help much
        raise error

    def lookup(self, idempotency_key: str) -> ProviderPost | None:
        """The post made with `idempotency_key`, or None. Raises `ProviderLookupFailed` when the
        provider cannot answer (so the caller must not post blindly)."""
        try:
            response = self.http.get(f"{self.url}/posts/lookup", params={"idempotency_key": idempotency_key})
        except httpx.HTTPError as exc:
            raise ProviderLookupFailed(f"webhook lookup failed: {exc}") from exc
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise ProviderLookupFailed(f"webhook lookup answered {response.status_code}")
        return self._post(response.json(), created=False)

    @staticmethod
    def _post(data: dict[str, Any], created: bool) -> ProviderPost:
        return ProviderPost(str(data["id"]), data.get("url"), created=created)


def _retry_after(response: httpx.Response) -> float | None:
    """`Retry-After` in seconds (delta-seconds form only, RFC 9110 section 10.2.3), else None."""
    try:
        return max(0.0, float(response.headers.get("Retry-After", "")))
    except ValueError:
        return None


PROVIDER_SLOT_LOCK = 0x7A9E_0020
"""Advisory-lock class id of provider concurrency slots (object id: slot number); 0001 migrations,
0002 schema swap, 0010 watchdog."""


class ProviderLimits:
    """A provider's concurrency limit, shared by every publish process through PostgreSQL: at most
    `max_in_flight` calls at once, each holding one session-level advisory lock
    `(PROVIDER_SLOT_LOCK + crc32(provider) % 1000, slot)` for the call (a crashed process's session
    ends and frees its slot). No free slot raises `ProviderDeferred` (wait `in_flight`, one second)
    before anything was claimed or posted; its `until` is one second after `clock.now()`. Quotas
    and the circuit breaker are `processors/provider_guard.py`.
    """

    def __init__(self, jobs: JobStore, provider: str, max_in_flight: int, *, clock: Clock) -> None:
        """`jobs`: the job store whose session holds the slot's lock (a publish process's own)."""
        import zlib

        self.jobs, self.provider, self.clock = jobs, provider, clock
        self.max_in_flight = max(1, max_in_flight)
        self.lock_class = PROVIDER_SLOT_LOCK + zlib.crc32(provider.encode()) % 1000
        self.slot: int | None = None

    def __enter__(self) -> "ProviderLimits":
        from datetime import timedelta

        from domain.errors import ProviderDeferred

        for slot in range(self.max_in_flight):
            row = self.jobs.one("provider_slot_try_lock", {"lock_class": self.lock_class, "slot": slot})
            if (row["got"] if isinstance(row, dict) else row[0]):
                self.slot = slot
                return self
        raise ProviderDeferred(f"{self.provider} has {self.max_in_flight} posts in flight (its concurrency limit)",
                               provider=self.provider, wait="in_flight", until=self.clock.now() + timedelta(seconds=1),
                               retry_after_s=1.0, limit=self.max_in_flight)

    def __exit__(self, *exc_info) -> None:
        if self.slot is not None:
            self.jobs.run("provider_slot_unlock", {"lock_class": self.lock_class, "slot": self.slot})
            self.slot = None

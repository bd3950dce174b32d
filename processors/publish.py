"""Publish: promote exactly the objects the transcode attempt named to `published/{job_id}/`,
write the HLS master playlist, and record `Published` + `JobCompleted`.

Promotion is a conditional PutObject (`If-None-Match: *`) of bytes whose sha256 was checked against
the completion event; an object that already exists is never overwritten (an identical one is
accepted, a different one fails the attempt). Copy-based promotion is not conditional on every S3
endpoint, so it is not used.
"""

from __future__ import annotations

import hashlib
import time

import structlog

from processors.runtime import Outgoing
from processors.worker import Attempt, StageWorker
from schemas import models as ev
from tapeline.errors import StorageError
from tapeline.objectstore import PUBLISHED_PREFIX, ObjectStore

log = structlog.get_logger("tapeline.publish")
PROVIDER = "origin"
AUDIO_BITRATE_BPS = 128_000


def published_prefix(job_id: str) -> str:
    return f"{PUBLISHED_PREFIX}{job_id}/"


def relative_key(key: str) -> str:
    """`work/{job}/{stage}/{attempt}/720p/seg_00000.ts` -> `720p/seg_00000.ts`."""
    parts = key.split("/", 4)
    if len(parts) != 5 or parts[0] != "work":
        raise StorageError(f"{key} is not an attempt-scoped key")
    return parts[4]


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


class PublishWorker(StageWorker):
    """Claims publish work items and makes their outputs public."""

    stage = "publish"

    def work(self, attempt: Attempt, store: ObjectStore) -> list[Outgoing]:
        item, identity, jobs = attempt.item, attempt.identity, self.settings.jobs_topic
        started = time.monotonic()
        idempotency_key = ev.dedup_key(identity.job_id, "publish", 0, "Published")
        attempt.send([(jobs, attempt.event(ev.PublishIntended, provider=PROVIDER, idempotency_key=idempotency_key))])
        prefix = published_prefix(identity.job_id)
        published, sizes = [], {}
        for output in item.inputs:
            body = store.get_bytes(output.key)
            if hashlib.sha256(body).hexdigest() != output.sha256:
                raise StorageError(f"{output.key} does not match the sha256 its attempt recorded")
            relative = relative_key(output.key)
            store.put_if_absent(prefix + relative, body, output.content_type)
            published.append(output.model_copy(update={"key": prefix + relative}))
            rendition = relative.split("/", 1)[0]
            sizes[rendition] = sizes.get(rendition, 0) + len(body)
        has_audio = item.audio_playlist_key is not None
        master = master_playlist(item.renditions, sizes, item.media_duration_s or 0.0, has_audio).encode()
        master_key = prefix + "master.m3u8"
        store.put_if_absent(master_key, master, "application/vnd.apple.mpegurl")
        published.append(ev.OutputFile(key=master_key, sha256=hashlib.sha256(master).hexdigest(),
                                       size_bytes=len(master), content_type="application/vnd.apple.mpegurl"))
        master_url = store.public_url(master_key)
        renditions = [r.model_copy(update={"playlist_key": f"{prefix}{r.name}/index.m3u8",
                                           "url": store.public_url(f"{prefix}{r.name}/index.m3u8")})
                      for r in item.renditions]
        log.info("published", job_id=identity.job_id, master_url=master_url, objects=len(published))
        return [
            (jobs, attempt.event(ev.AttemptSucceeded, outputs=published, renditions=renditions,
                                 audio_playlist_key=prefix + "audio/index.m3u8" if has_audio else None,
                                 media_duration_s=item.media_duration_s,
                                 elapsed_s=time.monotonic() - started)),
            (jobs, attempt.event(ev.Published, provider=PROVIDER, provider_ref=master_key, master_key=master_key,
                                 master_url=master_url, renditions=renditions)),
            (jobs, attempt.event(ev.JobCompleted, master_url=master_url, media_duration_s=item.media_duration_s)),
        ]

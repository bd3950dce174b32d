"""Transcode: a claimed work item -> an H.264/AAC HLS ladder at attempt-scoped keys.

Outputs go to `work/{job_id}/transcode/{attempt}/{rendition}/...`; `AttemptSucceeded` names every
object with its sha256, and the publish work item carries exactly that list.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import structlog

from processors import media
from processors.runtime import Outgoing
from processors.worker import Attempt, StageWorker, Yielded
from schemas import models as ev
from tapeline.crashpoints import fail_point
from tapeline.objectstore import ObjectStore

log = structlog.get_logger("tapeline.transcode")

CONTENT_TYPES = {".m3u8": "application/vnd.apple.mpegurl", ".ts": "video/mp2t", ".m4s": "video/iso.segment",
                 ".mp4": "video/mp4"}


def attempt_prefix(job_id: str, stage: str, attempt: int) -> str:
    """Object key prefix of one attempt's outputs: `work/{job_id}/{stage}/{attempt}/`."""
    return f"work/{job_id}/{stage}/{attempt}/"


class TranscodeWorker(StageWorker):
    """Claims transcode work items and encodes the ladder the intake planned."""

    stage = "transcode"

    def work(self, attempt: Attempt, store: ObjectStore) -> list[Outgoing]:
        item, identity, settings = attempt.item, attempt.identity, self.settings
        with tempfile.TemporaryDirectory(prefix="tapeline-transcode-") as tmp:
            source = Path(tmp) / "source"
            fail_point("transcode.download")
            store.download(item.source_key, source)
            probe = media.inspect_source(source, count_packets=False, timeout_s=settings.probe_timeout_s)
            has_audio = probe.audio_stream is not None
            out_dir = Path(tmp) / "out"
            command = media.build_hls_command(source, out_dir, item.renditions, video_stream=probe.video_stream,
                                              audio_stream=probe.audio_stream, segment_s=settings.segment_s,
                                              preset=settings.x264_preset)
            limit_s = media.wall_clock_limit_s(probe.media.duration_s, settings)
            latest = [media.Progress(0, 0.0, None, False)]  # the last -progress block ffmpeg printed

            def tick() -> None:
                attempt.heartbeat(latest[0].frames, latest[0].out_time_s, latest[0].speed, probe.media.frames)

            def progressed(p: media.Progress) -> None:
                latest[0] = p
                self.health.record_progress(p.frames, p.out_time_s, p.speed)

            # tick_s well below the heartbeat interval, so heartbeats leave on time (no-progress
            # detection is at most the timeout plus one heartbeat interval late).
            result = media.run_ffmpeg(command, on_progress=progressed, on_tick=tick,
                                      should_stop=self.stop.is_set, tick_s=min(0.25, settings.heartbeat_s / 4),
                                      timeout_s=limit_s)
            if self.stop.is_set() and not (latest[0].ended and result.returncode == 0):
                raise Yielded(f"worker shutting down (SIGTERM) at {latest[0].out_time_s:.1f} s of media")
            failure = media.ffmpeg_failure(result, limit_s)
            if failure is not None:
                raise failure
            tolerance = max(0.1, 1.5 / probe.media.fps if probe.media.fps else 0.1)
            media.verify_outputs(out_dir, item.renditions, probe.media, has_audio, tolerance)
            prefix = attempt_prefix(identity.job_id, self.stage, identity.attempt)
            outputs = []
            for path in sorted(p for p in out_dir.rglob("*") if p.is_file()):
                key = prefix + path.relative_to(out_dir).as_posix()
                content_type = CONTENT_TYPES.get(path.suffix, "application/octet-stream")
                sha, size = store.upload_file(path, key, content_type)
                outputs.append(ev.OutputFile(key=key, sha256=sha, size_bytes=size, content_type=content_type))
        renditions = [r.model_copy(update={"playlist_key": f"{prefix}{r.name}/index.m3u8"}) for r in item.renditions]
        audio_key = f"{prefix}audio/index.m3u8" if has_audio else None
        jobs = settings.jobs_topic
        publish_topic = settings.work_topic("publish", item.tier)
        common = dict(job_id=identity.job_id, claim_token=identity.claim_token, recorded_by=identity.recorded_by,
                      correlation_id=identity.correlation_id, causation_id=identity.causation_id)
        log.info("transcoded", job_id=identity.job_id, renditions=[r.name for r in renditions],
                 elapsed_s=round(result.elapsed_s, 3), objects=len(outputs))
        return [
            (jobs, attempt.event(ev.AttemptSucceeded, outputs=outputs, renditions=renditions,
                                 audio_playlist_key=audio_key, media_duration_s=probe.media.duration_s,
                                 elapsed_s=result.elapsed_s)),
            (jobs, ev.StageQueued.new(stage="publish", attempt=1, tier=item.tier, work_topic=publish_topic, **common)),
            (publish_topic, ev.WorkItem.new(stage="publish", attempt=1, tier=item.tier, source_key=item.source_key,
                                            inputs=outputs, renditions=renditions, audio_playlist_key=audio_key,
                                            media_duration_s=probe.media.duration_s, **common)),
        ]

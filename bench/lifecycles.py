"""Synthetic but realistic job lifecycles for the replay benchmark and the replay tests.

A job is accepted, queued, claimed, heartbeats and checkpoints through its transcode (some attempts
fail and are retried, some leave a zombie's late heartbeat behind), then publishes and completes;
a few fail for good. Events are built with the real models, so they encode with the real codec.
"""

from __future__ import annotations

import random
import uuid
from datetime import datetime, timedelta, timezone
from typing import Iterator

from domain import events as ev
from tapeline.clock import system_clock  # noqa: E402

MEDIA = ev.SourceMedia(format_name="mov", duration_s=120.0, width=1280, height=720, display_width=1280,
                       display_height=720, rotation=0, fps=25.0, frames=3000, video_codec="h264", audio_codec="aac")
LADDER = [ev.Rendition(name="720p", width=1280, height=720, video_bitrate_kbps=2800),
          ev.Rendition(name="480p", width=854, height=480, video_bitrate_kbps=1400)]


def upload(upload_id: str, priority: str = "standard") -> ev.UploadCompleted:
    """The `UploadCompleted` that starts a job (for `<prefix>.uploads`)."""
    return ev.UploadCompleted.new(system_clock.stamp(), job_id=ev.job_id_for(upload_id), stage="intake", attempt=0, recorded_by="bench",
                                  correlation_id=upload_id, upload_id=upload_id, bucket="b",
                                  object_key=f"uploads/{upload_id}/a.mp4", size_bytes=1_000_000, sha256="0" * 64,
                                  filename="a.mp4", priority=priority)


def job(rng: random.Random, upload_id: str | None = None, heartbeats: int = 30, checkpoints: int = 8,
        failed_attempts: int = 0, zombie: bool = False, terminal_failure: bool = False) -> list[ev.Event]:
    """One job's lifecycle events in log order."""
    upload_id = upload_id or f"u-{uuid.UUID(int=rng.getrandbits(128))}"
    job_id = ev.job_id_for(upload_id)
    common = dict(job_id=job_id, recorded_by="bench", correlation_id=upload_id)
    events: list[ev.Event] = [
        ev.JobAccepted.new(system_clock.stamp(), stage="intake", attempt=0, upload_id=upload_id, source_key=f"uploads/{upload_id}/a.mp4",
                           source_sha256="0" * 64, source_size_bytes=1_000_000, priority="standard",
                           profile="default", media=MEDIA, ladder=LADDER, **common),
        ev.StageQueued.new(system_clock.stamp(), stage="transcode", attempt=1, tier="standard", work_topic="work.transcode.standard",
                           **common)]
    attempt = 1
    while True:
        token = uuid.UUID(int=rng.getrandbits(128)).hex
        events.append(ev.AttemptStarted.new(system_clock.stamp(), stage="transcode", attempt=attempt, claim_token=token, lease_s=120.0,
                                            worker=f"w{rng.randrange(8)}", work_topic="work.transcode.standard",
                                            work_partition=rng.randrange(12), work_offset=rng.randrange(10**6),
                                            **common))
        segment = 0
        for sequence in range(1, heartbeats + 1):
            frames = sequence * 100
            events.append(ev.Heartbeat.new(system_clock.stamp(), stage="transcode", attempt=attempt, claim_token=token, sequence=sequence,
                                           frames_done=frames, frames_total=3000, out_time_s=frames / 25.0,
                                           speed=2.5, **common))
            if checkpoints and sequence % max(1, heartbeats // checkpoints) == 0 and segment < checkpoints:
                events.append(ev.CheckpointRecorded.new(system_clock.stamp(), 
                    stage="transcode", attempt=attempt, claim_token=token, sequence=segment, segment_index=segment,
                    rendition="720p", object_key=f"work/{job_id}/transcode/{attempt}/720p/{segment:05d}.ts",
                    sha256="1" * 64, frames=100, media_start_s=segment * 4.0, media_duration_s=4.0, **common))
                segment += 1
        if attempt > failed_attempts:
            break
        events.append(ev.AttemptFailed.new(system_clock.stamp(), stage="transcode", attempt=attempt, claim_token=token,
                                           error_class="storage_transient", retryable=True, reason="S3 503",
                                           **common))
        events.append(ev.RetryScheduled.new(system_clock.stamp(), stage="transcode", attempt=attempt, next_attempt=attempt + 1,
                                            not_before=datetime(2025, 1, 1, tzinfo=timezone.utc) + timedelta(minutes=1),
                                            error_class="storage_transient", **common))
        attempt += 1
        events.append(ev.StageQueued.new(system_clock.stamp(), stage="transcode", attempt=attempt, tier="standard",
                                         work_topic="work.transcode.standard", **common))
        if zombie:  # the previous attempt's worker, still alive, heartbeats late: superseded evidence
            events.append(ev.Heartbeat.new(system_clock.stamp(), stage="transcode", attempt=attempt - 1, claim_token=token,
                                           sequence=heartbeats + 1, frames_done=99_999, out_time_s=999.0, **common))
    if terminal_failure:
        events.append(ev.JobFailed.new(system_clock.stamp(), stage="transcode", attempt=attempt, claim_token=token,
                                       error_class="invalid_input", reason="corrupt frame", **common))
        return events
    outputs = [ev.OutputFile(key=f"work/{job_id}/transcode/{attempt}/720p/{i:05d}.ts", sha256="2" * 64,
                             size_bytes=500_000, content_type="video/mp2t") for i in range(checkpoints)]
    publish_token = uuid.UUID(int=rng.getrandbits(128)).hex
    master = f"http://s3/published/{job_id}/master.m3u8"
    events += [
        ev.AttemptSucceeded.new(system_clock.stamp(), stage="transcode", attempt=attempt, claim_token=token, outputs=outputs,
                                renditions=LADDER, elapsed_s=48.0, media_duration_s=120.0, **common),
        ev.StageQueued.new(system_clock.stamp(), stage="publish", attempt=1, tier="standard", work_topic="work.publish.standard", **common),
        ev.AttemptStarted.new(system_clock.stamp(), stage="publish", attempt=1, claim_token=publish_token, lease_s=120.0, worker="p0",
                              work_topic="work.publish.standard", work_partition=0, work_offset=0, **common),
        ev.PublishIntended.new(system_clock.stamp(), stage="publish", attempt=1, claim_token=publish_token, provider="s3",
                               idempotency_key=f"{job_id}:publish", **common),
        ev.AttemptSucceeded.new(system_clock.stamp(), stage="publish", attempt=1, claim_token=publish_token, outputs=[], renditions=LADDER,
                                elapsed_s=1.0, **common),
        ev.Published.new(system_clock.stamp(), stage="publish", attempt=1, claim_token=publish_token, provider="s3", provider_ref="ref",
                         master_key=f"published/{job_id}/master.m3u8", master_url=master, renditions=LADDER, **common),
        ev.JobCompleted.new(system_clock.stamp(), stage="publish", attempt=1, claim_token=publish_token, master_url=master,
                            media_duration_s=120.0, **common)]
    return events


def jobs(seed: int, count: int, heartbeats: int = 30, checkpoints: int = 8) -> Iterator[list[ev.Event]]:
    """`count` jobs' lifecycles: about 1 in 5 retries once, 1 in 10 leaves a zombie, 1 in 20 fails."""
    rng = random.Random(seed)
    for _ in range(count):
        roll = rng.random()
        yield job(rng, heartbeats=heartbeats, checkpoints=checkpoints, failed_attempts=1 if roll < 0.2 else 0,
                  zombie=roll < 0.1, terminal_failure=0.95 < roll)

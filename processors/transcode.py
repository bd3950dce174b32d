"""Transcode: a claimed work item -> an H.264/AAC HLS ladder, in checkpointed segments.

Outputs go to `work/{job_id}/transcode/{attempt}/{rendition}/...`; `AttemptSucceeded` names every
object with its sha256 (segments reused from an earlier attempt keep that attempt's key), and the
publish work item carries exactly that list.

Checkpoint protocol of one attempt (`processors/segments.py` has the encoding side):
  Step 1. read the job's recorded checkpoints from the projection: `CheckpointRecorded` events that
          were applied, never superseded (a zombie's late checkpoint carries a stale claim token);
  Step 2. verify each candidate's sha256 against the bytes in S3 and plan the resume: the longest
          prefix of segments present, verified and continuous in every rendition (`plan_resume`);
  Step 3. run one ffmpeg from the first missing segment's boundary; in its tick loop (the thread
          that owns the attempt's producer) upload each completed segment to the attempt's prefix
          and record it, in one small transaction per tick, with `CheckpointRecorded`;
  Step 4. after ffmpeg ends cleanly: record the last segments and the audio (one transaction, so
          audio is checkpointed as a whole), check every rendition, write the playlists, complete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import structlog

from processors import media, segments
from domain.policy import segment_plan
from processors.runtime import Outgoing
from domain.policy.segment_plan import AUDIO, Checkpoint, LocalSegment, ResumePlan
from processors.worker import Attempt, StageWorker, Yielded
from domain import events as ev
from tapeline.crashpoints import delay_point, fail_point
from domain.errors import StorageError, TranscodeFailed
from tapeline.objects import attempt_prefix, sha256_file
from tapeline.ports import JobStore, MediaTool, ObjectStorage
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.transcode")

CONTENT_TYPES = {".m3u8": "application/vnd.apple.mpegurl", ".ts": "video/mp2t", ".m4s": "video/iso.segment",
                 ".mp4": "video/mp4"}


VFR_MAX_GAP_S = 1.0
"""Largest hole between two frames of a variable-frame-rate source that a join may show (phones drop
frames under load); lost frames are still caught by the frame count (`segment_plan.check_rendition`)."""


def max_join_gap_s(probe: media.Probe | None) -> float:
    """How much later than the previous segment's end a video segment may start: `VFR_MAX_GAP_S` for
    a variable-frame-rate source, else 0 (half a frame, the joins' own slack). Pure."""
    return VFR_MAX_GAP_S if probe is not None and probe.variable_frame_rate else 0.0


class ResumeMismatch(TranscodeFailed):
    """A resumed encode does not join the reused segments (the seek landed elsewhere)."""


def recorded_checkpoints(jobs: JobStore, job_id: str, stage: str = "transcode") -> list[Checkpoint]:
    """Step 1: the checkpoints a job's attempts recorded while they owned it, oldest first (the
    `job_checkpoints` operation of `jobs`)."""
    rows = jobs.all("job_checkpoints", {"job_id": job_id, "stage": stage})
    return [Checkpoint(attempt=r["attempt"], rendition=r["payload"]["rendition"], index=r["payload"]["segment_index"],
                       key=r["payload"]["object_key"], sha256=r["payload"]["sha256"], frames=r["payload"]["frames"],
                       start_s=r["payload"]["media_start_s"], duration_s=r["payload"]["media_duration_s"])
            for r in rows]


def reuse_verified(store: ObjectStorage, candidates: list[Checkpoint], renditions: list[str], out_dir: Path,
                   segment_s: float, frame_s: float, duration_s: float) -> tuple[ResumePlan, dict[str, int]]:
    """Step 2: download what the plan would reuse into `out_dir/<rendition>/seg_NNNNN.ts`, keep what
    matches its recorded sha256, and plan again without what does not (or is gone) until the plan
    only holds verified segments. Returns the plan and the size in bytes of each reused key; files
    of `out_dir` that the plan does not reuse are removed. Never trusts an object without a record."""
    verified: dict[str, int] = {}
    pool = list(candidates)
    while True:
        plan = segment_plan.plan_resume(pool, renditions, segment_s, frame_s, duration_s)
        bad = []
        for c in plan.reused:
            if c.key in verified:
                continue
            local = out_dir / c.rendition / segment_plan.segment_name(c.index)
            local.parent.mkdir(parents=True, exist_ok=True)
            try:
                store.download(c.key, local)
                ok = sha256_file(local) == c.sha256
            except StorageError as exc:
                log.warning("checkpoint object unreadable; not reused", key=c.key, error=str(exc))
                ok = False
            if ok:
                verified[c.key] = local.stat().st_size
            else:
                log.warning("checkpoint does not match its recorded sha256; redone", key=c.key)
                local.unlink(missing_ok=True)
                bad.append(c)
        if not bad:
            break
        pool = [c for c in pool if c not in bad]
    keep = {(c.rendition, c.index) for c in plan.reused}
    for path in out_dir.glob("*/seg_*.ts"):
        if (path.parent.name, int(path.stem[4:])) not in keep:
            path.unlink()
    return plan, {c.key: verified[c.key] for c in plan.reused}


class TranscodeWorker(StageWorker):
    """Claims transcode work items and encodes the ladder the intake planned, resuming from the
    verified checkpoints of earlier attempts."""

    stage = "transcode"
    checkpoints = 0
    encoded: tuple[int, float] = (0, 0.0)
    """The finished encode's progress (frames done, seconds of media), which `Attempt.keepalive`
    heartbeats report after ffmpeg ended."""

    def __init__(self, settings: Settings, *, media: MediaTool, **adapters: Any) -> None:
        """`media`: ffprobe and ffmpeg (`MediaTool`); `adapters`: `StageWorker`'s (events, jobs, storage,
        clock, health)."""
        super().__init__(settings, **adapters)
        self.media = media

    def work(self, attempt: Attempt, store: ObjectStorage) -> list[Outgoing]:
        item, identity, settings = attempt.item, attempt.identity, self.settings
        prefix = attempt_prefix(identity.job_id, self.stage, identity.attempt)
        names = [r.name for r in item.renditions]
        self.checkpoints = 0  # sequence of this attempt's CheckpointRecorded events (their dedup keys)
        with tempfile.TemporaryDirectory(prefix="tapeline-transcode-") as tmp:
            source = Path(tmp) / "source"
            fail_point("transcode.download")
            # Nothing heartbeats before ffmpeg starts: heartbeats from a thread, and a no-progress
            # grace for the download (a 20 GiB source would otherwise outlast a lease or the timeout).
            found = store.head(item.source_key)
            grace_s = round(found[0] / settings.download_min_bytes_per_s, 3) if found and found[0] else None
            with attempt.keepalive(0, 0.0, None, progress_grace_s=grace_s):
                store.download(item.source_key, source)
                delay_point("transcode.download")
                inspected = self.media.inspect_source(source, count_packets=False, timeout_s=settings.probe_timeout_s)
                probe, streams = inspected.media, (inspected.video_stream, inspected.audio_stream)
                has_audio = inspected.audio_stream is not None
                frame_s = 1 / probe.fps if probe.fps else 1 / 25
                out_dir = Path(tmp) / "out"
                # Steps 1-2
                plan, sizes = reuse_verified(store, recorded_checkpoints(attempt.runtime.jobs, identity.job_id),
                                             names, out_dir, settings.segment_s, frame_s, probe.duration_s)
            if not has_audio:
                plan = ResumePlan(plan.start_index, plan.video, [])
            log.info("resuming from checkpoints" if plan.start_index else "encoding from the start",
                     job_id=identity.job_id, attempt=identity.attempt, start_index=plan.start_index,
                     reused_video=sum(len(v) for v in plan.video.values()), reused_audio=len(plan.audio))
            # Step 3
            self.encoded = (probe.frames or 0, probe.duration_s)  # (every segment reused: nothing left to encode)
            try:
                new, elapsed_s = self.encode(attempt, store, source, probe, plan, out_dir, prefix, streams,
                                             inspected.encoder_frame_rate, inspected, temp_dir=Path(tmp))
            except ResumeMismatch as exc:
                log.warning("resumed encode does not join the reused segments; encoding from the start",
                            job_id=identity.job_id, error=str(exc))
                shutil.rmtree(out_dir)
                plan, sizes = ResumePlan(0, {}, []), {}
                new, elapsed_s = self.encode(attempt, store, source, probe, plan, out_dir, prefix, streams,
                                             inspected.encoder_frame_rate, inspected, temp_dir=Path(tmp))
            # Step 4 (no ffmpeg to heartbeat from: heartbeats from a thread, with the encode's figures)
            with attempt.keepalive(*self.encoded, probe.frames):
                outputs, playlist_keys = self.assemble(store, item.renditions, probe, has_audio, plan, sizes, new,
                                                       out_dir, prefix, frame_s, inspected)
        renditions = [r.model_copy(update={"playlist_key": playlist_keys[r.name]}) for r in item.renditions]
        audio_key = playlist_keys.get(AUDIO)
        jobs = settings.jobs_topic
        log.info("transcoded", job_id=identity.job_id, renditions=names, elapsed_s=round(elapsed_s, 3),
                 objects=len(outputs), reused=len(plan.reused))
        return [
            (jobs, attempt.event(ev.AttemptSucceeded, outputs=outputs, renditions=renditions,
                                 audio_playlist_key=audio_key, media_duration_s=probe.duration_s,
                                 elapsed_s=elapsed_s)),
        ] + self.hand_on(attempt, inputs=list(item.inputs) + outputs, renditions=renditions,
                         audio_playlist_key=audio_key, media_duration_s=probe.duration_s)

    def seek_grace_s(self, source: Path, start_index: int, frame_rate: Fraction | None,
                     video_stream: int | None) -> float | None:
        """Seconds of grace on the no-progress timeout for a run resuming at `start_index`: ffmpeg
        decodes from the keyframe before the seek point without emitting a frame, so the media
        seconds between them divided by `seek_decode_min_speed`; None for a run from the start, a
        seek within a second of its keyframe, or a keyframe ffprobe cannot find."""
        if start_index <= 0:
            return None
        seek_s = segment_plan.resume_seek_s(start_index, self.settings.segment_s, frame_rate)
        keyframe_s = self.media.keyframe_before(source, seek_s, video_stream, timeout_s=self.settings.probe_timeout_s)
        if keyframe_s is None or seek_s - keyframe_s < 1.0:
            return None
        grace = round((seek_s - keyframe_s) / self.settings.seek_decode_min_speed, 3)
        log.info("resume seeks into a long GOP: no-progress grace while ffmpeg decodes to the resume point",
                 keyframe_s=keyframe_s, seek_s=round(seek_s, 3), grace_s=grace)
        return grace

    def encode(self, attempt: Attempt, store: ObjectStorage, source: Path, probe: ev.SourceMedia, plan: ResumePlan,
               out_dir: Path, prefix: str, streams: tuple[int, int | None] = (0, None),
               frame_rate: Fraction | None = None, source_probe: media.Probe | None = None,
               temp_dir: Path | None = None) -> tuple[dict[str, list[LocalSegment]], float]:
        """Step 3: encode segments `plan.start_index..` (and the audio unless reused), checkpointing
        each one as it completes. Returns the new segments per rendition and ffmpeg's wall time (s).

        Raises `Yielded` on SIGTERM (completed segments are recorded first), `Fenced` when a newer
        attempt owns the job, `ResumeMismatch` when the first new segment does not join the last
        reused one, `TranscodeFailed` when ffmpeg fails (`TranscodeTimeout` past its wall-clock
        limit, `LimitsExceeded` past one of its limits: `media.ffmpeg_limits`, measured against
        `temp_dir`, the attempt's temp directory, when given), `StorageError` when an upload fails.
        `streams`: the source's (video, audio) stream indexes from the probe (audio None when there
        is none); `frame_rate`: the probe's `encoder_frame_rate` (`segments.build_segment_command`);
        `source_probe`: the whole probe (deinterlacing, the audio's sampling rate, a variable frame
        rate).
        """
        item, settings = attempt.item, self.settings
        with_audio = streams[1] is not None and not plan.audio
        frame_s = 1 / probe.fps if probe.fps else 1 / 25
        # Every video segment reused (the last attempt died after its last checkpoint): audio only, or nothing.
        ladder = [] if plan.video_complete(probe.duration_s, frame_s) else item.renditions
        names = [r.name for r in ladder]
        new: dict[str, list[LocalSegment]] = {r.name: [] for r in item.renditions} | {AUDIO: []}
        if not ladder and not with_audio:
            return new, 0.0
        command = segments.build_segment_command(
            source, out_dir, ladder, with_audio=with_audio, segment_s=settings.segment_s,
            preset=item.x264_preset or settings.x264_preset, duration_s=probe.duration_s, start_index=plan.start_index,
            list_dir=out_dir.parent / "lists", video_stream=streams[0], audio_stream=streams[1],
            frame_rate=frame_rate, deinterlace=bool(source_probe and source_probe.deinterlace),
            audio_rate_hz=source_probe.audio_sample_rate if source_probe else None)
        max_gap_s = max_join_gap_s(source_probe)
        limit_s = media.wall_clock_limit_s(probe.duration_s, settings)
        limits = media.ffmpeg_limits(probe, item.renditions, source.stat().st_size, streams[1] is not None, settings,
                                     cpus=len(os.sched_getaffinity(0)))
        watcher = segments.SegmentWatcher(out_dir, names, plan.start_index)
        reused_frames = sum(c.frames for c in plan.video.get(item.renditions[0].name, []))
        latest = [media.Progress(0, 0.0, None, False)]
        tool: list[ev.ToolState | None] = [None]  # what the worker last saw of its ffmpeg (`media.ToolWatch`)
        grace_s = self.seek_grace_s(source, plan.start_index if ladder else 0, frame_rate, streams[0])

        def record(done: list[LocalSegment]) -> None:
            """Upload completed segments and record them in one transaction (this thread owns the producer)."""
            if not done:
                return
            last: dict[str, LocalSegment] = {}  # the batch may hold several segments of one rendition
            for segment in done:
                previous = last.get(segment.rendition)
                joins_reused = previous is None and not new[segment.rendition]  # the first new segment
                if previous is None:
                    previous = (new[segment.rendition] or plan.video.get(segment.rendition) or [None])[-1]
                last[segment.rendition] = segment
                if previous is not None and segment.rendition != AUDIO:
                    try:
                        segment_plan.check_join(previous, segment, frame_s, max_gap_s)
                    except TranscodeFailed as exc:
                        if joins_reused:
                            raise ResumeMismatch(str(exc)) from exc
                        raise
            events = []
            for segment in done:
                key = f"{prefix}{segment.rendition}/{segment.path.name}"
                sha, _ = store.upload_file(segment.path, key, CONTENT_TYPES[".ts"])
                if sha != segment.sha256:
                    raise TranscodeFailed(f"{segment.path.name} of {segment.rendition} changed while uploading")
                new[segment.rendition].append(segment)
                self.checkpoints += 1
                events.append((settings.jobs_topic, attempt.event(
                    ev.CheckpointRecorded, sequence=self.checkpoints, segment_index=segment.index,
                    rendition=segment.rendition, object_key=key, sha256=segment.sha256, frames=segment.frames,
                    media_start_s=segment.start_s, media_duration_s=segment.duration_s)))
            attempt.record(events)  # crash points transcode.CheckpointRecorded.*

        def tick() -> None:
            record(watcher.poll())
            p = latest[0]
            attempt.heartbeat(reused_frames + p.frames, min(probe.duration_s, plan.start_s + p.out_time_s), p.speed,
                              probe.frames, progress_grace_s=grace_s if p.frames == 0 else None, tool_state=tool[0])

        def sampled(state: ev.ToolState) -> None:
            tool[0] = state

        def progressed(p: media.Progress) -> None:
            latest[0] = p
            self.health.record_progress(reused_frames + p.frames, plan.start_s + p.out_time_s, p.speed)

        # tick_s well below the heartbeat interval, so heartbeats leave on time (no-progress
        # detection is at most the timeout plus one heartbeat interval late).
        result = self.media.run_ffmpeg(command, on_progress=progressed, on_tick=tick,
                                  should_stop=self.stop.is_set, tick_s=min(0.25, self.settings.heartbeat_s / 4),
                                  timeout_s=limit_s, limits=limits, temp_dir=temp_dir, on_sample=sampled)
        ended = result.returncode == 0 and latest[0].ended
        if self.stop.is_set() and not ended:
            record(watcher.poll())  # what finished before the stop is kept for the successor
            raise Yielded(f"worker shutting down (SIGTERM) at segment {min(watcher.reported.values(), default=0)}, "
                          f"{plan.start_s + latest[0].out_time_s:.1f} s of media")
        failure = media.ffmpeg_failure(result, limit_s)
        if failure is not None:
            raise failure
        self.encoded = (reused_frames + latest[0].frames, min(probe.duration_s, plan.start_s + latest[0].out_time_s))
        with attempt.keepalive(*self.encoded, probe.frames):  # ffmpeg's ticks heartbeat no more
            record(watcher.poll(ended=True))
            if with_audio:  # Step 4: the audio as a whole, in one transaction
                record(segments.SegmentWatcher(out_dir, [AUDIO]).poll(ended=True))
        return new, result.elapsed_s

    def assemble(self, store: ObjectStorage, ladder: list[ev.Rendition], probe: ev.SourceMedia, has_audio: bool,
                 plan: ResumePlan, sizes: dict[str, int], new: dict[str, list[LocalSegment]], out_dir: Path,
                 prefix: str, frame_s: float,
                 source_probe: media.Probe | None = None) -> tuple[list[ev.OutputFile], dict[str, str]]:
        """Step 4: check each rendition (reused + new segments) against the source stream it comes
        from, write and upload its playlist, and list every object of the final renditions. Returns
        (outputs, playlist key per rendition). Raises `OutputMismatch` (class `unsupported_media`, not
        retried) when a rendition does not match its stream in the probe.

        Tolerances: video, 1.5 frames (at least 0.1 s: the last frame's duration is a guess from the
        frame interval); audio, 0.1 s more: AAC encodes in 1024-sample frames (21 ms at 48 kHz) and
        its first frame carries 1024 samples of encoder priming (`ts_scan.scan_ts` reads frame times).
        """
        tolerance = max(0.1, 1.5 * frame_s)
        audio_s = source_probe.audio_duration_s if source_probe and source_probe.audio_duration_s else probe.duration_s
        starts = (source_probe.video_start_s, source_probe.audio_start_s) if source_probe else (0.0, 0.0)
        outputs: list[ev.OutputFile] = []
        playlists: dict[str, str] = {}
        names = [r.name for r in ladder] + ([AUDIO] if has_audio else [])
        for name in names:
            reused: list[Any] = plan.audio if name == AUDIO else plan.video.get(name, [])
            parts: list[Any] = list(reused) + new[name]
            if name == AUDIO:
                segment_plan.check_rendition(name, parts, frame_s, None, audio_s, tolerance + 0.1, start_s=starts[1])
            else:
                segment_plan.check_rendition(name, parts, frame_s, probe.frames, probe.duration_s, tolerance,
                                         start_s=starts[0], max_gap_s=max_join_gap_s(source_probe))
            for part in parts:
                if isinstance(part, Checkpoint):
                    outputs.append(ev.OutputFile(key=part.key, sha256=part.sha256, size_bytes=sizes[part.key],
                                                 content_type=CONTENT_TYPES[".ts"]))
                else:
                    outputs.append(ev.OutputFile(key=f"{prefix}{name}/{part.path.name}", sha256=part.sha256,
                                                 size_bytes=part.size_bytes, content_type=CONTENT_TYPES[".ts"]))
            playlist = out_dir / name / "index.m3u8"
            playlist.write_text(segment_plan.media_playlist([p.duration_s for p in parts]))
        self.media.verify_outputs(out_dir, ladder, probe, has_audio, tolerance)  # ffprobe reads what players will
        for name in names:
            key = f"{prefix}{name}/index.m3u8"
            sha, size = store.upload_file(out_dir / name / "index.m3u8", key, CONTENT_TYPES[".m3u8"])
            outputs.append(ev.OutputFile(key=key, sha256=sha, size_bytes=size, content_type=CONTENT_TYPES[".m3u8"]))
            playlists[name] = key
        return outputs, playlists

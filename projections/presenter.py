"""The one presenter of what the projections hold: pure functions from read-model rows
(`projections/read_model.py`) to the words and numbers every view shows: a job's summary
(`job_summary`: what `tapeline status --json` prints and the API's job), its percent done, published
artifacts and archived objects, the detail of each timeline event (`timeline_detail`). The CLI, the
API and the dashboard's templates call these; none keeps its own list. (Stalled rows:
`domain/policy/stall.py`.) No I/O."""

from __future__ import annotations

from typing import Any, Sequence

from domain import pipeline
from domain.diagnosis import object_words
from domain.lifecycle import TERMINAL_STATES
from domain.links import web_url
from tapeline.objects import attempt_path


INTAKE_SHARE = 0.05


def stage_shares(stages: Sequence[str] | None) -> dict[str, tuple[float, float]]:
    """(low, high) share of the whole job each stage represents in `percent_done`: intake the first
    5 %, the job's stages (`job_state.pipeline_stages`, `pipeline.LEGACY_STAGES` for an older job)
    the rest, in order, weighted by their declarations' `share` (transcode 0.85, publish 0.10, so an
    older job keeps 0.05-0.90-1.0). Pure."""
    names = pipeline.job_stages(stages)
    weights = [pipeline.BY_NAME[s].share if s in pipeline.BY_NAME else 0.0 for s in names]
    scale = (1.0 - INTAKE_SHARE) / (sum(weights) or 1.0)
    shares, low = {pipeline.INTAKE: (0.0, INTAKE_SHARE)}, INTAKE_SHARE
    for name, weight in zip(names, weights):
        shares[name] = (low, low + weight * scale)
        low += weight * scale
    return shares


STAGE_SHARE = stage_shares(None)
"""`stage_shares` of a job accepted before profiles (transcode, publish)."""


def percent_done(row: dict[str, Any]) -> float:
    """0-100, the one formula every view shows (`tapeline status`, its list, the dashboard, the API):
    stages weighted by `stage_shares`; inside a media stage (transcode, thumbnails) that runs, is
    queued again or waits for its retry, the media seconds done over the source's duration, where
    done is the larger of what the running attempt's heartbeats report (`progress_out_time_s`,
    running only) and what applied checkpoints already hold (`checkpointed_s`, attached by
    `projections/read_model.py`: segments a retry reuses count as done).

    Only a completed job is 100; a job that ended otherwise (cancelled, failed, dead-lettered, ...)
    shows where it stopped: the share of the stages before the one it was in (a job cancelled before
    it ever ran is 0)."""
    if row["state"] == "completed":
        return 100.0
    low, high = stage_shares(row.get("pipeline_stages")).get(row["stage"], (0.0, INTAKE_SHARE))
    if row["state"] in TERMINAL_STATES:
        return round(100.0 * low, 1)
    inside = 0.0
    declared = pipeline.BY_NAME.get(row["stage"])
    if row["state"] in ACTIVE_STATES and declared is not None and declared.uses_media_tool \
            and row.get("source_duration_s"):
        heartbeats = (row.get("progress_out_time_s") or 0.0) if row["state"] == "running" else 0.0
        done_s = max(heartbeats, row.get("checkpointed_s") or 0.0)
        inside = min(1.0, done_s / row["source_duration_s"])
    return round(100.0 * (low + (high - low) * inside), 1)


ACTIVE_STATES = ("running", "queued", "retry_scheduled")
"""States in which a stage's done media counts inside its share (`percent_done`)."""


def percent_text(percent: float) -> str:
    """`percent_done`'s value as every view prints it: one decimal and a spaced sign, `11.6 %`."""
    return f"{percent:.1f} %"


def heartbeat_media_s(point: dict[str, Any], source_duration_s: float | None) -> float:
    """Seconds of media one heartbeat says are done (`Heartbeat` as `read_model.progress_series` gives
    it: `out_time_s`, `frames_done`, `frames_total`): its `out_time_s` when ffmpeg stated one; when
    it stated none (0: ffmpeg prints `out_time=N/A` until its muxers write, and a tool stopped early
    never does) but counted frames, that share of the source (`frames_done / frames_total` of
    `source_duration_s`, seconds), so a hung attempt whose heartbeats said 392 frames is not drawn
    at 0; else 0. Pure."""
    out_time = point.get("out_time_s") or 0.0
    if out_time > 0:
        return float(out_time)
    done, total = point.get("frames_done") or 0, point.get("frames_total") or 0
    if done > 0 and total > 0 and source_duration_s:
        return round(min(1.0, done / total) * source_duration_s, 3)
    return 0.0


def with_media_s(series: list[dict[str, Any]], source_duration_s: float | None) -> list[dict[str, Any]]:
    """`series` (`read_model.progress_series`) with `media_s` (`heartbeat_media_s`) on every point: what
    the job page's progress chart draws. Pure (returns new dicts)."""
    return [{**s, "points": [{**p, "media_s": heartbeat_media_s(p, source_duration_s)} for p in s["points"]]}
            for s in series]


def published_artifacts(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's outputs that are not a rendition's (`job_state.outputs` beyond the renditions' and
    the audio's folders: the poster, storyboard and WebVTT track of `thumbnails`, or any other
    stage's), each `{"name": path beside the master playlist, "stage", "content_type", "sha256",
    "size_bytes", "url", "published_key", "where"}`; `url` is where publish put it (beside `master_url`),
    None until a `Published` recorded the job's URLs; `published_key` the object key publish copies it
    to (`published/{job}/{name}`); `where` what a view prints: the URL, else that no URL is recorded and
    the key. ("not published yet" was said of thumbnails a stopped publish had already made public: the
    copy happens before `Published` is recorded, issue 45.) Pure."""
    folders = {r["name"] for r in (row.get("ladder") or []) + (row.get("renditions") or [])} | {"audio"}
    master = web_url(row.get("master_url"))  # an http(s) URL or None (domain/links.py)
    base = master.rsplit("/", 1)[0] + "/" if master and not row.get("reused_from") else None
    found = []
    for output in row.get("outputs") or []:
        scoped = attempt_path(output["key"])
        if scoped is None or scoped[1].split("/", 1)[0] in folders:
            continue
        stage, path = scoped
        url = base + path if base else None
        key = f"published/{row['job_id']}/{path}"
        found.append({"name": path, "stage": stage, "content_type": output["content_type"],
                      "sha256": output["sha256"], "size_bytes": output["size_bytes"], "url": url,
                      "published_key": key, "where": url or f"(no public URL recorded; publish copies it to {key})"})
    return found


def archived_objects(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's archived objects (the `archive` stage's copy of the source and its manifest, under
    `archive/{job}/`, private: no URL), each `{"key", "content_type", "sha256", "size_bytes"}`. Pure."""
    return [{name: output[name] for name in ("key", "content_type", "sha256", "size_bytes")}
            for output in row.get("outputs") or [] if output["key"].startswith("archive/")]


def job_summary(row: dict[str, Any]) -> dict[str, Any]:
    """The JSON object `tapeline submit --json` and `status --json` print for one job (the API's job
    adds to it): `attempt` is the current stage's own attempt, `attempts` the most any stage started;
    `percent` is `percent_done`, `percent_text` how every view prints it."""
    summary: dict[str, Any] = {"job_id": row["job_id"], "state": row["state"], "stage": row["stage"],
                               "attempt": row["attempt"],  # the current stage's own attempt number
                               "attempts": row["attempts"], "source_duration_s": row["source_duration_s"]}
    if row["state"] != "completed":
        summary["error_class"] = row["error_class"]
        summary["reason"] = row["reason"]
    summary["master_url"] = web_url(row["master_url"])  # URLs an event carried: http(s) only (domain/links.py)
    summary["outputs"] = [{"name": r["name"], "width": r["width"], "height": r["height"], "url": web_url(r.get("url"))}
                          for r in (row["renditions"] or [])]
    summary["artifacts"] = published_artifacts(row)  # thumbnails' poster, storyboard, WebVTT track, ...
    summary["archived"] = archived_objects(row)  # the archive profile's preserved source and manifest
    summary["pipeline"] = row.get("pipeline")
    summary["percent"] = percent_done(row)
    summary["percent_text"] = percent_text(summary["percent"])
    # Issue 9: the tier, the degradation ladder and result reuse (migration 013).
    summary["priority"] = row.get("priority")
    summary["degraded"] = bool(row.get("degraded"))
    summary["degraded_reason"] = row.get("degraded_reason")
    summary["reused_from"] = row.get("reused_from")
    summary["leased_until"] = row["leased_until"].isoformat() if row["leased_until"] else None
    summary["progress_frames"] = row["progress_frames"]
    summary["checkpointed_s"] = row.get("checkpointed_s")  # media seconds in applied checkpoints (reused by a retry)
    summary["updated_at"] = row["updated_at"].isoformat()
    return summary


def reused_segments(payload: dict[str, Any], attempt: int) -> str:
    """Which segments a transcode success took from earlier attempts: `720p 0-2 (attempt 1); ...`.
    Segment keys are `work/{job}/transcode/{attempt}/{rendition}/seg_NNNNN.ts`."""
    reused: dict[tuple[str, str], list[int]] = {}
    for output in payload.get("outputs", []):
        parts = output["key"].split("/")
        if len(parts) == 6 and parts[0] == "work" and parts[3] != str(attempt) and parts[5].startswith("seg_"):
            reused.setdefault((parts[4], parts[3]), []).append(int(parts[5][4:].split(".")[0]))
    return "; ".join(f"{rendition} {min(ix)}-{max(ix)} (attempt {owner})" if len(ix) > 1 else
                     f"{rendition} {ix[0]} (attempt {owner})" for (rendition, owner), ix in sorted(reused.items()))


NOTIFICATION_EVENTS = ("NotificationIntended", "NotificationDelivered", "NotificationFailed",
                       "NotificationDeadLettered", "WebhookEndpointDisabled")
NOTIFICATION_DETAIL = ("notification_type", "endpoint_id", "try_number", "http_status", "elapsed_s", "tries",
                       "reason", "retry_at")
"""The notifier's events in a timeline: which endpoint, which try, what it answered (HTTP status; none:
no answer), seconds the POST took, why it failed and when the next try is due."""


def timeline_detail(row: dict[str, Any]) -> str:
    """The detail column of one timeline row (`projections.read_model.timeline`: `event_type`, `stage`,
    `attempt`, `payload`), the same text in `tapeline timeline`, its `--json`, the API's timeline
    and the job page: an event's own summary where it has one, then every fact of `SHOWN` its
    payload holds that the summary did not name (who acted, which dead letter, ...), and the object an
    `output_conflict` met (`in_the_way`, in the diagnosis' words)."""
    text = _summary(row)
    shown = {part.split("=", 1)[0] for part in text.split() if "=" in part}
    skip = shown | set(_SUMMARISED.get(row["event_type"], ()))
    extra = [f"{key}={row['payload'][key]}" for key in SHOWN if key not in skip and row["payload"].get(key) not in (None, "")]
    if row["payload"].get("in_the_way"):  # an output_conflict's object in the way, as the diagnosis names it
        extra.append(f"in_the_way={object_words(row['payload']['in_the_way'])}")
    return " ".join(part for part in (text, *extra) if part)


SHOWN = ("operator", "error_class", "reason", "kind", "detail", "frames_done", "out_time_s", "worker", "master_url",
         "dead_letter_id", "notification_type", "endpoint_id", "try_number", "http_status", "retry_at")
"""The payload facts a timeline row always shows when present (besides an event's own summary)."""

_SUMMARISED = {"ProviderBreakerChanged": ("http_status",)}
"""Facts an event's summary already gives in its own words (the breaker's `http=`): not repeated."""


def _summary(row: dict[str, Any]) -> str:
    payload = row["payload"]
    if row["event_type"] == "CheckpointRecorded":
        return (f"{payload['rendition']} #{payload['segment_index']} {payload['media_start_s']:.3f}"
                f"+{payload['media_duration_s']:.3f} s frames={payload['frames']} sha256={payload['sha256'][:12]}")
    if row["event_type"] == "ResultReused":
        return (f"reused_job_id={payload['reused_job_id']} objects={len(payload.get('outputs', []))} "
                f"verified=all fingerprint={payload['profile_fingerprint'][:12]}")
    if row["event_type"] == "JobAccepted":
        ladder = ",".join(r["name"] for r in payload.get("ladder", []))
        degraded = f" degraded ({payload.get('degraded_reason')})" if payload.get("degraded") else ""
        return f"tier={payload['priority']} ladder={ladder} preset={payload.get('x264_preset') or '-'}{degraded}"
    if row["event_type"] == "AttemptSucceeded" and row["stage"] == "transcode":
        reused = reused_segments(payload, row["attempt"])
        return (f"objects={len(payload.get('outputs', []))} elapsed_s={payload.get('elapsed_s', 0):.2f} "
                f"reused={reused or 'none'}")
    if row["event_type"] == "ProviderBreakerChanged":
        return (f"{payload['provider']} {payload['from_state']}->{payload['to_state']} until={payload.get('until') or '-'} "
                f"http={payload.get('http_status') or '-'} failures={payload['failures']} reason={payload['reason']}")
    if row["event_type"] == "JobDelayed":
        return (f"serving_region={payload['serving_region']} from_region={payload['from_region']} "
                f"epoch={payload['epoch']} state={payload['state']}")
    if row["event_type"] in NOTIFICATION_EVENTS:
        return " ".join(f"{k}={payload[k]}" for k in NOTIFICATION_DETAIL if payload.get(k) is not None)
    if row["event_type"] == "OutputsWithdrawn":
        return (f"objects={len(payload.get('keys', []))} public_since={payload.get('public_since') or '-'} "
                f"by={payload['withdrawn_by']} reason={payload['reason']}")
    if row["event_type"] == "PublishDeferred":
        quota = f" {payload['window']} {payload['used']}/{payload['limit']}" if payload.get("window") else ""
        return f"{payload['provider']} wait={payload['wait']}{quota} until={payload['until']}"
    for keys in (("error_class", "reason"), ("kind", "detail"), ("master_url",), ("frames_done", "out_time_s"),
                 ("worker", "lease_s"), ("filename", "size_bytes"), ("tier", "work_topic"), ("reason",)):
        if all(k in payload for k in keys):
            return " ".join(f"{k}={payload[k]}" for k in keys)
    if row["event_type"] == "AttemptSucceeded":
        return f"objects={len(payload.get('outputs', []))} elapsed_s={payload.get('elapsed_s', 0):.2f}"
    return ""

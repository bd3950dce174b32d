"""The one presenter of what the projections hold: pure functions from read-model rows to the words
and numbers every view shows (the CLI, the API and the dashboard's templates call these; none keeps
its own list). No I/O."""

from __future__ import annotations

from typing import Any


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
    """The detail column of one timeline row (`tapeline.read.timeline`: `event_type`, `stage`,
    `attempt`, `payload`), the same text in `tapeline timeline`, its `--json`, the API's timeline
    and the job page: an event's own summary where it has one, then every fact of `SHOWN` its
    payload holds that the summary did not name (who acted, which dead letter, ...)."""
    text = _summary(row)
    shown = {part.split("=", 1)[0] for part in text.split() if "=" in part}
    skip = shown | set(_SUMMARISED.get(row["event_type"], ()))
    extra = [f"{key}={row['payload'][key]}" for key in SHOWN if key not in skip and row["payload"].get(key) not in (None, "")]
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

"""What each operator action writes: pure `*_events(row, ...) -> [(topic, event)]` over the job's
projected row, stamped by the clock given (`processors/operator.py` runs them: the caught-up read
before, one Kafka transaction after). Each returns [] when the job is not in a state the action
applies to, so a repeated or racing action changes nothing. Also `done_by`, who did an action, read
from a job's timeline.
"""

from __future__ import annotations

from typing import Any

from domain import events as ev
from domain.lifecycle import REOPENABLE_STATES, TERMINAL_STATES
from processors.runtime import Outgoing
from processors.watchdog import queue_attempt
from tapeline.ports import Clock
from tapeline.settings import Settings


def done_by(timeline: list[dict[str, Any]], event_types: tuple[str, ...]) -> str | None:
    """"by OPERATOR at YYYY-MM-DD HH:MM:SS UTC" of the latest applied event of `event_types` in a
    job's timeline (rows of the `job_timeline` operation, broker time), or None when there is none.
    Pure."""
    done = [row for row in timeline if row["event_type"] in event_types and row["applied"]]
    if not done:
        return None
    last = done[-1]
    operator = (last.get("payload") or {}).get("operator") or last["recorded_by"]
    return f"by {operator} at {last['broker_ts']:%Y-%m-%d %H:%M:%S} UTC"


def replay_events(row: dict[str, Any] | None, dead_letter_id: str, operator: str, reason: str,
                  settings: Settings, recorded_by: str, *, clock: Clock) -> list[Outgoing]:
    """The events that replay a dead-lettered (or needs-review) job, stamped by `clock`. Pure.

    `JobReplayed` (operator, reason, dead letter id; stage and attempt of the attempt that ended
    the job, so its dedup key is unique per dead letter) + `StageQueued` + `WorkItem` of the same
    stage's next attempt. The projection restarts the attempt budget at the replayed attempt
    (`fold.attempts_used`). Returns [] when the job is not in a reopenable state: replaying twice,
    or replaying a job that completed meanwhile, changes nothing.
    """
    if row is None or row["state"] not in REOPENABLE_STATES:
        return []
    common = dict(job_id=row["job_id"], recorded_by=recorded_by, correlation_id=row["upload_id"])
    replayed = ev.JobReplayed.new(clock.stamp(), stage=row["stage"], attempt=row["attempt"], operator=operator, reason=reason,
                                  dead_letter_id=dead_letter_id, **common)
    return [(settings.jobs_topic, replayed)] + queue_attempt(row, row["stage"], row["attempt"] + 1,
                                                             dict(common, causation_id=replayed.event_id), settings,
                                                             clock=clock)


def resolve_review_events(row: dict[str, Any] | None, operator: str, reason: str, posted_ref: str | None,
                          provider: str, settings: Settings, recorded_by: str, *, clock: Clock) -> list[Outgoing]:
    """The events that resolve a job in needs_review, stamped by `clock`. Pure.

    `posted_ref` given (the operator found the post at the provider): `JobReplayed` + `Published`
    (that provider, that ref, the origin's master URL) + `JobCompleted`: the job completes without
    another post. Otherwise (the operator checked that no post exists; the caller has released the
    claim marker): `JobReplayed` + the next publish attempt, which creates a fresh marker and posts.
    Returns [] when the job is not in needs_review.
    """
    if row is None or row["state"] != "needs_review":
        return []
    common = dict(job_id=row["job_id"], recorded_by=recorded_by, correlation_id=row["upload_id"])
    replayed = ev.JobReplayed.new(clock.stamp(), stage=row["stage"], attempt=row["attempt"], operator=operator, reason=reason,
                                  dead_letter_id=None, **common)
    out: list[Outgoing] = [(settings.jobs_topic, replayed)]
    caused = dict(common, causation_id=replayed.event_id)
    if posted_ref is None:
        return out + queue_attempt(row, row["stage"], row["attempt"] + 1, caused, settings, clock=clock)
    renditions = [ev.Rendition(**r) for r in (row.get("renditions") or [])]
    master_key = f"published/{row['job_id']}/master.m3u8"
    return out + [
        (settings.jobs_topic, ev.Published.new(clock.stamp(), stage="publish", attempt=row["attempt"], sequence=f"{provider}-review",
                                               provider=provider, provider_ref=posted_ref, master_key=master_key,
                                               master_url=row.get("master_url") or "", renditions=renditions,
                                               **caused)),
        (settings.jobs_topic, ev.JobCompleted.new(clock.stamp(), stage="publish", attempt=row["attempt"],
                                                  master_url=row.get("master_url") or "",
                                                  media_duration_s=row.get("source_duration_s"), **caused)),
    ]


def cancel_events(row: dict[str, Any] | None, operator: str, reason: str, settings: Settings,
                  recorded_by: str, *, clock: Clock) -> list[Outgoing]:
    """The events that cancel a job: one `JobCancelled` (operator, reason; stamped by `clock`) on its current stage and
    attempt, so its dedup key is `{job}:{stage}:{attempt}:JobCancelled`. Pure.

    Returns [] when the job has no row or has ended (completed, rejected, failed, cancelled,
    dead_lettered, needs_review): the projection would not apply it (a dead-lettered or needs-review
    job is reopened only by `JobReplayed`), so cancelling twice changes nothing. A running attempt
    learns of it at its next heartbeat (the job ended) and stops its ffmpeg.
    """
    if row is None or row["state"] in TERMINAL_STATES:
        return []
    return [(settings.jobs_topic, ev.JobCancelled.new(clock.stamp(), job_id=row["job_id"], stage=row["stage"], attempt=row["attempt"],
                                                      operator=operator, reason=reason, recorded_by=recorded_by,
                                                      correlation_id=row["upload_id"]))]


def fail_events(row: dict[str, Any] | None, dead_letter_id: str, operator: str, reason: str, refund: bool,
                settings: Settings, recorded_by: str, *, clock: Clock) -> list[Outgoing]:
    """The events that end a dead-lettered job as failed for good, stamped by `clock`. Pure.

    The fold reopens a dead-lettered job only by `JobReplayed`, so: `JobReplayed` (operator, "to fail
    it for good: reason", the dead letter, which leaves the pending list) + `JobFailed` (the dead
    letter's error class, "failed for good by OPERATOR: reason", `operator`, `dead_letter_id`,
    `refunded`; caused by that JobReplayed) in one transaction, both on the dead-lettered attempt: no
    attempt is queued. `refunded` takes the job out of its submitter's daily quota count (the
    `submitter_jobs_between` query), once, whatever is repeated: the job is counted or it is not.
    Returns [] when the job is not dead_lettered.
    """
    if row is None or row["state"] != "dead_lettered":
        return []
    common = dict(job_id=row["job_id"], stage=row["stage"], attempt=row["attempt"], recorded_by=recorded_by,
                  correlation_id=row["upload_id"])
    replayed = ev.JobReplayed.new(clock.stamp(), operator=operator, reason=f"to fail it for good: {reason}",
                                  dead_letter_id=dead_letter_id, **common)
    failed = ev.JobFailed.new(clock.stamp(), sequence="operator", error_class=row["error_class"] or "unknown",
                              reason=f"failed for good by {operator}: {reason}"
                                     + (" (quota refunded)" if refund else ""),
                              operator=operator, dead_letter_id=dead_letter_id, refunded=refund,
                              causation_id=replayed.event_id, **common)
    return [(settings.jobs_topic, replayed), (settings.jobs_topic, failed)]


def dismiss_events(letter: dict[str, Any] | None, operator: str, reason: str, settings: Settings, recorded_by: str,
                   *, clock: Clock) -> list[Outgoing]:
    """The event that closes a dead letter of an undecodable record (kind `record` or `projection`),
    stamped by `clock`. Pure.

    A `DeadLetterDismissed` on the dead-letter topic whose envelope job id is the dead letter's id
    (as its `DeadLetter`'s: the record's source position), stage "operator", attempt 0; its dedup key
    is therefore one per dead letter. Returns [] for no letter, a job's dead letter (replay or fail
    it: the job needs an ending) and one already dismissed."""
    if letter is None or letter["kind"] == "job" or letter.get("dismissed_at") is not None:
        return []
    dismissed = ev.DeadLetterDismissed.new(clock.stamp(), job_id=letter["id"], stage="operator", attempt=0,
                                           recorded_by=recorded_by, correlation_id=letter["id"],
                                           dead_letter_id=letter["id"], operator=operator, reason=reason)
    return [(settings.dlq_topic, dismissed)]

"""The pure core of the job projection: `evolve(row, event, broker_ts) -> Outcome`.

A row is a plain dict with the columns of `job_state`. Rules (docs/design.md "Job states"):
- a terminal job (completed, rejected, failed, cancelled) never changes again;
- dead_lettered and needs_review are reopened only by `JobReplayed`;
- an event written by an attempt carries its claim token; one whose token is not the job's
  current one is superseded: kept as evidence, never applied (fencing in the projection);
- an `AttemptStarted` older than the current attempt of its stage is superseded too;
- an event that ends a job (JobCompleted, JobFailed, JobDeadLettered, NeedsReview, JobCancelled)
  follows one rule whose data is in `schemas/lifecycle.json` ("ending"), not a branch per event;
  while an attempt runs, one without a claim token ends the job only as its `without_claim` says
  (an operator's cancel, the watchdog's dead letter after a stall), else it is superseded.
The projector checks dedup keys before calling this: a repeated dedup key is never evolved.
A second implementation of these rules (and of `projections.fold.fold_batch`) folds fresh replays:
`Engine::evolve` in native/src/lib.rs. Change both; tests/unit/test_native_fold.py compares them.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, NamedTuple

from domain import events as ev
from domain.lifecycle_data import LIFECYCLE, Ending
from domain.pipeline import stage_position

# The lifecycle data lives in schemas/lifecycle.json (read by domain/lifecycle_data.py here and by
# native/build.rs for the Rust engine): change it there.
STATES: tuple[str, ...] = LIFECYCLE.states
FINAL_STATES: frozenset[str] = LIFECYCLE.final_states
REOPENABLE_STATES: frozenset[str] = LIFECYCLE.reopenable_states
TERMINAL_STATES: frozenset[str] = FINAL_STATES | REOPENABLE_STATES
FREE_STALL_KINDS: frozenset[str] = LIFECYCLE.free_stall_kinds
"""Stall kinds that give their attempt back (counted like a yield): `region_lost`."""
STAGE_ORDER: dict[str, int] = LIFECYCLE.stage_order
ENDING: dict[str, Ending] = LIFECYCLE.ending
"""Event type -> how it ends a job (`lifecycle_data.Ending`): the `ending` events' one rule."""


class Outcome(NamedTuple):
    """What one event did: the new row (None when the job has no row), and the evidence flags.

    When `applied`, `row` is a new dict that nobody else holds (the caller may keep or amend it).
    (A named tuple, not a frozen dataclass: built once per event, it is 4x cheaper.)
    """

    row: dict[str, Any] | None
    applied: bool
    superseded: bool


def _dump(items: list) -> list[dict]:
    return [item.model_dump() for item in items]


def evolve(row: dict[str, Any] | None, event: ev.Event, broker_ts: datetime) -> Outcome:
    """Fold one event onto a job row. Pure: `row` is not modified; a new dict is returned."""
    kind = event.event_type
    if row is None:
        if isinstance(event, ev.JobAccepted):
            return Outcome(_accepted(event, broker_ts), True, False)
        if isinstance(event, ev.JobRejected):
            return Outcome(_new_row(event, broker_ts, upload_id=event.upload_id, state="rejected", stage="intake",
                                    error_class=event.error_class, reason=event.reason, completed_at=broker_ts),
                           True, False)
        return Outcome(None, False, False)  # an event of an unknown job: evidence only

    state = row["state"]
    if state in FINAL_STATES:
        return Outcome(row, False, False)
    if state in REOPENABLE_STATES and not isinstance(event, ev.JobReplayed):
        return Outcome(row, False, False)
    if kind != "AttemptStarted" and event.claim_token is not None and event.claim_token != row.get("claim_token"):
        return Outcome(row, False, True)
    if state == "running" and event.claim_token is None and (end := ENDING.get(kind)) is not None \
            and not _ends_without_claim(end, row):
        return Outcome(row, False, True)  # an ending event without the running attempt's claim (issue 44)
    if isinstance(event, ev.AttemptStarted) and _older_attempt(row, event):
        return Outcome(row, False, True)
    if isinstance(event, ev.StageQueued) and not _newer_attempt(row, event):
        return Outcome(row, False, True)  # a stage attempt already queued or passed
    if isinstance(event, (ev.StallDetected, ev.RetryScheduled)) and (event.stage, event.attempt) != (row["stage"], row["attempt"]):
        return Outcome(row, False, True)  # about an attempt that is no longer current

    new = dict(row, events=row["events"] + 1, last_event_type=kind, updated_at=broker_ts)
    if isinstance(event, ev.StageQueued):
        new.update(state="queued", stage=event.stage, attempt=event.attempt, claim_token=None, worker=None,
                   leased_until=None, progress_frames=None, progress_out_time_s=None, progress_speed=None,
                   progress_at=None, queued_at=broker_ts, redrives=0, retry_next_attempt=None, retry_due_at=None,
                   progress_grace_s=None)
    elif isinstance(event, ev.AttemptStarted):
        new.update(state="running", stage=event.stage, attempt=event.attempt, claim_token=event.claim_token,
                   worker=event.worker, lease_s=event.lease_s,
                   leased_until=broker_ts + timedelta(seconds=event.lease_s),
                   attempts=max(row["attempts"], event.attempt), progress_frames=0, progress_out_time_s=0.0,
                   progress_speed=None, progress_at=broker_ts, last_heartbeat_at=broker_ts, progress_grace_s=None)
    elif isinstance(event, ev.Heartbeat):
        advanced = event.frames_done > (row.get("progress_frames") or 0) or \
            event.out_time_s > (row.get("progress_out_time_s") or 0.0)
        new.update(leased_until=broker_ts + timedelta(seconds=row.get("lease_s") or 0.0), last_heartbeat_at=broker_ts,
                   progress_frames=event.frames_done, progress_out_time_s=event.out_time_s,
                   progress_speed=event.speed, progress_at=broker_ts if advanced else row.get("progress_at"))
        # A grace for a silent decode holds until a heartbeat without one shows the counters moving.
        if event.progress_grace_s:
            new.update(progress_grace_s=event.progress_grace_s)
        elif advanced:
            new.update(progress_grace_s=None)
    elif isinstance(event, ev.AttemptSucceeded):
        stages = row.get("pipeline_stages")
        if not stages:  # a job accepted before profiles: the old rule, transcode's outputs only
            if event.stage == "transcode":
                new.update(outputs=_dump(event.outputs), ladder=_dump(event.renditions),
                           audio_playlist_key=event.audio_playlist_key)
        elif event.stage in stages and event.stage != stages[-1]:
            # Every stage but the last hands its outputs on: they add to the job's (what the last
            # stage, publish, promotes); a stage that made renditions (transcode) sets the ladder.
            new.update(outputs=(row.get("outputs") or []) + _dump(event.outputs))
            if event.renditions:
                new.update(ladder=_dump(event.renditions), audio_playlist_key=event.audio_playlist_key)
        new.update(leased_until=None)
    elif isinstance(event, (ev.AttemptFailed,)):
        new.update(error_class=event.error_class, reason=event.reason, leased_until=None)
    elif isinstance(event, ev.AttemptYielded):
        new.update(leased_until=None, reason=event.reason, yields=row["yields"] + 1)
    elif isinstance(event, ev.PublishDeferred):  # the provider was not called: like a yield, no attempt used
        new.update(yields=row["yields"] + 1)
    elif isinstance(event, ev.StallDetected):
        new.update(reason=f"stalled ({event.kind}) for {event.since_s:.1f} s: {event.detail}".rstrip(": "))
        if event.kind == "handoff":
            new.update(queued_at=broker_ts, redrives=row["redrives"] + 1)
        elif event.kind in FREE_STALL_KINDS:  # lost with its region, not by its work: no attempt used
            new.update(yields=row["yields"] + 1)
    elif isinstance(event, ev.RetryScheduled):
        delay = max(timedelta(0), event.not_before - event.occurred_at)  # the writer's delay, on the broker's clock
        new.update(state="retry_scheduled", error_class=event.error_class, retry_next_attempt=event.next_attempt,
                   retry_due_at=broker_ts + delay, leased_until=None)
    elif isinstance(event, ev.ResultReused):
        new.update(reused_from=event.reused_job_id, master_url=event.master_url, renditions=_dump(event.renditions))
    elif isinstance(event, ev.Published):
        new.update(master_url=event.master_url, renditions=_dump(event.renditions))
    elif (end := ENDING.get(kind)) is not None:  # JobCompleted, JobFailed, ...: schemas/lifecycle.json
        new.update(state=end.state, completed_at=broker_ts, leased_until=None)
        for column in end.copies:
            new[column] = getattr(event, column)
        for column in end.clears:
            new[column] = None
    elif isinstance(event, ev.JobReplayed):
        if state not in REOPENABLE_STATES:
            return Outcome(row, False, False)
        # A fresh attempt budget: attempts used from here on count from the current attempt.
        new.update(state="queued", completed_at=None, error_class=None, budget_base=row["attempt"], yields=0,
                   reason=f"replayed by {event.operator}: {event.reason}")
    elif isinstance(event, (ev.JobAccepted, ev.JobRejected)):
        return Outcome(row, False, False)  # the job already exists: a second intake decision is evidence only
    # PublishIntended, CheckpointRecorded, StallDetected: evidence with no state change beyond bookkeeping.
    return Outcome(new, True, False)


def attempts_used(row: dict[str, Any], attempt: int | None = None) -> int:
    """Attempts of the current budget used once `attempt` (default: the row's) has run: yields (and
    publish deferrals, counted with them) and attempts before the last operator replay do not count
    (docs/design.md "Error classes")."""
    current = row["attempt"] if attempt is None else attempt
    return current - (row.get("budget_base") or 0) - (row.get("yields") or 0)


def position(row: dict[str, Any], stage: str | None, attempt: int) -> tuple[int, int]:
    """(where `stage` comes in the job's pipeline, `attempt`): the order of a job's attempts. The
    position is `pipeline.stage_position` in the row's recorded `pipeline_stages` (a job accepted
    before profiles: the fixed `STAGE_ORDER`)."""
    return stage_position(stage, row.get("pipeline_stages")), attempt


def _ends_without_claim(end: Ending, row: dict[str, Any]) -> bool:
    """Whether an ending event with no claim token ends `row`'s running attempt: its rule's
    `without_claim` (schemas/lifecycle.json) is "always" (an operator's cancel), or "after_stall"
    and the row's last applied event is the attempt's `StallDetected` (the watchdog writes the two
    in one transaction; its dead letters carry the stalled attempt's claim now, older logs do not)."""
    return end.without_claim == "always" or \
        (end.without_claim == "after_stall" and row.get("last_event_type") == "StallDetected")


def _newer_attempt(row: dict[str, Any], event: ev.Event) -> bool:
    return position(row, event.stage, event.attempt) > position(row, row["stage"], row["attempt"])


def _older_attempt(row: dict[str, Any], event: ev.AttemptStarted) -> bool:
    return position(row, event.stage, event.attempt) < position(row, row["stage"], row["attempt"])


def _new_row(event: ev.Event, broker_ts: datetime, **values: Any) -> dict[str, Any]:
    row = {column: None for column in JOB_STATE_COLUMNS}
    row.update(job_id=event.job_id, attempt=0, attempts=0, events=1, last_event_type=event.event_type,
               created_at=broker_ts, updated_at=broker_ts, yields=0, redrives=0, budget_base=0)
    row.update(values)
    return row


def _accepted(event: ev.JobAccepted, broker_ts: datetime) -> dict[str, Any]:
    media = event.media
    return _new_row(event, broker_ts, upload_id=event.upload_id, state="accepted", stage="intake",
                    priority=event.priority, profile=event.profile, source_key=event.source_key,
                    source_sha256=event.source_sha256, source_size_bytes=event.source_size_bytes,
                    source_duration_s=media.duration_s, source_width=media.display_width,
                    source_height=media.display_height, ladder=_dump(event.ladder),
                    profile_fingerprint=event.profile_fingerprint, degraded=event.degraded,
                    degraded_reason=event.degraded_reason, x264_preset=event.x264_preset,
                    pipeline=event.pipeline, pipeline_stages=event.pipeline_stages or None)


JOB_STATE_COLUMNS: tuple[str, ...] = LIFECYCLE.job_state_columns
"""Columns of `job_state`, in table order (`schemas/lifecycle.json`; a test checks them against the migration)."""


EVIDENCE_COLUMNS: tuple[str, ...] = LIFECYCLE.evidence_columns
"""Columns of `lifecycle_evidence`, in table order (`schemas/lifecycle.json`, as the Rust engine)."""
PAYLOAD_OMITS: set[str] = set(LIFECYCLE.payload_omits)
"""The envelope fields an evidence row has a column for (event_id, event_type, job_id, stage, attempt,
claim_token, occurred_at, recorded_by, causation_id, dedup_key; `schemas/lifecycle.json`, which a test
checks equals the envelope's fields that are `EVIDENCE_COLUMNS`), left out of its `payload` JSON: the
row holds each value once, and the payload (the JSON the server checks for every row) is about 2.5
times smaller, which doubles the rows/s PostgreSQL takes in a replay (`bench/replay.py`). An event's
own fields and `correlation_id` stay in the payload. (A set, not a frozenset: pydantic's `exclude`.)"""

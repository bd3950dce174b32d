"""The shapes of the read API (`projections/api.py`): how rows become JSON, the pydantic models of
answers and action bodies, the documented error answers (`ERRORS`) and the limits on what an action
takes. No I/O: the routers (`api_reads.py`, `api_actions.py`, `api_pages.py`) use these."""

from __future__ import annotations

from domain import pipeline

import base64
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from domain import lifecycle
from projections import presenter
from projections.presenter import timeline_detail

STATES = lifecycle.STATES  # schemas/lifecycle.json, in lifecycle order
State = Literal[STATES]  # type: ignore[valid-type]  (a job state, checked by FastAPI)
Stage = Literal[(pipeline.INTAKE, *pipeline.STAGE_NAMES)]  # type: ignore[valid-type]  # domain/pipeline.py
PG_BIGINT_MAX = 2**63 - 1
"""The largest OFFSET PostgreSQL takes (bigint); a larger one would reach psycopg and fail there."""
Priority = Literal["archive", "standard", "index"]


def iso(value: Any) -> Any:
    """A `datetime` as ISO 8601 text; any other value as it is."""
    return value.isoformat() if isinstance(value, datetime) else value


def job_json(row: dict[str, Any]) -> dict[str, Any]:
    """One job for the API: `presenter.job_summary` (what `tapeline status --json` prints) plus priority,
    upload, worker, error class and reason (always), progress and times (broker time, ISO)."""
    data = presenter.job_summary(row)
    data.update({name: iso(row.get(name)) for name in (
        "upload_id", "priority", "worker", "error_class", "reason", "progress_out_time_s", "progress_speed",
        "progress_at", "last_event_type", "events", "created_at", "completed_at")})
    return data


def plain(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with its times as ISO 8601 text."""
    return {k: iso(v) for k, v in row.items()}


def event_json(row: dict[str, Any]) -> dict[str, Any]:
    """One timeline row (`read_model.timeline`) for the API: every column, times as ISO 8601 text, and
    `flags` (superseded, duplicate, or evidence for an event that changed no state) and `detail` (the
    text every view shows for it: `projections/presenter.py` `timeline_detail`)."""
    flags = [f for f in ("superseded", "duplicate") if row[f]] or ([] if row["applied"] else ["evidence"])
    return {"broker_ts": iso(row["broker_ts"]), "event_id": row["event_id"], "event_type": row["event_type"],
            "stage": row["stage"], "attempt": row["attempt"], "claim_token": row["claim_token"],
            "occurred_at": iso(row["occurred_at"]), "recorded_by": row["recorded_by"],
            "causation_id": row["causation_id"], "dedup_key": row["dedup_key"], "applied": row["applied"],
            "superseded": row["superseded"], "duplicate": row["duplicate"], "flags": flags,
            "partition": row["partition"], "offset": row["offset"], "payload": row["payload"],
            "detail": timeline_detail(row)}


def letter_json(row: dict[str, Any], raw: bool = False) -> dict[str, Any]:
    """One dead letter for the API, times as ISO 8601 text; with `raw` its record's key and value
    (base64, None when absent) and headers too."""
    data = {k: iso(v) for k, v in row.items() if k not in ("key", "value", "headers")}
    if raw:
        for name in ("key", "value"):
            data[name] = base64.b64encode(bytes(row[name])).decode() if row.get(name) is not None else None
        data["headers"] = row.get("headers")
    return data


class JobPage(BaseModel):
    """One page of jobs: `jobs` (newest last event first), `total` matching the filters."""

    jobs: list[dict[str, Any]]
    total: int
    limit: int
    offset: int


class SameSourceJob(BaseModel):
    """Another job of the same source sha256 and how it ended (or where it is)."""

    job_id: str
    state: str
    error_class: str | None = None


class DiagnosisOut(BaseModel):
    """`domain.diagnosis.Diagnosis` as the API answers it: what happened and what to do, in plain words."""

    summary: str = Field(description="One or two plain sentences: what happened to the job")
    stall: str | None = Field(None, description="The last stall in words (ffmpeg stopped advancing, the worker "
                                                "stopped heartbeating, ...); null when none")
    permanent: bool | None = Field(None, description="true: a retry would fail the same way; false: a retry may "
                                                     "pass; null: nothing failed")
    verdict: str | None = Field(None, description="`permanent` in words, as the CLI and the job page show it "
                                                  "(Permanent, Not permanent); null: nothing failed")
    why: str | None = Field(None, description="Why `permanent` is what it is (the error-class table, a repeat "
                                              "after a replay, the same file failing in another job)")
    action: str = Field(description="What an operator should do")
    same_source: list[SameSourceJob] = Field(description="Other jobs of the same source sha256, newest first")


class JobDetail(BaseModel):
    """One job with its attempts (view `attempts`), per-stage durations (view `stage_durations`) and
    checkpoints (`CheckpointRecorded` evidence; empty until checkpointed transcoding writes them)."""

    job: dict[str, Any]
    attempts: list[dict[str, Any]]
    stage_durations: list[dict[str, Any]]
    checkpoints: list[dict[str, Any]]
    source: dict[str, Any] | None = Field(None, description="The source: upload (filename, size, sha256), the "
                                          "probe summary per stream, and other jobs of the same sha256 "
                                          "(`projections.read_model.job_source`)")
    diagnosis: DiagnosisOut | None = Field(None, description="What happened and what to do, in plain words: "
                                             "summary, stall, permanent, why, action, same_source "
                                             "(`domain.diagnosis.diagnose`)")
    suspect: dict[str, Any] | None = Field(None, description="The running attempt when it is suspect before the "
                                           "watchdog's verdict: `reason` (\"no progress for 95 s of the 120 s "
                                           "allowance\"), `remaining_s`, the tool's state "
                                           "(`projections.read_model.suspect_attempts`)")
    stall_evidence: dict[str, Any] | None = Field(None, description="What the tool was doing at the job's last "
                                                  "stall that recorded it: `tool_state` and `lines` "
                                                  "(`projections.read_model.job_stall_evidence`)")


class Problem(BaseModel):
    """An error answer, FastAPI's shape: `detail` says what was wrong (a string; a 422 from request
    validation carries FastAPI's list of `{loc, msg, type}` instead)."""

    detail: str | list[dict[str, Any]]


ERRORS: dict[int, str] = {
    400: "A NUL byte (%00) in the path or a query value, or a body that is not valid JSON or holds what no field "
         "can (a lone surrogate, a number that is not finite)",
    401: "No valid `Authorization: Bearer <TAPELINE_ADMIN_TOKEN>` (or the server has no admin token)",
    404: "No such job or dead letter in the projections",
    409: "The action does not apply to what the job or dead letter is now",
    413: "The body is larger than `serve_max_body_bytes` (checked before it is read)",
    415: "An action's body not sent as JSON (`Content-Type: application/json`; checked before it is read)",
    422: "A parameter or body field out of its range or shape",
    503: "PostgreSQL, Kafka or the operator actions are not available",
}
"""What each error status of the read API and actions means: the one list the routes' documented
responses (`answers`) and docs/operating.md follow."""


def answers(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route: each of `statuses` with its meaning (`ERRORS`) and the `Problem`
    shape, so the OpenAPI document names every status the route can answer. Raises KeyError for a
    status without a meaning in `ERRORS`."""
    return {status: {"model": Problem, "description": ERRORS[status]} for status in statuses}


READS = answers(400, 422, 503)
"""The error answers of a read with parameters (a NUL, a value out of range, a service down)."""
ONE = answers(400, 404, 422, 503)
"""The error answers of a read of one job or dead letter."""
ACTIONS = answers(400, 401, 404, 409, 413, 415, 422, 503)
"""The error answers of an operator action."""


OPERATOR_MAX, WHY_MAX, ID_MAX, TOKEN_MAX = 200, 2000, 500, 1000
"""Longest operator name, reason, id (a dead letter's, a provider's post ref) and admin token an
action takes, characters: the same for the JSON API and the dashboard's forms."""
NUL_FREE = r"^[^\x00]*$"
"""Every text an action takes (JSON field or form field) matches this: PostgreSQL text cannot hold
a NUL byte, so an event carrying one could not be projected. A NUL answers 422."""


class Action(BaseModel):
    """Who does it and why: recorded in the event (`operator`, `reason`) and so in the timeline."""

    operator: str = Field(..., min_length=1, max_length=OPERATOR_MAX, pattern=NUL_FREE, description="Who acts (a person's name or login)")
    why: str = Field(..., min_length=1, max_length=WHY_MAX, pattern=NUL_FREE, description="Why: recorded as the event's reason")


class ReplayRequest(Action):
    dead_letter_id: str = Field(..., min_length=1, max_length=ID_MAX, pattern=NUL_FREE, description="Id from /api/dead-letters, e.g. JOB/ATTEMPT")


class FailRequest(Action):
    dead_letter_id: str = Field(..., min_length=1, max_length=ID_MAX, pattern=NUL_FREE, description="Id from /api/dead-letters, e.g. JOB/ATTEMPT")
    refund: bool = Field(False, description="Credit the submitter's daily quota back (once)")


class DismissRequest(Action):
    dead_letter_id: str = Field(..., min_length=1, max_length=ID_MAX, pattern=NUL_FREE,
                                description="Id of an undecodable record's dead letter, e.g. TOPIC/PARTITION/OFFSET")


class ResolveRequest(Action):
    posted_ref: str | None = Field(None, max_length=ID_MAX, pattern=NUL_FREE, description="The provider's id of the post you found: record it, "
                                                     "complete the job, post nothing")
    not_posted: bool = Field(False, description="You checked: the provider has no post; release the claim "
                                                "marker and publish again")

    @model_validator(mode="after")
    def _one_finding(self) -> "ResolveRequest":
        if (self.posted_ref is None) == (not self.not_posted):
            raise ValueError("say what you found: posted_ref or not_posted=true (exactly one)")
        return self


class ActionResult(BaseModel):
    """What an action did: `done` false when it changed nothing (already replayed, ...)."""

    action: Literal["replay", "fail", "dismiss", "resolve_review", "cancel"]
    job_id: str | None
    done: bool
    detail: str
    next_attempt: int | None = None


def as_utc(value: datetime | None) -> datetime | None:
    """A filter time as UTC: a time without a zone is taken as UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=timezone.utc)

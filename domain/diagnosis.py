"""What happened to a job, in plain words, and what an operator should do (issue 26 item 1).

`diagnose(job, events, same_source, now)` is pure: the job's projected row, its applied lifecycle
events in log order and the other jobs of the same source sha256 in, one `Diagnosis` out. The CLI
(`tapeline status JOB`), the read API (`/api/jobs/{id}`) and the job page all show this one text.
Permanence, what a retry would do and what to do come from the error-class table
(`domain/error_classes.py` `ERROR_CLASSES`) and from the job's own history: a job that failed the
same way after a replay, or whose exact file failed the same way in another job, will most likely
fail again. An `output_conflict` names the object in the way (its key, size, sha256 and when it was
written, from the dead letter's `in_the_way`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Mapping, Sequence

from domain.error_classes import ErrorClass, error_class as error_class_row
from domain.policy.tool_state import explain_tool_state

STALL_WORDS: dict[str, str] = {
    "no_progress": "ffmpeg stopped advancing while its worker was alive",
    "lease_expired": "the worker stopped heartbeating",
    "worker_exited": "the worker process exited",
    "handoff": "no worker picked the work up",
    "expected_work_missing": "the upload did not become a job",
    "region_lost": "its region was lost and another took over",
}
"""Each `StallDetected.kind` in an operator's words."""

VERDICTS: dict[bool, str] = {True: "Permanent", False: "Not permanent"}
"""How `Diagnosis.permanent` reads, the same words in the CLI and on the job page, followed by `why`
(which says what a retry would do in the error table's words: never said twice)."""


@dataclass(frozen=True)
class Diagnosis:
    """`summary`: one or two plain sentences; `stall`: the last stall in words (None: no stall);
    `permanent`: True when retrying would fail the same way, False when a retry may pass, None when
    nothing failed; `why`: the reason for `permanent`; `action`: what an operator should do;
    `same_source`: the other jobs of the same file, `[{job_id, state, error_class}]` newest first."""

    summary: str
    action: str
    stall: str | None = None
    permanent: bool | None = None
    why: str | None = None
    same_source: tuple[dict[str, Any], ...] = field(default_factory=tuple)

    @property
    def verdict(self) -> str | None:
        """`permanent` in words (`VERDICTS`), None when nothing failed."""
        return None if self.permanent is None else VERDICTS[self.permanent]

    def as_dict(self) -> dict[str, Any]:
        return {"summary": self.summary, "stall": self.stall, "permanent": self.permanent, "verdict": self.verdict,
                "why": self.why, "action": self.action, "same_source": [dict(o) for o in self.same_source]}


def stall_words(kind: str, detail: str = "") -> str:
    """`kind` in words; a worker's exit carries its detail (`worker process 12 killed by SIGKILL`)."""
    words = STALL_WORDS.get(kind, f"it stalled ({kind})")
    return f"{words} ({detail})" if kind in ("worker_exited", "region_lost") and detail else words


def _incidents(events: Sequence[Mapping[str, Any]]) -> list[tuple[int, str, int, str, str | None]]:
    """(position, stage, attempt, words, error class) of every stall and failure, in log order."""
    found = []
    for i, e in enumerate(events):
        payload = e.get("payload") or {}
        if e["event_type"] == "StallDetected" and payload.get("kind") in ("no_progress", "lease_expired", "worker_exited"):
            tool = explain_tool_state(payload.get("tool_state"))  # what the worker last saw of ffmpeg (issue 45)
            found.append((i, e["stage"], e["attempt"], "stalled: " + stall_words(payload["kind"], payload.get("detail", ""))
                          + (f": {tool}" if tool else ""), None))
        elif e["event_type"] == "AttemptFailed":
            found.append((i, e["stage"], e["attempt"], f"failed: {payload.get('error_class')} ({payload.get('reason')})",
                          payload.get("error_class")))
    return found


def _told(incidents: list[tuple[int, str, int, str, str | None]]) -> str:
    return "; ".join(f"{stage} attempt {attempt} {words}" for _, stage, attempt, words, _ in incidents)


def _same_source_text(same: Sequence[Mapping[str, Any]]) -> str:
    if not same:
        return ""
    counts: dict[str, int] = {}
    for other in same:
        counts[other["state"]] = counts.get(other["state"], 0) + 1
    return " Other jobs of the same file: " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) + "."


def diagnose(job: Mapping[str, Any], events: Sequence[Mapping[str, Any]],
             same_source: Sequence[Mapping[str, Any]], now: datetime) -> Diagnosis:
    """The diagnosis of one job.

    `job`: its `job_state` row (state, stage, attempt, attempts, error_class, reason, worker,
    retry_next_attempt, retry_due_at, queued_at, reused_from); `events`: its lifecycle events in log
    order, applied ones only, each `{event_type, stage, attempt, payload}`; `same_source`: other jobs
    of the same sha256 (`{job_id, state, error_class}`); `now`: the reader's time (UTC), for ages.
    """
    state, stage, attempt = job["state"], job["stage"], job["attempt"]
    error_class, reason = job.get("error_class"), job.get("reason")
    incidents = _incidents(events)
    stalls = [words for _, _, _, words, _ in incidents if words.startswith("stalled: ")]
    stall = stalls[-1].removeprefix("stalled: ") if stalls else None
    same = tuple({"job_id": o["job_id"], "state": o["state"], "error_class": o.get("error_class")} for o in same_source)
    others = _same_source_text(same)
    earlier = f" Earlier: {_told(incidents)}." if incidents else ""

    def made(summary: str, action: str, permanent: bool | None = None, why: str | None = None,
             stalled: str | None = stall) -> Diagnosis:
        return Diagnosis(summary + others, action, stalled, permanent, why, same)

    if state == "completed":
        if job.get("reused_from"):
            return made(f"Completed by reusing the outputs of job {job['reused_from']} (same file and profile); "
                        "no transcode ran.", "Nothing to do.")
        if incidents:
            return made(f"Completed; it recovered by itself after {_told(incidents)}.",
                        "Nothing to do. If this repeats on one worker host or one file, look there.")
        return made("Completed without a failed or stalled attempt.", "Nothing to do.")
    if state == "accepted":
        return made("Accepted by intake; no stage is queued yet.", "Nothing to do.")
    if state == "running":
        return made(f"Running: {stage} attempt {attempt} on {job.get('worker') or 'a worker'}.{earlier}",
                    "Nothing to do while it progresses; the watchdog acts if it stops.")
    if state == "queued":
        age_s = None if job.get("queued_at") is None else max(0.0, (now - job["queued_at"]).total_seconds())
        waited = "" if age_s is None else f" for {age_s:.0f} s"  # since queued, or since the last re-send
        redrives = sum(1 for e in events if e["event_type"] == "StallDetected" and (e.get("payload") or {}).get("kind")
                       == "handoff" and (e["stage"], e["attempt"]) == (stage, attempt))
        if redrives:  # the watchdog re-sent this very attempt's work item: no worker is taking it
            last = "" if age_s is None else f", the last {age_s:.0f} s ago"
            return made(f"Queued: {stage} attempt {attempt}: {STALL_WORDS['handoff']}; the watchdog sent it again "
                        f"{redrives} time(s){last}.{earlier}",
                        f"Check that {stage} workers run and are not all busy (tapeline status, /health/deep).",
                        stalled=STALL_WORDS["handoff"])
        return made(f"Queued: {stage} attempt {attempt} has waited{waited} for a free worker.{earlier}",
                    f"Nothing to do unless it waits long; then check that {stage} workers run (tapeline status).")
    if state == "retry_scheduled":
        last = _told(incidents[-1:]) or f"{stage} attempt {attempt} ended"
        due = job.get("retry_due_at")
        when = f" at {due:%H:%M:%S} UTC" if due is not None else ""
        return made(f"{last[0].upper()}{last[1:]}; attempt {job.get('retry_next_attempt')} is scheduled{when}.",
                    "Nothing to do: it retries by itself.", False, _why(error_class_row(error_class)))
    if state == "failed":
        ended = next((e for e in reversed(events) if e["event_type"] == "JobFailed"), None)
        payload = (ended or {}).get("payload") or {}
        if payload.get("operator"):  # `tapeline dlq fail`: an operator's decision, whatever the error class
            return made(f"Dead-lettered at {stage} ({error_class}), then {reason}.",
                        "Nothing to do: nothing reopens a failed job; the submitter may send the file again.", True,
                        "an operator ended it for good")
        spec = error_class_row(error_class)
        return made(f"Failed for good at {stage}: {error_class}: {reason}.", _todo(spec, job), True, _why(spec))
    if state == "rejected":
        if error_class == "quota_exceeded":
            spec = error_class_row(error_class)
            return made(f"Rejected at intake: {reason}.", _todo(spec, job), True, _why(spec))
        return made(f"Rejected at intake: {error_class}: {reason}.",
                    "Nothing to do: the submitter must send a valid file.", True, "the upload itself was refused")
    if state == "cancelled":
        cancel = next((e for e in reversed(events) if e["event_type"] == "JobCancelled"), None)
        who = (cancel.get("payload") or {}).get("operator") if cancel else None
        return made(f"Cancelled by {who or 'an operator'}: {(cancel.get('payload') or {}).get('reason') if cancel else reason}.",
                    "Nothing to do: a cancelled job never runs again; submit the file again if it should run.")
    if state == "needs_review":
        return made(f"Waiting for a person: {reason}.",
                    f"Look the post up at the provider, then `tapeline review resolve {job['job_id']} --posted REF` "
                    "or `--not-posted`.")
    if state == "dead_lettered":
        return _dead_lettered(job, events, same, made)
    return made(f"{state}: {reason or ''}".rstrip(": ") + ".", "Nothing to do.")


def _why(spec: ErrorClass) -> str:
    """The error table's words for what a retry of `spec` would do: `output_conflict: a retry would ...`."""
    return f"{spec.name}: {spec.on_retry}"


def _todo(spec: ErrorClass, job: Mapping[str, Any], still: str = "") -> str:
    """The error table's "what to do" for `spec`, with the job's id, its dead letter's id and `still`
    (a note on a cause that failed again after a replay) filled in."""
    return spec.what_to_do.format(job=job["job_id"], letter=f"{job['job_id']}/{job['attempt']}", still=still)


def object_words(found: Mapping[str, Any] | None) -> str:
    """The object in the way (`JobDeadLettered.in_the_way`: key, sha256, size_bytes, written_at) in
    words: "`KEY` (N bytes, sha256 HEX, written 2026-12-07 11:52:01 UTC)"; "" when not recorded."""
    if not found:
        return ""
    written = found.get("written_at")
    if isinstance(written, datetime):
        written = f"{written:%Y-%m-%d %H:%M:%S} UTC"
    elif isinstance(written, str):
        written = written.replace("T", " ")[:19] + " UTC"
    when = f", written {written}" if written else ", when written not known"
    return f"`{found['key']}` ({found['size_bytes']} bytes, sha256 {found['sha256']}{when})"


def _dead_lettered(job, events, same, made) -> Diagnosis:
    """A dead-lettered job: permanent when its class is (the error table: `output_conflict` meets the
    same object until it is removed, and the diagnosis names that object), when its last two dead
    letters (before and after a replay) share an error class, or when the same file was
    dead-lettered or failed with that class in another job; otherwise fix the cause, then replay.
    The history rules hold only for a class the file can cause (`ErrorClass.from_the_file`): the
    object store or Kafka failing again says nothing about the file."""
    stage, attempt, error_class, reason = job["stage"], job["attempt"], job.get("error_class"), job.get("reason")
    letters = [e.get("payload") or {} for e in events if e["event_type"] == "JobDeadLettered"]
    summary = f"Dead-lettered after {attempt} attempt(s) of {stage}: {error_class} ({reason})."
    failed_same = [o for o in same if o["state"] in ("failed", "dead_lettered") and o.get("error_class") == error_class]
    spec = error_class_row(error_class)
    repeated = len(letters) >= 2 and letters[-1].get("error_class") == letters[-2].get("error_class")
    again = " It had been replayed and failed the same way again." if repeated else ""
    if spec.permanent:  # the class alone says a retry fails the same way (output_conflict: the object in the way)
        found = letters[-1].get("in_the_way") if letters else None
        named = object_words(found)
        in_the_way = f" In the way: {named}." if named else ""
        remove = (f" To remove it: `aws s3 rm s3://BUCKET/{found['key']}` (or your object store's console)."
                  if found else "")
        return made(summary + in_the_way + again, _todo(spec, job) + remove, True, _why(spec))
    if not spec.from_the_file:
        still = f" ({spec.cause} still failed after the replay)" if repeated else ""
        return made(summary + again, _todo(spec, job, still), False,
                    _why(spec) + ("; it is not the file's doing" if repeated else ""))
    if repeated:
        return made(summary + again,
                    "Do not replay again until the cause is found: look at the source on this page and ask the "
                    "submitter for a new file if the file is the cause.", True,
                    "the same error came back after a replay")
    if failed_same:
        other = failed_same[0]
        return made(summary, "Do not replay: the same file failed the same way in another job; ask the submitter "
                             "for a new file.", True,
                    f"job {other['job_id']} of the same file ended {other['state']} with {error_class}")
    return made(summary, _todo(spec, job), spec.permanent, _why(spec))

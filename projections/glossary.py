"""One-line explanations of every term the dashboard shows: its column headings, job states, stages,
stall kinds, attempt outcomes, timeline flags, event types, error classes and the platform's own
words (log clock, fenced, superseded, ladder, yield, budget, claim marker, ...).

The dashboard puts them on hover (`title`, from the page's embedded glossary: `dashboard.js`
`explainTerms`), and `docs/operating.md` carries the same table between its glossary markers
(`python -m projections.doc_tables --write` writes it; `tests/unit/test_glossary.py` checks that the
doc, the templates and this module agree). Generated, not restated: job states take their meaning
from `schemas/lifecycle.json` (the lifecycle's own text), stages from the stage registry
(`domain/pipeline.py` `StageSpec.about`), error classes from the error table
(`domain/error_classes.py`).
"""

from __future__ import annotations

from domain import pipeline
from domain.diagnosis import STALL_WORDS
from domain.error_classes import ERROR_CLASSES, glossary_line
from domain.lifecycle_data import LIFECYCLE

_STALL_DETAIL: dict[str, str] = {
    "lease_expired": "no claim or heartbeat arrived within its lease (a dead or frozen process, or a partitioned "
                     "host)",
    "no_progress": "heartbeats arrived but frames and media time stood still past the no-progress timeout",
    "worker_exited": "a crash, kill -9 or OOM; its supervisor or its restarted successor rescued the attempt at "
                     "once, without waiting for the lease",
    "handoff": "a stage was queued and nobody claimed it within the handoff timeout (the watchdog re-sends its "
               "work item)",
    "expected_work_missing": "no job came of it within the intake timeout",
    "region_lost": "the attempt ran in a region that failed over (tapeline region failover); retried at once in "
                   "the region that took over, from its replicated checkpoints, and its attempt given back",
}
STALL_KINDS: dict[str, str] = {
    **{kind: f"{STALL_WORDS[kind]}: {detail}" for kind, detail in _STALL_DETAIL.items()},
    "waiting": "a retry waiting for its backoff, or a retry, hand-over or replay queued for a free worker; listed "
               "until a worker claims it",
    "suspect": "a running attempt not judged yet whose progress (or heartbeats) stood still for more than part of "
               "its allowance; the watchdog judges it when the allowance ends unless it moves",
    "recent_stall": "an attempt stall judged within TAPELINE_RECENT_STALLS_S, with what was done about it (retried, "
                    "dead-lettered) and the job's state now",
}
"""What each kind in `tapeline stalled`, /api/stalled and the Stalled page means (`needs_review` is a state)."""

OUTCOMES: dict[str, str] = {
    "running": "the attempt holds its lease and is working",
    "succeeded": "the attempt finished its stage",
    "failed": "the attempt ended with an error (its error class says which)",
    "stalled": "the watchdog or a rescuer declared the attempt stalled; a retry follows if the budget allows",
    "yielded": "the worker handed the attempt over on a graceful shutdown (SIGTERM); this does not use up an "
               "attempt",
    "superseded": "a newer claim replaced this one; its late writes are kept as evidence and change nothing",
    "cancelled": "an operator cancelled the job while this attempt ran",
    "needs_review": "the attempt stopped at a publish that could not be proven safe; a person decides",
}
"""Attempt outcomes of the job page's attempts table (view `attempts`)."""

FLAGS: dict[str, str] = {
    "superseded": "written under a claim that is no longer current (a fenced zombie, a late worker): kept as "
                  "evidence, never applied",
    "duplicate": "a second copy of an event already applied (same dedup key): kept as evidence, applied once",
    "evidence": "recorded but changes no state (for example an event after the job ended)",
}
"""Timeline flags of an event that was not applied as a state change."""

EVENTS: dict[str, str] = {
    "UploadCompleted": "a source finished uploading to object storage (size and sha256 verified)",
    "JobAccepted": "intake probed the source and accepted the job, with its profile and ladder",
    "JobRejected": "intake refused the upload (invalid or unsupported media, limits, the submitter's quota)",
    "ResultReused": "the outputs of an earlier job with the same source and profile were reused; no transcode",
    "StageQueued": "a stage attempt was queued for a worker",
    "StageSkipped": "an optional stage was not run for the job (e.g. the degradation ladder), with the reason",
    "WorkItem": "the unit of work a worker claims from a work topic",
    "AttemptStarted": "a worker claimed the attempt: a new claim token and lease",
    "Heartbeat": "the worker renewed its lease and reported progress (frames, media seconds, speed)",
    "CheckpointRecorded": "a finished segment was stored and verified; a retry resumes after it",
    "AttemptSucceeded": "the attempt finished its stage and named its exact outputs",
    "AttemptFailed": "the attempt ended with an error of a class that says whether it is retried",
    "AttemptYielded": "the worker handed the attempt over on a graceful shutdown; the next attempt starts at once",
    "StallDetected": "the attempt or handoff stopped moving (its kind says how)",
    "RetryScheduled": "the next attempt will start after the backoff",
    "PublishIntended": "publish recorded its intent before calling the provider",
    "PublishDeferred": "the provider was not called (quota, circuit breaker, slots); retried later at no "
                       "attempt's cost",
    "Published": "the provider confirmed the post (its reference is kept)",
    "ProviderBreakerChanged": "a provider's circuit breaker opened, half-opened or closed",
    "JobCompleted": "the job is published and done",
    "JobFailed": "a permanent error: retrying would fail the same way",
    "JobDeadLettered": "out of attempts (or not safe to retry): an operator may replay it",
    "NeedsReview": "a publish could not be proven safe; a person checks the provider and resolves it",
    "JobCancelled": "an operator cancelled the job",
    "OutputsWithdrawn": "the job's published outputs were deleted: it was cancelled or failed while (or after) "
                        "a publish made them public",
    "JobReplayed": "an operator reopened a dead-lettered or reviewed job with a fresh attempt budget",
    "DeadLetter": "a record that could not be processed, kept raw with its source position and reason",
    "DeadLetterDismissed": "an operator closed an undecodable record's dead letter (nothing to replay or fail); the record stays",
    "NotificationIntended": "the notifier will send one signed webhook of this event to one customer endpoint",
    "NotificationDelivered": "the customer's endpoint answered 2xx; this notification is never sent again",
    "NotificationFailed": "one webhook POST failed (status, timeout or refused address); retried on a schedule",
    "NotificationDeadLettered": "a webhook's retries (about a day) are spent; it is not sent again",
    "WebhookEndpointDisabled": "a customer endpoint failed for too long without a success and was disabled",
    "WatchdogTick": "the watchdog's tick: it moves the log clock of every partition",
    "RegionFailedOver": "a region took over the job history (tapeline region failover); the region it left is fenced",
    "JobDelayed": "a failover moved this job in flight to another region; its submitter is told once (job.delayed)",
}
"""Event types, as the timeline names them."""

ERROR_CLASS_HELP: dict[str, str] = {c.name: glossary_line(c) for c in ERROR_CLASSES.values()}
"""Error classes, from the error table (`domain/error_classes.py`: what it is, how it is retried, what
a retry would do)."""

STAGES: dict[str, str] = {pipeline.INTAKE: f"stage: {pipeline.INTAKE_ABOUT}",
                          **{s.name: f"stage: {s.about}" for s in pipeline.STAGES}}
"""Every stage, from the stage registry (`domain/pipeline.py`: `INTAKE_ABOUT`, `StageSpec.about`)."""

TERMS: dict[str, str] = {
    # column headings and labels
    "job": "the job id (uuid5 of the upload id, so a re-sent upload is the same job); as a dead-letter kind: "
           "a job out of attempts",
    "record": "dead-letter kind: a record a processor could not decode, kept raw with its source position",
    "projection": "dead-letter kind: a record the projector could not decode or apply",
    "state": "where the job is in its lifecycle (hover a state for its meaning)",
    "stage": f"the pipeline step: {pipeline.INTAKE}, then the stages of the job's profile "
             f"({', '.join(pipeline.STAGE_NAMES)}; hover a stage for what it does)",
    "attempt": "the try of the stage, counted from 1; retries and hand-overs start a new attempt",
    "stage / attempt": "the current stage and its own attempt number (each stage counts its attempts from 1)",
    "attempts": "how many attempts of the stage the job had started when it was dead-lettered (a replayed job "
                "keeps counting); in brackets, those counted against the budget it ran out of",
    "done": "share of the job done: stages before the current one plus the current stage's progress (segments "
            "an earlier attempt finished count as done); only a completed job shows 100 %",
    "%": "share of the job done (see done)",
    "priority": "the tier: archive before standard before index (with aging so none starves)",
    "source": "the uploaded media the job transcodes",
    "reason": "why the job or attempt is where it is, in the writer's words",
    "error class": "what kind of error ended the attempt; decides whether and when it is retried",
    "master playlist": "the published HLS master playlist (every rendition) a player opens",
    "updated (UTC)": "broker time of the job's latest event",
    "worker": "the process that holds (or held) the claim: role@host:pid",
    "outcome": "how the attempt ended (hover an outcome for its meaning)",
    "started (UTC)": "broker time the attempt was claimed",
    "ran (s)": "seconds from the claim to the attempt's end, on broker time",
    "wasted (s)": "seconds of work thrown away: the run of an attempt that did not finish its stage, less the "
                  "part up to its last checkpoint a later attempt reused (0 for one that succeeded)",
    "heartbeats": "lease renewals the attempt wrote, each with progress",
    "rendition": "one output quality of the ladder (for example 720p), or the audio track",
    "segment": "index of a checkpointed media segment (about 4 s each)",
    "object": "the object-store key the checkpoint wrote",
    "media start (s)": "where the segment starts in the source, seconds",
    "media duration (s)": "how many seconds of the source the segment holds",
    "frames": "video frames encoded so far by the running attempt (its last heartbeat); in a checkpoint, the "
              "segment's frames",
    "pipeline": "the job's profile: which stages it runs, in order (default: transcode, thumbnails, publish)",
    "attempts started": "the most attempts any one stage of the job started (each stage counts from 1)",
    "lease until (UTC)": "when the running attempt's claim runs out unless a heartbeat renews it",
    "checkpointed": "seconds of media in applied checkpoints: a retry reuses them instead of encoding again",
    "degraded ladder": "the job was given fewer renditions than asked, and why (the degradation ladder)",
    "reused from": "the job whose published outputs this one reused (same source and profile; no transcode)",
    "output": "a published file of the job: a rendition, another stage's file (poster, storyboard, WebVTT) or "
              "an archived object",
    "what": "a rendition's size, the stage that made the file, or archived",
    "where": "the file's public URL; without one recorded, the key publish copies it to",
    "broker time (UTC)": "the time Kafka stamped on the event when it was appended (LogAppendTime); one "
                         "clock for every machine",
    "event": "the lifecycle fact the event records (hover an event type for its meaning)",
    "flags": "why an event changed no state: superseded, duplicate or evidence",
    "detail": "the event's main fields",
    "kind": "what stopped moving, or what kind of dead letter (hover a kind for its meaning)",
    "last progress (UTC)": "broker time the attempt's counters last moved (a handoff: when it was queued; "
                           "waiting: when the wait began)",
    "for (s)": "seconds since then, on the log clock (wall clock for reviews)",
    "id": "the dead letter's id (tapeline dlq show ID)",
    "when (UTC)": "broker time the dead letter was written",
    "error": "the error that dead-lettered the job or record",
    "replayed / dismissed": "whether an operator replayed (a job) or dismissed (an undecodable record) it, by "
                            "whom and why",
    "jobs": "how many jobs",
    "stalled": "stopped moving: an attempt whose lease ran out, whose progress froze or whose worker exited "
               "(a retry follows if the budget allows); on the overview, how many attempts, handoffs and uploads "
               "stopped moving and jobs wait for review",
    "dead letters pending": "dead letters no operator has replayed, failed or dismissed yet",
    "projection lag": "events in the log the PostgreSQL projections have not applied yet, and how old the "
                      "oldest is",
    "filename": "the name the submitter gave the upload",
    "size": "the source's size in bytes, as stored and verified",
    "sha256": "the checksum of the source bytes; jobs with the same sha256 are the same file",
    "uploaded (UTC)": "broker time the upload was recorded",
    "container": "the source's container format as ffprobe named it, and its overall bit rate",
    "video": "the source's video stream: codec, coded size, frame rate, frames and its own duration",
    "audio": "the source's audio stream: codec and its own duration (it may differ from the video's)",
    "handling": "what the transcode does about what is unusual in the source",
    "created (UTC)": "broker time the job was accepted",
    "endpoint": "a customer webhook endpoint's id (ep_...), as tapeline webhooks list shows it",
    "submitter": "whose jobs the endpoint hears of: the identity of tapeline submit --submitter or an intake token",
    "url": "where the notifications are POSTed, signed (Standard Webhooks)",
    "events": "the notification types the endpoint wants (job.completed, job.failed, ...)",
    "failing since": "when its deliveries began to fail without a success since; past notify_disable_after_s "
                     "the notifier disables it",
    "last success": "when a delivery to it last got a 2xx answer",
    "delivered": "notifications it answered with a 2xx (each sent once, whatever crashes)",
    "pending": "notifications not delivered yet: waiting for their first try or a retry",
    "dead": "notifications dead-lettered: out of tries (about a day), or the endpoint was removed",
    # the platform's own words
    "log clock": "the broker time of the newest event in a partition of the lifecycle log; leases and stalls "
                 "are judged on it, never on a machine's clock",
    "lease": "how long a claim stays valid without a heartbeat; an attempt whose lease ran out is stalled",
    "claim token": "the fencing token of one claim; events under an older token change nothing",
    "fenced": "shut out for good: a newer claim's producer made the broker refuse the older one's writes",
    "ladder": "the set of renditions a job produces (1080p down to 240p, only rungs the source can fill)",
    "yield": "a graceful hand-over on shutdown: the attempt stops at a segment boundary and the next starts "
             "at once, without using up an attempt",
    "checkpoint": "a finished, verified segment; a retry resumes after the last one",
    "dead letter": "a job out of attempts, or a record that could not be processed, kept for an operator",
    "replay": "reopen a dead-lettered or reviewed job with a fresh attempt budget",
    "heartbeat": "a worker's lease renewal with progress counters",
    "budget": "the attempts a stage may start before the job is dead-lettered (max_attempts, 3 by default); a "
              "replay gives a fresh one; yields, deferred publishes and region_lost use none of it",
    "claim marker": "the object publish creates (markers/{job}/webhook.json, only if absent) before it calls a "
                    "provider, naming its attempt; another attempt finding it cannot rule out a post: needs_review",
    "origin": "the built-in publish provider: the object store itself (outputs promoted to published/{job}/, "
              "their public URLs); a webhook provider is announced to besides when one is configured",
    "degraded": "accepted with a cheaper profile (top rendition dropped, a faster preset, thumbnails skipped) "
                "because its tier's backlog was past the threshold at intake; degraded_reason says by how much",
    "profile_fingerprint": "sha256 of the output profile (ladder, codec settings, segment length); a completed "
                           "job with the same source sha256 and fingerprint is reused instead of transcoding",
    "gross_wasted_s": "seconds an attempt that did not finish its stage ran, before subtracting what a later "
                      "attempt reused (wasted (s) subtracts it)",
    "LSO": "last stable offset: the end of a partition a read_committed reader can reach (open transactions hold "
           "it back); projection lag and 'caught up' are measured to it",
    "percent": "share of the job done (see done)",
}
"""Column headings, labels and the platform's own words."""


def glossary() -> dict[str, str]:
    """Every term the dashboard explains -> its one-line explanation (states from the lifecycle file).

    Later groups never override earlier ones: a heading that is also a state keeps its heading text.
    """
    merged: dict[str, str] = {}
    for group in (TERMS, dict(LIFECYCLE.state_help), STAGES, STALL_KINDS, OUTCOMES, FLAGS, EVENTS, ERROR_CLASS_HELP):
        for term, text in group.items():
            merged.setdefault(term, text)
    return merged


def explain(term: str) -> str:
    """The one-line explanation of `term`, or "" when it has none."""
    return glossary().get(term, "")


def markdown() -> str:
    """The glossary as the Markdown table `docs/operating.md` carries: `| term | meaning |`, by term."""
    rows = [f"| `{term}` | {text} |" for term, text in sorted(glossary().items(), key=lambda kv: kv[0].lower())]
    return "\n".join(["| term | meaning |", "|---|---|", *rows])


if __name__ == "__main__":  # the docs' copy: python -m projections.doc_tables --write
    print(markdown())

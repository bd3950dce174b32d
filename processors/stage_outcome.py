"""What a stage attempt's end writes, decided without I/O: the events of a graceful hand-over
(`yield_events`), of a failure and its retry decision (`failure_events`, the rule is
`domain/policy/retry.py`), of the next attempt queued (`next_attempt_events`), and how an outcome is
counted (`attempt_outcome`). Pure: the attempt's identity (its `clock` stamps every event), its work
item and the settings come in, `(topic, event)` pairs go out; `processors/worker.py` commits them.
"""

from __future__ import annotations

import dataclasses

from domain import events as ev
from domain import pipeline
from domain.error_classes import error_class as error_class_row
from domain.policy.retry import Action, retry_decision, retry_scheduled
from processors.runtime import AttemptIdentity, Outgoing
from tapeline.settings import Settings


def attempt_outcome(outgoing: list[Outgoing]) -> tuple[str, str]:
    """(outcome, error class) of a committed completion: failed with the `AttemptFailed`'s class,
    yielded, or succeeded (class empty). Pure."""
    for _, event in outgoing:
        if isinstance(event, ev.AttemptFailed):
            return "failed", event.error_class
        if isinstance(event, ev.AttemptYielded):
            return "yielded", ""
    return "succeeded", ""


def next_attempt_events(settings: Settings, identity: AttemptIdentity, item: ev.WorkItem,
                        next_attempt: int) -> list[Outgoing]:
    """`StageQueued` + the `WorkItem` of the same stage's next attempt (same inputs), stamped by the
    identity's clock. Pure."""
    clock, stage = identity.clock, identity.stage
    common = dict(job_id=item.job_id, recorded_by=identity.recorded_by, correlation_id=item.correlation_id,
                  causation_id=item.event_id, claim_token=identity.claim_token)
    work_topic = settings.work_topic(stage, item.tier)
    return [
        (settings.jobs_topic, ev.StageQueued.new(clock.stamp(), stage=stage, attempt=next_attempt, tier=item.tier,
                                                 work_topic=work_topic, **common)),
        (work_topic, ev.WorkItem.new(clock.stamp(),
            stage=stage, attempt=next_attempt, tier=item.tier, source_key=item.source_key,
            inputs=item.inputs, renditions=item.renditions, audio_playlist_key=item.audio_playlist_key,
            media_duration_s=item.media_duration_s, checkpoint_refs=item.checkpoint_refs,
            x264_preset=item.x264_preset, degraded=item.degraded, pipeline_stages=item.pipeline_stages, **common)),
    ]


def handoff_events(settings: Settings, identity: AttemptIdentity, item: ev.WorkItem, *,
                   inputs: list[ev.OutputFile], renditions: list[ev.Rendition] | None = None,
                   audio_playlist_key: str | None = None, media_duration_s: float | None = None) -> list[Outgoing]:
    """What follows a successful attempt of `identity.stage` in the job's pipeline (its recorded
    stages, `item.pipeline_stages`; `pipeline.LEGACY_STAGES` for an older item): a `StageSkipped`
    (with its reason) for each optional stage a degraded job skips, then `StageQueued` + the
    `WorkItem` (attempt 1) of the next stage, carrying `inputs` (what publish promotes), the
    renditions, the audio playlist and the media duration. Nothing after the last stage. Pure.
    The caller puts its `AttemptSucceeded` first; the whole list commits in one transaction."""
    clock, stages = identity.clock, pipeline.job_stages(item.pipeline_stages)
    nxt, skipped = pipeline.following_stage(stages, identity.stage, item.degraded)
    common = dict(job_id=item.job_id, claim_token=identity.claim_token, recorded_by=identity.recorded_by,
                  correlation_id=item.correlation_id, causation_id=item.event_id)
    out: list[Outgoing] = [
        (settings.jobs_topic, ev.StageSkipped.new(clock.stamp(), stage=stage, attempt=0, reason=(
            "optional stage skipped: the job runs degraded (the degradation ladder: its tier's backlog was "
            "above the threshold at intake; JobAccepted.degraded_reason says by how much)"), **common))
        for stage in skipped]
    if nxt is None:
        return out
    work_topic = settings.work_topic(nxt, item.tier)
    renditions = list(item.renditions if renditions is None else renditions)
    return out + [
        (settings.jobs_topic, ev.StageQueued.new(clock.stamp(), stage=nxt, attempt=1, tier=item.tier,
                                                 work_topic=work_topic, **common)),
        (work_topic, ev.WorkItem.new(clock.stamp(), stage=nxt, attempt=1, tier=item.tier, source_key=item.source_key,
                                     inputs=list(inputs), renditions=renditions,
                                     audio_playlist_key=audio_playlist_key, media_duration_s=media_duration_s,
                                     x264_preset=item.x264_preset, degraded=item.degraded,
                                     pipeline_stages=item.pipeline_stages, **common)),
    ]


def yield_events(settings: Settings, identity: AttemptIdentity, item: ev.WorkItem, reason: str) -> list[Outgoing]:
    """A graceful hand-over: `AttemptYielded`, then the next attempt queued at once. Pure."""
    return [(settings.jobs_topic, identity.event(ev.AttemptYielded, reason=reason))] + \
        next_attempt_events(settings, identity, item, item.attempt + 1)


def failure_events(settings: Settings, identity: AttemptIdentity, item: ev.WorkItem, uncounted: int,
                   error_class: str, reason: str, cooldown_s: float | None = None,
                   in_the_way: dict | None = None) -> list[Outgoing]:
    """`AttemptFailed` and what follows from the retry decision (retry, fail, dead-letter). Pure.

    `AttemptFailed.retryable` is the error class's (`domain/error_classes.py`), whatever this
    attempt's budget: an `output_conflict` is never retried, a `storage_transient` out of attempts
    still was. `in_the_way`: the object an `output_conflict` met (`{"key", "sha256", "size_bytes",
    "written_at"}`), recorded in `AttemptFailed` and `JobDeadLettered`.

    `uncounted`: the item's attempt numbers that do not count against the budget (yields,
    deferrals, attempts before an operator's replay). `cooldown_s`: a provider's own `Retry-After`
    (seconds); a provider_throttled retry waits exactly that long instead of the policy's backoff
    (docs/design.md: "a throttling provider after its cooldown").
    """
    jobs, stage, clock = settings.jobs_topic, identity.stage, identity.clock
    used = item.attempt - uncounted
    decision = retry_decision(error_class, used, settings.retry_policy())
    if cooldown_s is not None and decision.action is Action.RETRY:
        decision = dataclasses.replace(decision, delay_s=cooldown_s)  # the provider said when
    if decision.action is Action.RETRY:  # attempt numbers keep rising past uncounted ones (yields, deferrals)
        decision = dataclasses.replace(decision, next_attempt=item.attempt + 1)
    found = ev.ObjectFound(**in_the_way) if in_the_way else None
    out: list[Outgoing] = [(jobs, identity.event(ev.AttemptFailed, error_class=error_class,
                                                 retryable=error_class_row(error_class).retryable, reason=reason,
                                                 in_the_way=found))]
    common = dict(job_id=item.job_id, recorded_by=identity.recorded_by, correlation_id=item.correlation_id,
                  causation_id=item.event_id, claim_token=identity.claim_token)
    if decision.action is Action.FAIL:
        out.append((jobs, ev.JobFailed.new(clock.stamp(), stage=stage, attempt=item.attempt, error_class=error_class,
                                           reason=reason, **common)))
    elif decision.action is Action.DEAD_LETTER:
        dead = ev.JobDeadLettered.new(clock.stamp(), stage=stage, attempt=item.attempt, error_class=error_class,
                                      reason=reason, attempts=used, evidence=f"{jobs} job {item.job_id}",
                                      in_the_way=found, **common)
        out += [(jobs, dead), (settings.dlq_topic, dead)]  # the lifecycle fact + its dead-letter record
    else:
        out.append((jobs, retry_scheduled(decision.delay_s, clock.stamp(), stage=stage, attempt=item.attempt,
                                          next_attempt=decision.next_attempt, error_class=error_class, **common)))
        if decision.delay_s <= 0:  # at once; otherwise the watchdog dispatches it when due
            out += next_attempt_events(settings, identity, item, decision.next_attempt)
    return out

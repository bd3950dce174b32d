"""The pure end of a stage attempt (`processors/stage_outcome.py`): what a failure, a hand-over and
a retry write, stamped by the attempt's clock."""

from __future__ import annotations

from domain import events as ev
from processors.runtime import AttemptIdentity
from processors.stage_outcome import attempt_outcome, failure_events, yield_events
from tapeline.settings import Settings
from tests.fakeclock import FixedClock


def _attempt(attempt: int, clock: FixedClock) -> tuple[AttemptIdentity, ev.WorkItem]:
    item = ev.WorkItem.new(clock.stamp(), job_id="job-1", stage="transcode", attempt=attempt, recorded_by="test",
                           correlation_id="upload-1", tier="standard", source_key="uploads/u/s.mp4", inputs=[],
                           renditions=[])
    identity = AttemptIdentity(job_id="job-1", stage="transcode", attempt=attempt, claim_token="token",
                               recorded_by="w@1", correlation_id="upload-1", causation_id=item.event_id, clock=clock)
    return identity, item


def test_a_stall_class_retries_at_once_with_the_next_attempt_queued_and_every_event_stamped_by_the_clock():
    settings, clock = Settings(), FixedClock(prefix="c")
    identity, item = _attempt(1, clock)
    out = failure_events(settings, identity, item, 0, "worker_lost", "died")
    assert [(t, e.event_type) for t, e in out] == [
        (settings.jobs_topic, "AttemptFailed"), (settings.jobs_topic, "RetryScheduled"),
        (settings.jobs_topic, "StageQueued"), (settings.work_topic("transcode", "standard"), "WorkItem")]
    assert all(e.occurred_at == clock.at for _, e in out)
    assert out[1][1].next_attempt == 2 and out[1][1].not_before == clock.at  # no backoff for a stall
    assert out[3][1].attempt == 2 and out[3][1].source_key == item.source_key
    assert attempt_outcome(out) == ("failed", "worker_lost")


def test_out_of_attempts_dead_letters_to_both_topics_counting_only_counted_attempts():
    settings, clock = Settings(), FixedClock()
    identity, item = _attempt(5, clock)
    out = failure_events(settings, identity, item, 2, "unknown", "boom")  # 5 - 2 uncounted = 3 used: the budget
    assert [(t, e.event_type) for t, e in out] == [(settings.jobs_topic, "AttemptFailed"),
                                                   (settings.jobs_topic, "JobDeadLettered"),
                                                   (settings.dlq_topic, "JobDeadLettered")]
    assert out[1][1].attempts == 3
    retried = failure_events(settings, identity, item, 3, "unknown", "boom")  # 2 used: a retry, numbered on
    assert retried[1][1].event_type == "RetryScheduled" and retried[1][1].next_attempt == 6


def test_a_provider_cooldown_replaces_the_backoff_and_a_yield_queues_the_next_attempt_uncounted():
    settings, clock = Settings(), FixedClock()
    identity, item = _attempt(1, clock)
    out = failure_events(settings, identity, item, 0, "provider_throttled", "429", cooldown_s=7.0)
    assert (out[1][1].not_before - clock.at).total_seconds() == 7.0 and len(out) == 2  # the watchdog dispatches it
    handed = yield_events(settings, identity, item, "SIGTERM")
    assert [e.event_type for _, e in handed] == ["AttemptYielded", "StageQueued", "WorkItem"]
    assert handed[2][1].attempt == 2 and attempt_outcome(handed) == ("yielded", "")

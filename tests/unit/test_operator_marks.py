"""The marks the notifier's choice of `job.replayed` relies on (projections/sql/queries.sql
`notify_new_deliveries`: a JobReplayed is notified only once an event it caused is projected, and
never when that is a JobFailed). Pure event builders of processors/operator_events.py: what an
operator action writes in its one transaction, and which event names which as its cause."""

from __future__ import annotations

from domain import events as ev
from processors.operator_events import fail_events, replay_events, resolve_review_events
from tapeline.settings import Settings
from tests.fakeclock import FixedClock

SETTINGS = Settings(topic_prefix="unit")
CLOCK = FixedClock()


def row(state: str) -> dict:
    return {"job_id": "j1", "upload_id": "u1", "state": state, "stage": "transcode", "attempt": 1,
            "error_class": "storage_transient", "priority": "standard", "source_key": "uploads/u1/f.mp4"}


def on_jobs_topic(out):
    return [e for topic, e in out if topic == SETTINGS.jobs_topic]


def test_dlq_fail_writes_a_job_replayed_whose_only_caused_event_is_its_job_failed():
    replayed, failed = on_jobs_topic(fail_events(row("dead_lettered"), "j1/1", "ops", "corrupt", True, SETTINGS,
                                                 "operator@test", clock=CLOCK))
    assert isinstance(replayed, ev.JobReplayed) and isinstance(failed, ev.JobFailed)
    assert failed.causation_id == replayed.event_id and replayed.causation_id is None
    assert (failed.operator, failed.dead_letter_id, failed.refunded) == ("ops", "j1/1", True)


def test_a_real_replay_causes_the_next_stage_queued_and_no_job_failed():
    replayed, *caused = on_jobs_topic(replay_events(row("dead_lettered"), "j1/1", "ops", "fixed", SETTINGS,
                                                    "operator@test", clock=CLOCK))
    assert isinstance(replayed, ev.JobReplayed)
    assert [type(e).__name__ for e in caused] == ["StageQueued"]
    assert all(e.causation_id == replayed.event_id for e in caused)


def test_a_review_resolved_as_posted_causes_published_and_job_completed():
    review = {**row("needs_review"), "stage": "publish", "master_url": "http://o/m.m3u8", "renditions": []}
    replayed, *caused = on_jobs_topic(resolve_review_events(review, "ops", "found it", "ref-1", "origin", SETTINGS,
                                                            "operator@test", clock=CLOCK))
    assert [type(e).__name__ for e in caused] == ["Published", "JobCompleted"]
    assert all(e.causation_id == replayed.event_id for e in caused)

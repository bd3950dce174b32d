"""Pure decisions of the processors: intake, claim reconciliation, retry."""

from __future__ import annotations

from processors.intake import decide
import random

from domain.policy.retry import Action, RetryPolicy, retry_decision
from domain.policy.claim_rules import projection_behind, should_skip, superseded_reason
from domain import events as ev
from domain.errors import InvalidInput, UnsupportedMedia
from tapeline.settings import Settings
from tapeline.clock import system_clock
from tests.fakeclock import FixedClock

SETTINGS = Settings(topic_prefix="unit")
CLOCK = FixedClock()  # the writer's clock of the decided events
MEDIA = ev.SourceMedia(format_name="mov", duration_s=5.28, width=1280, height=720, display_width=1280,
                       display_height=720, rotation=0, fps=25.0, frames=132, video_codec="h264", audio_codec="aac")


def upload(priority="standard"):
    return ev.UploadCompleted.new(system_clock.stamp(), job_id=ev.job_id_for("u1"), stage="intake", attempt=0, recorded_by="t",
                                  correlation_id="u1", upload_id="u1", bucket="b", object_key="uploads/u1/a.mp4",
                                  size_bytes=10, sha256="00" * 32, filename="a.mp4", priority=priority)


def test_intake_accepts_a_video_and_queues_transcode_on_its_tier():
    source = upload("index")
    out = decide(None, source, MEDIA, SETTINGS, "intake@t", clock=CLOCK)
    assert [(topic, e.event_type) for topic, e in out] == [
        ("unit.jobs", "JobAccepted"), ("unit.jobs", "StageQueued"), ("unit.work.transcode.index", "WorkItem")]
    work = out[2][1]
    assert work.attempt == 1 and work.stage == "transcode" and [r.name for r in work.renditions][0] == "720p"
    assert all(e.job_id == ev.job_id_for("u1") and e.causation_id == source.event_id for _, e in out)
    assert all(e.correlation_id == "u1" for _, e in out)


def test_intake_rejects_bad_media_with_its_class():
    out = decide(None, upload(), UnsupportedMedia("no video stream"), SETTINGS, "intake@t", clock=CLOCK)
    assert len(out) == 1
    rejected = out[0][1]
    assert rejected.event_type == "JobRejected" and rejected.error_class == "unsupported_media"
    assert rejected.reason == "no video stream"


def test_intake_ignores_a_duplicate_of_an_existing_job():
    assert decide({"job_id": "x", "state": "running"}, upload(), MEDIA, SETTINGS, "intake@t", clock=CLOCK) == []
    assert decide({"job_id": "x"}, upload(), InvalidInput("x"), SETTINGS, "intake@t", clock=CLOCK) == []


def item(stage="transcode", attempt=1):
    return ev.WorkItem.new(system_clock.stamp(), job_id="j", stage=stage, attempt=attempt, recorded_by="t", correlation_id="u",
                           tier="standard", source_key="k", inputs=[], renditions=[])


def test_should_skip_rules():
    assert should_skip(None, item()) == "unknown job"
    assert "ended" in should_skip({"state": "completed", "stage": "publish", "attempt": 1}, item())
    assert "stale" in should_skip({"state": "queued", "stage": "publish", "attempt": 1}, item("transcode"))
    assert "stale" in should_skip({"state": "queued", "stage": "transcode", "attempt": 2}, item(attempt=1))
    assert should_skip({"state": "running", "stage": "transcode", "attempt": 1, "claim_token": "t"}, item()) \
        == "attempt already claimed"
    assert should_skip({"state": "queued", "stage": "transcode", "attempt": 1, "claim_token": None}, item()) is None
    assert should_skip({"state": "queued", "stage": "publish", "attempt": 1}, item("publish")) is None
    # An attempt that ended (failed, its retry scheduled) is never claimed again by a duplicate item.
    ended = {"state": "retry_scheduled", "stage": "transcode", "attempt": 1, "claim_token": "t"}
    assert should_skip(ended, item()) == "attempt already ended (job is retry_scheduled after transcode attempt 1)"
    assert should_skip(ended, item(attempt=2)) is None  # the retry's own attempt: the projection is behind


def test_retry_decision_by_class_and_budget():
    policy = RetryPolicy(max_attempts=3, backoff_s=(60.0, 300.0), jitter=0.0)
    assert retry_decision("invalid_input", 1, policy).action is Action.FAIL
    assert retry_decision("unsupported_media", 1, policy).action is Action.FAIL
    assert retry_decision("limits_exceeded", 1, policy).action is Action.FAIL
    assert retry_decision("quota_exceeded", 1, policy).action is Action.FAIL
    first = retry_decision("storage_transient", 1, policy)
    assert (first.action, first.next_attempt, first.delay_s) == (Action.RETRY, 2, 60.0)
    assert retry_decision("timeout", 2, policy).delay_s == 300.0
    assert retry_decision("worker_lost", 2, policy).delay_s == 0.0  # a stall is retried at once
    assert retry_decision("worker_lost", 3, policy).action is Action.DEAD_LETTER
    assert retry_decision("no_such_class", 1, policy).action is Action.RETRY
    # Not retried, but reopenable: a published key holding other bytes goes to an operator at once.
    conflict = retry_decision("output_conflict", 1, policy)
    assert (conflict.action, conflict.next_attempt) == (Action.DEAD_LETTER, None)


def test_backoff_repeats_its_last_step_and_jitter_stays_in_bounds():
    policy = RetryPolicy(max_attempts=10, backoff_s=(1.0, 5.0), jitter=0.1)
    rng = random.Random(7)
    delays = [retry_decision("out_of_memory", n, policy, rng).delay_s for n in range(1, 8)]
    assert 0.9 <= delays[0] <= 1.1 and all(4.5 <= d <= 5.5 for d in delays[1:])
    assert len(set(delays)) > 1  # jittered


def test_per_class_schedule_overrides_the_default():
    policy = RetryPolicy(max_attempts=4, backoff_s=(60.0,), jitter=0.0,
                         backoff_by_class={"provider_throttled": (600.0, 1200.0)})
    assert retry_decision("provider_throttled", 1, policy).delay_s == 600.0
    assert retry_decision("provider_throttled", 2, policy).delay_s == 1200.0
    assert retry_decision("storage_transient", 2, policy).delay_s == 60.0


def test_settings_build_the_policy():
    policy = Settings(max_attempts=5, retry_backoff_s=(2.0,), retry_jitter=0.0).retry_policy()
    assert policy.max_attempts == 5 and retry_decision("timeout", 1, policy).delay_s == 2.0


def test_superseded_reason_rules():
    running = {"state": "running", "stage": "transcode", "attempt": 1, "claim_token": "mine"}
    assert superseded_reason(running, "transcode", 1, "mine") is None
    assert superseded_reason(dict(running, claim_token=None, state="queued"), "transcode", 1, "mine") is None
    assert "attempt 2" in superseded_reason(dict(running, attempt=2, state="queued"), "transcode", 1, "mine")
    assert "another claim" in superseded_reason(dict(running, claim_token="theirs"), "transcode", 1, "mine")
    assert "ended" in superseded_reason(dict(running, state="completed"), "transcode", 1, "mine")
    assert "publish" in superseded_reason(dict(running, stage="publish"), "transcode", 1, "mine")
    assert superseded_reason(None, "transcode", 1, "mine") is None


def test_projection_behind_a_work_item_means_wait_not_skip():
    assert projection_behind(None, item())  # the job's JobAccepted is not projected yet
    assert projection_behind({"state": "accepted", "stage": "intake", "attempt": 0}, item())
    assert projection_behind({"state": "running", "stage": "transcode", "attempt": 1}, item("publish"))
    assert not projection_behind({"state": "queued", "stage": "transcode", "attempt": 1}, item())
    assert not projection_behind({"state": "queued", "stage": "transcode", "attempt": 2}, item())  # stale item
    assert not projection_behind({"state": "rejected", "stage": "intake", "attempt": 0}, item())


def test_a_stall_records_the_error_class_of_what_was_seen_and_the_attempts_view_agrees():
    from pathlib import Path

    from domain.policy.retry import STALL_ERROR_CLASSES, stall_error_class

    assert stall_error_class("no_progress") == "progress_stalled"  # the worker was alive: not "lost"
    assert stall_error_class("lease_expired") == stall_error_class("worker_exited") == "worker_lost"
    policy = RetryPolicy()
    assert retry_decision("progress_stalled", 1, policy).delay_s == 0.0  # retried at once, like worker_lost
    views = sorted((Path(__file__).resolve().parents[2] / "projections/sql/migrations").glob("*.sql"))
    newest = [v.read_text() for v in views if "VIEW attempts AS" in v.read_text()][-1]
    for kind, error_class in STALL_ERROR_CLASSES.items():
        if error_class != "worker_lost":  # the view's default for a stall
            assert f"x.payload->>'kind' = '{kind}' THEN '{error_class}'" in newest


def test_an_attempts_events_are_stamped_by_the_clock_it_was_given():
    from processors.runtime import AttemptIdentity

    clock = FixedClock(prefix="attempt")
    identity = AttemptIdentity(job_id="j", stage="transcode", attempt=2, claim_token="t", recorded_by="w",
                               correlation_id="u", causation_id=None, clock=clock)
    first = identity.event(ev.AttemptYielded, reason="stopping")
    second = identity.event(ev.Heartbeat, sequence=1, frames_done=1, out_time_s=0.5)
    assert (first.occurred_at, first.event_id, second.event_id) == (clock.at, "attempt-1", "attempt-2")
    assert (first.claim_token, first.attempt, second.stage) == ("t", 2, "transcode")

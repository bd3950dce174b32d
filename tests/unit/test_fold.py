"""The pure job projection: state machine, fencing by claim token, terminal states."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from domain.lifecycle import JOB_STATE_COLUMNS, attempts_used, evolve
from domain import events as ev
from tapeline.clock import system_clock

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
JOB = ev.job_id_for("upload-1")
MEDIA = ev.SourceMedia(format_name="mov", duration_s=5.28, width=1280, height=720, display_width=1280,
                       display_height=720, rotation=0, fps=25.0, frames=132, video_codec="h264", audio_codec="aac")
LADDER = [ev.Rendition(name="720p", width=1280, height=720, video_bitrate_kbps=2800)]


def new(cls, stage="transcode", attempt=1, token=None, **fields):
    return cls.new(system_clock.stamp(), job_id=JOB, stage=stage, attempt=attempt, claim_token=token, recorded_by="test",
                   correlation_id="upload-1", **fields)


def accepted():
    return new(ev.JobAccepted, stage="intake", attempt=0, upload_id="upload-1", source_key="uploads/upload-1/a.mp4",
               source_sha256="00" * 32, source_size_bytes=100, priority="standard", profile="default", media=MEDIA,
               ladder=LADDER)


def fold_all(events, row=None):
    outcomes = []
    for i, event in enumerate(events):
        outcome = evolve(row, event, T0 + timedelta(seconds=i))
        outcomes.append(outcome)
        row = outcome.row
    return row, outcomes


def happy_path(token_t="tok-t", token_p="tok-p"):
    return [
        accepted(),
        new(ev.StageQueued, tier="standard", work_topic="w"),
        new(ev.AttemptStarted, token=token_t, lease_s=30.0, worker="w1", work_topic="w", work_partition=0, work_offset=0),
        new(ev.Heartbeat, token=token_t, sequence=1, frames_done=50, out_time_s=2.0, speed=1.0),
        new(ev.AttemptSucceeded, token=token_t, outputs=[], renditions=LADDER, elapsed_s=4.0),
        new(ev.StageQueued, stage="publish", token=token_t, tier="standard", work_topic="p"),
        new(ev.AttemptStarted, stage="publish", token=token_p, lease_s=30.0, worker="p1", work_topic="p",
            work_partition=0, work_offset=0),
        new(ev.Published, stage="publish", token=token_p, provider="origin", provider_ref="k", master_key="k",
            master_url="http://s3/m.m3u8", renditions=LADDER),
        new(ev.JobCompleted, stage="publish", token=token_p, master_url="http://s3/m.m3u8"),
    ]


def test_happy_path_reaches_completed_with_one_attempt():
    row, outcomes = fold_all(happy_path())
    assert all(o.applied for o in outcomes)
    assert row["state"] == "completed" and row["stage"] == "publish" and row["attempts"] == 1
    assert row["master_url"] == "http://s3/m.m3u8" and row["renditions"][0]["name"] == "720p"
    assert row["completed_at"] == T0 + timedelta(seconds=8)
    assert set(row) == set(JOB_STATE_COLUMNS)


def test_lease_is_computed_from_broker_time():
    row, _ = fold_all(happy_path()[:4])
    assert row["state"] == "running"
    assert row["leased_until"] == T0 + timedelta(seconds=3) + timedelta(seconds=30)
    assert row["progress_frames"] == 50 and row["progress_at"] == T0 + timedelta(seconds=3)


def test_event_with_a_superseded_claim_token_changes_nothing():
    events = happy_path()[:3]
    row, _ = fold_all(events)
    late = new(ev.AttemptSucceeded, token="zombie-token", outputs=[], renditions=[], elapsed_s=1.0)
    outcome = evolve(row, late, T0 + timedelta(seconds=10))
    assert outcome.superseded and not outcome.applied and outcome.row == row


def test_older_attempt_start_is_superseded():
    row, _ = fold_all(happy_path()[:3])
    row = dict(row, attempt=2)
    outcome = evolve(row, new(ev.AttemptStarted, attempt=1, token="old", lease_s=30.0, worker="w",
                              work_topic="w", work_partition=0, work_offset=0), T0)
    assert outcome.superseded and outcome.row == row


def test_completed_job_never_reopens():
    row, _ = fold_all(happy_path())
    for late in (new(ev.JobFailed, error_class="unknown", reason="late"),
                 new(ev.JobReplayed, stage="operator", attempt=0, operator="ops", reason="again"),
                 new(ev.StageQueued, attempt=2, tier="standard", work_topic="w")):
        outcome = evolve(row, late, T0 + timedelta(hours=1))
        assert not outcome.applied and outcome.row["state"] == "completed"


def test_dead_lettered_job_reopens_only_by_replay():
    row, _ = fold_all(happy_path()[:3])
    row, _ = fold_all([new(ev.JobDeadLettered, token="tok-t", error_class="unknown", reason="x", attempts=3,
                           evidence="e")], row)
    assert row["state"] == "dead_lettered"
    assert not evolve(row, new(ev.StageQueued, attempt=4, tier="standard", work_topic="w"), T0).applied
    reopened = evolve(row, new(ev.JobReplayed, attempt=row["attempt"], operator="ops", reason="fixed",
                               dead_letter_id=f"job-1/{row['attempt']}"), T0)
    assert reopened.applied and reopened.row["state"] == "queued"
    # A fresh attempt budget: the attempts before the replay no longer count.
    assert reopened.row["budget_base"] == row["attempt"] and reopened.row["yields"] == 0
    assert attempts_used(reopened.row, row["attempt"] + 1) == 1
    assert reopened.row["reason"] == "replayed by ops: fixed"


def test_rejected_upload_creates_a_terminal_row():
    row, _ = fold_all([new(ev.JobRejected, stage="intake", attempt=0, upload_id="upload-1",
                           error_class="invalid_input", reason="not a readable video")])
    assert row["state"] == "rejected" and row["error_class"] == "invalid_input"
    assert row["reason"] == "not a readable video"


def test_events_of_an_unknown_job_are_evidence_only():
    outcome = evolve(None, new(ev.Heartbeat, token="t", sequence=1, frames_done=1, out_time_s=0.1), T0)
    assert outcome.row is None and not outcome.applied


def test_second_intake_decision_for_an_existing_job_is_not_applied():
    row, _ = fold_all([accepted()])
    assert not evolve(row, accepted(), T0).applied


def test_retry_due_time_is_the_writers_delay_on_the_broker_clock():
    row, _ = fold_all(happy_path()[:3])
    skewed = T0 - timedelta(minutes=2)  # the writer's clock is two minutes slow
    retry = ev.RetryScheduled.new(system_clock.stamp(), job_id=JOB, stage="transcode", attempt=1, claim_token="tok-t", recorded_by="w",
                                  correlation_id="upload-1", occurred_at=skewed,
                                  not_before=skewed + timedelta(seconds=60), next_attempt=2, error_class="timeout")
    outcome = evolve(row, retry, T0 + timedelta(seconds=10))
    assert outcome.applied and outcome.row["state"] == "retry_scheduled"
    assert outcome.row["retry_due_at"] == T0 + timedelta(seconds=70) and outcome.row["retry_next_attempt"] == 2


def test_a_seek_grace_holds_until_frames_move_and_a_new_attempt_drops_it():
    start = new(ev.AttemptStarted, token="t1", lease_s=30.0, worker="w1", work_topic="w", work_partition=0,
                work_offset=0)
    row, _ = fold_all([accepted(), new(ev.StageQueued, tier="standard", work_topic="w"), start,
                       # resumed at 400 reused frames; ffmpeg decodes silently to the resume point
                       new(ev.Heartbeat, token="t1", sequence=1, frames_done=400, out_time_s=16.0, progress_grace_s=90.0),
                       new(ev.Heartbeat, token="t1", sequence=2, frames_done=400, out_time_s=16.0, progress_grace_s=90.0)])
    assert row["progress_grace_s"] == 90.0 and row["progress_at"] == T0 + timedelta(seconds=3)
    still, _ = fold_all([new(ev.Heartbeat, token="t1", sequence=3, frames_done=400, out_time_s=16.0)], row)
    assert still["progress_grace_s"] == 90.0  # no movement yet: the grace stays
    moved, _ = fold_all([new(ev.Heartbeat, token="t1", sequence=4, frames_done=425, out_time_s=17.0)], row)
    assert moved["progress_grace_s"] is None
    restarted, _ = fold_all([new(ev.AttemptStarted, attempt=2, token="t2", lease_s=30.0, worker="w2", work_topic="w",
                                 work_partition=0, work_offset=1)], row)
    assert restarted["progress_grace_s"] is None

"""The watchdog's pure core: `run_once` over view rows."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from processors.watchdog import run_once
from tapeline.settings import Settings
from tests.fakeclock import FixedClock

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
CLOCK = FixedClock(NOW)  # the writer's clock the events are stamped with
SETTINGS = Settings(topic_prefix="unit", max_attempts=3)


def job(job_id="j1", state="running", stage="transcode", attempt=1, yields=0, **extra):
    return {"job_id": job_id, "upload_id": "u1", "state": state, "stage": stage, "attempt": attempt,
            "yields": yields, "priority": "archive", "source_key": "uploads/u1/a.mp4", "source_duration_s": 5.28,
            "ladder": [{"name": "720p", "width": 1280, "height": 720, "video_bitrate_kbps": 2800,
                        "playlist_key": "work/j1/transcode/1/720p/index.m3u8", "url": None}],
            "outputs": [{"key": "work/j1/transcode/1/720p/index.m3u8", "sha256": "0" * 64, "size_bytes": 10,
                         "content_type": "application/vnd.apple.mpegurl"}],
            "audio_playlist_key": "work/j1/transcode/1/audio/index.m3u8", **extra}


def stalled(kind="lease_expired", attempt=1, stage="transcode", job_id="j1"):
    return {"job_id": job_id, "stage": stage, "attempt": attempt, "kind": kind, "log_now": NOW,
            "leased_until": NOW - timedelta(seconds=2), "last_heartbeat_at": NOW - timedelta(seconds=9),
            "last_progress_at": NOW - timedelta(seconds=9),
            "progress_frames": 120, "since_s": 9.0, "log_partition": 1}


def kinds(result):
    return [(topic.rsplit(".", 1)[-1] if "work" in topic else topic, event.event_type) for topic, event in result.outgoing]


def test_stalled_attempt_is_retried_at_once_as_the_next_attempt():
    result = run_once([stalled()], [], [], {"j1": job()}, SETTINGS, "watchdog@t", clock=CLOCK)
    assert result.counts["retry"] == 1
    assert kinds(result) == [("unit.jobs", "StallDetected"), ("unit.jobs", "RetryScheduled"),
                             ("unit.jobs", "StageQueued"), ("archive", "WorkItem")]
    stall, retry, queued, item = (e for _, e in result.outgoing)
    assert stall.kind == "lease_expired" and stall.stalled_attempt == 1 and stall.since_s == 9.0
    assert retry.next_attempt == 2 and retry.not_before == retry.occurred_at and retry.error_class == "worker_lost"
    assert queued.attempt == 2 and item.attempt == 2 and item.stage == "transcode"
    assert item.source_key == "uploads/u1/a.mp4" and item.inputs == []
    assert item.renditions[0].playlist_key is None  # a transcode retry writes its own outputs
    assert stall.dedup_key == "j1:transcode:1:StallDetected"


def test_publish_retry_carries_the_transcode_outputs():
    result = run_once([stalled(stage="publish")], [], [], {"j1": job(stage="publish")}, SETTINGS, "w", clock=CLOCK)
    item = result.outgoing[-1][1]
    assert item.stage == "publish" and [o.key for o in item.inputs] == ["work/j1/transcode/1/720p/index.m3u8"]
    assert item.audio_playlist_key == "work/j1/transcode/1/audio/index.m3u8"


def test_out_of_attempts_dead_letters_and_yields_do_not_count():
    result = run_once([stalled(attempt=3)], [], [], {"j1": job(attempt=3)}, SETTINGS, "w", clock=CLOCK)
    assert result.counts["dead_letter"] == 1
    assert kinds(result) == [("unit.jobs", "StallDetected"), ("unit.jobs", "JobDeadLettered"),
                             ("unit.dlq", "JobDeadLettered")]
    assert result.outgoing[1][1].attempts == 3
    assert result.outgoing[2][1] is result.outgoing[1][1]  # the dead-letter record is the same event
    yielded = run_once([stalled(attempt=3)], [], [], {"j1": job(attempt=3, yields=1)}, SETTINGS, "w", clock=CLOCK)
    assert yielded.counts["retry"] == 1


def test_a_stalled_attempts_dead_letter_carries_its_claim_and_ends_it_in_the_fold():
    """Issue 44 item 6: an ending event without the running attempt's claim token no longer ends
    a running job (`without_claim`); the watchdog's dead letter carries the stalled attempt's
    claim, so it ends that attempt even when an event of the attempt lands between it and its
    `StallDetected`, and no other."""
    from domain.lifecycle import evolve

    running = job(attempt=3, claim_token="tok-3", last_event_type="Heartbeat", events=5, updated_at=NOW)
    result = run_once([stalled(attempt=3)], [], [], {"j1": running}, SETTINGS, "w", clock=CLOCK)
    dead = result.outgoing[1][1]
    assert dead.event_type == "JobDeadLettered" and dead.claim_token == "tok-3"
    ended = evolve(running, dead, NOW)
    assert ended.applied and ended.row["state"] == "dead_lettered"
    unclaimed = evolve(running, dead.model_copy(update={"claim_token": None}), NOW)  # a Heartbeat came between
    assert unclaimed.superseded and not unclaimed.applied


def test_a_replayed_job_has_a_fresh_budget():
    # Dead-lettered at attempt 3, replayed by an operator: attempt 4 is the first of a new budget.
    replayed = run_once([stalled(attempt=4)], [], [], {"j1": job(attempt=4, budget_base=3)}, SETTINGS, "w", clock=CLOCK)
    assert replayed.counts["retry"] == 1 and replayed.outgoing[1][1].next_attempt == 5
    exhausted = run_once([stalled(attempt=6)], [], [], {"j1": job(attempt=6, budget_base=3)}, SETTINGS, "w", clock=CLOCK)
    assert exhausted.counts["dead_letter"] == 1 and exhausted.outgoing[1][1].attempts == 3


def test_rows_that_no_longer_match_the_job_are_ignored():
    moved_on = run_once([stalled(attempt=1)], [], [], {"j1": job(attempt=2)}, SETTINGS, "w", clock=CLOCK)
    ended = run_once([stalled()], [], [], {"j1": job(state="completed")}, SETTINGS, "w", clock=CLOCK)
    unknown = run_once([stalled()], [], [], {}, SETTINGS, "w", clock=CLOCK)
    for result in (moved_on, ended, unknown):
        assert result.outgoing == [] and result.counts["ignore"] == 1


def test_stalled_handoff_is_redriven_with_a_numbered_dedup_key():
    handoff = {"job_id": "j1", "stage": "publish", "attempt": 1, "redrives": 2, "since_s": 130.0, "log_now": NOW,
               "queued_at": NOW - timedelta(seconds=130)}
    result = run_once([], [handoff], [], {"j1": job(state="queued", stage="publish")}, SETTINGS, "w", clock=CLOCK)
    assert result.counts["redrive"] == 1
    stall, item = (e for _, e in result.outgoing)
    assert stall.kind == "handoff" and stall.dedup_key == "j1:publish:1:StallDetected:handoff-2"
    assert item.stage == "publish" and item.attempt == 1


def test_missing_work_is_reported():
    missing = {"upload_id": "u9", "job_id": "j9", "since_s": 200.0, "uploaded_at": NOW - timedelta(seconds=200),
               "log_now": NOW}
    result = run_once([], [], [missing], {}, SETTINGS, "w", clock=CLOCK)
    assert result.counts["report"] == 1
    assert result.outgoing[0][1].kind == "expected_work_missing" and result.outgoing[0][1].job_id == "j9"


def test_run_once_is_deterministic_in_its_dedup_keys():
    first = run_once([stalled()], [], [], {"j1": job()}, SETTINGS, "w", clock=CLOCK)
    second = run_once([stalled()], [], [], {"j1": job()}, SETTINGS, "w", clock=CLOCK)
    assert [e.dedup_key for _, e in first.outgoing] == [e.dedup_key for _, e in second.outgoing]


def test_due_retry_is_dispatched_once_as_the_next_attempt():
    row = {"job_id": "j1", "stage": "transcode", "attempt": 1, "retry_next_attempt": 2, "log_now": NOW}
    waiting = job(state="retry_scheduled", retry_next_attempt=2)
    result = run_once([], [], [], {"j1": waiting}, SETTINGS, "w", due=[row], clock=CLOCK)
    assert result.counts["dispatch"] == 1
    assert kinds(result) == [("unit.jobs", "StageQueued"), ("archive", "WorkItem")]
    assert result.outgoing[0][1].dedup_key == "j1:transcode:2:StageQueued"
    moved_on = run_once([], [], [], {"j1": job(state="queued", attempt=2)}, SETTINGS, "w", due=[row], clock=CLOCK)
    assert moved_on.outgoing == [] and moved_on.counts["ignore"] == 1


def test_stall_with_a_configured_backoff_waits_for_the_due_time():
    settings = Settings(topic_prefix="unit", retry_backoff_by_class={"worker_lost": (30.0,)}, retry_jitter=0.0)
    result = run_once([stalled()], [], [], {"j1": job()}, settings, "w", clock=CLOCK)
    assert kinds(result) == [("unit.jobs", "StallDetected"), ("unit.jobs", "RetryScheduled")]
    retry = result.outgoing[1][1]
    assert (retry.not_before - retry.occurred_at).total_seconds() == 30.0


def test_a_candidate_the_stall_rule_does_not_call_stalled_is_ignored():
    """The view's row was read before a heartbeat moved the lease: the rule judges the row it is given."""
    alive = {**stalled(), "leased_until": NOW + timedelta(seconds=3), "last_heartbeat_at": NOW - timedelta(seconds=1),
             "last_progress_at": NOW - timedelta(seconds=1)}
    result = run_once([alive], [], [], {"j1": job()}, SETTINGS, "w", clock=CLOCK)
    assert result.outgoing == [] and result.counts["ignore"] == 1
    frozen = {**alive, "last_progress_at": NOW - timedelta(seconds=SETTINGS.no_progress_timeout_s + 1)}
    result = run_once([frozen], [], [], {"j1": job()}, SETTINGS, "w", clock=CLOCK)
    assert result.outgoing[0][1].kind == "no_progress"
    graced = run_once([frozen], [], [], {"j1": job(progress_grace_s=60.0)}, SETTINGS, "w", clock=CLOCK)
    assert graced.outgoing == [] and graced.counts["ignore"] == 1


def test_every_event_is_stamped_by_the_clock_it_is_given():
    clock = FixedClock(NOW + timedelta(hours=1), prefix="wd")
    result = run_once([stalled()], [], [], {"j1": job()}, SETTINGS, "w", clock=clock)
    stamps = [(event.occurred_at, event.event_id) for _, event in result.outgoing]
    assert stamps == [(NOW + timedelta(hours=1), f"wd-{i}") for i in range(1, len(stamps) + 1)]


def test_a_lease_that_ended_during_a_log_outage_is_judged_one_lease_after_the_log_came_back():
    """Issue 24: two brokers down for longer than the lease refused the workers' heartbeats and the
    watchdog's ticks alike; the lease that ended meanwhile is not a lost worker until one lease after
    the log accepted writes again (then it is, if no heartbeat came)."""
    from domain.policy.stall import LogOutage

    lease = SETTINGS.lease_s
    outage = LogOutage(began_at=NOW - timedelta(seconds=40), ended_at=NOW - timedelta(seconds=1))
    excused = run_once([stalled()], [], [], {"j1": job()}, SETTINGS, "w", clock=CLOCK, outage=outage)
    assert excused.outgoing == [] and excused.counts["ignore"] == 1
    later = {**stalled(), "log_now": outage.ended_at + timedelta(seconds=lease + 1)}
    judged = run_once([later], [], [], {"j1": job()}, SETTINGS, "w", clock=CLOCK, outage=outage)
    assert judged.counts["retry"] == 1
    # a lease that had ended before the outage began is a stall all the same
    before = {**stalled(), "leased_until": outage.began_at - timedelta(seconds=1)}
    assert run_once([before], [], [], {"j1": job()}, SETTINGS, "w", clock=CLOCK, outage=outage).counts["retry"] == 1


def test_frozen_progress_during_a_log_outage_waits_too():
    from domain.policy.stall import LogOutage

    frozen = {**stalled(kind="no_progress"), "leased_until": NOW + timedelta(seconds=60),
              "last_progress_at": NOW - timedelta(seconds=SETTINGS.no_progress_timeout_s + 5)}
    outage = LogOutage(began_at=NOW - timedelta(seconds=30), ended_at=NOW - timedelta(seconds=2))
    assert run_once([frozen], [], [], {"j1": job()}, SETTINGS, "w", clock=CLOCK).counts["retry"] == 1
    assert run_once([frozen], [], [], {"j1": job()}, SETTINGS, "w", clock=CLOCK, outage=outage).outgoing == []


def test_a_no_progress_stall_carries_the_last_heartbeats_tool_state():
    """Issue 45 item 2: the view gives the attempt's last heartbeat's `tool_state` (JSON); the stall
    event carries it, fields it does not know left out; a row without one gives a stall without."""
    seen = {"tool": "ffmpeg", "process_state": "T", "cpu_s": 0.0, "window_s": 9.5,
            "last_progress": "frame=392 out_time=00:00:15.68", "stderr_tail": None, "from_a_newer_worker": 1}
    frozen = {**stalled(kind="no_progress"), "leased_until": NOW + timedelta(seconds=3),
              "last_heartbeat_at": NOW - timedelta(seconds=1),
              "last_progress_at": NOW - timedelta(seconds=SETTINGS.no_progress_timeout_s + 1), "tool_state": seen}
    stall = run_once([frozen], [], [], {"j1": job()}, SETTINGS, "w", clock=CLOCK).outgoing[0][1]
    assert stall.kind == "no_progress"
    assert (stall.tool_state.process_state, stall.tool_state.window_s, stall.tool_state.last_progress) == (
        "T", 9.5, "frame=392 out_time=00:00:15.68")
    plain = run_once([{**frozen, "tool_state": None}], [], [], {"j1": job()}, SETTINGS, "w", clock=CLOCK)
    assert plain.outgoing[0][1].tool_state is None

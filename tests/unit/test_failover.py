"""The pure parts of a failover: which region holds the job history (domain/regions.py), the
`region_lost` stall that gives its attempt back (domain/lifecycle.py, processors/watchdog.py), and
the same rule in the native fold engine."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from domain import events as ev
from domain.lifecycle import attempts_used, evolve
from domain.regions import Authority, authority, failover_event, fence_reason, region_lost_row
from processors.watchdog import run_once
from tapeline.settings import Settings
from tests.fakeclock import FixedClock

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=timezone.utc)
CLOCK = FixedClock(NOW)


def failover(current: Authority, to: str, minutes: int = 0, **changes) -> ev.RegionFailedOver:
    return failover_event(current, to, reason=changes.get("reason", "region a lost power"),
                          operator=changes.get("operator", "ops"), planned=False, recorded_by="failover@t",
                          failover_id="f1", stamp=ev.Stamp(NOW + timedelta(minutes=minutes), f"e{minutes}"))


def test_region_a_holds_the_history_until_a_failover_says_otherwise():
    start = authority([])
    assert (start.active, start.epoch, start.record) == ("a", 0, None)
    assert fence_reason("a", start) is None
    assert "standby" in fence_reason("b", start) and "region failover --to b" in fence_reason("b", start)

    to_b = failover(start, "b")
    assert (to_b.from_region, to_b.to_region, to_b.epoch, to_b.attempt, to_b.job_id) == ("a", "b", 1, 1, "region")
    now = authority([to_b])
    assert (now.active, now.epoch) == ("b", 1)
    assert fence_reason("b", now) is None
    reason = fence_reason("a", now)
    assert reason.startswith("region a is fenced: region b took over the job history at region epoch 1")
    assert "by ops: region a lost power" in reason and "Failback" in reason


def test_the_highest_epoch_wins_wherever_it_was_read_and_in_any_order():
    to_b = failover(authority([]), "b")
    back_to_a = failover(authority([to_b]), "a", minutes=5)
    assert back_to_a.epoch == 2
    for records in ([to_b, back_to_a], [back_to_a, to_b], [back_to_a, to_b, to_b]):  # a record read twice
        assert (authority(records).active, authority(records).epoch) == ("a", 2)
    assert fence_reason("b", authority([to_b, back_to_a])).startswith("region b is fenced")
    # Two failovers that raced from both sides at one epoch: the later one holds.
    rival = failover(authority([]), "a", minutes=1)
    assert authority([to_b, rival]).active == authority([rival, to_b]).active == "a"


def test_a_failover_needs_a_known_region_and_a_reason():
    with pytest.raises(ValueError, match="unknown region"):
        failover(authority([]), "c")
    with pytest.raises(ValueError, match="--why"):
        failover(authority([]), "b", reason="  ")


def running(**changes):
    row = {"job_id": "j1", "upload_id": "u1", "state": "running", "stage": "transcode", "attempt": 3,
           "attempts": 3, "claim_token": "tok", "priority": "standard", "progress_at": NOW - timedelta(seconds=4),
           "last_heartbeat_at": NOW - timedelta(seconds=1), "leased_until": NOW + timedelta(seconds=100),
           "progress_frames": 120, "log_partition": 0, "yields": 0, "budget_base": 0, "ladder": [],
           "source_key": "k", "source_sha256": "0" * 64, "profile": "default", "redrives": 0, "events": 9}
    row.update(changes)
    return row


def test_an_attempt_lost_with_its_region_is_retried_at_once_even_on_its_last_attempt():
    to_b = failover(authority([]), "b")
    row = region_lost_row(running(), to_b, NOW)
    assert (row["kind"], row["since_s"]) == ("region_lost", 4.0)
    assert "region a" in row["detail"] and "epoch 1" in row["detail"]
    assert region_lost_row(running(state="queued"), to_b, NOW) is None  # nothing held: its work item is enough

    settings = Settings(max_attempts=3)
    result = run_once([row], [], [], {"j1": running()}, settings, "failover@t", clock=CLOCK)
    kinds = [(e.event_type, getattr(e, "kind", None) or getattr(e, "error_class", None)) for _, e in result.outgoing]
    assert kinds[:2] == [("StallDetected", "region_lost"), ("RetryScheduled", "region_lost")]
    assert [e.event_type for _, e in result.outgoing[2:]] == ["StageQueued", "WorkItem"]
    assert result.outgoing[3][1].attempt == 4
    # A worker_lost stall of the same attempt three would dead-letter the job: the budget is used up.
    lost = dict(row, kind="worker_exited")
    assert [e.event_type for _, e in run_once([lost], [], [], {"j1": running()}, settings, "w", clock=CLOCK).outgoing] \
        == ["StallDetected", "JobDeadLettered", "JobDeadLettered"]


def test_the_fold_gives_a_region_lost_attempt_back_and_not_any_other_stall():
    stall = ev.StallDetected.new(CLOCK.stamp(), job_id="j1", stage="transcode", attempt=3, recorded_by="f",
                                 correlation_id="u1", kind="region_lost", stalled_attempt=3, since_s=4.0, detail="x")
    after = evolve(running(), stall, NOW).row
    assert after["yields"] == 1 and attempts_used(after) == 2
    other = evolve(running(), stall.model_copy(update={"kind": "lease_expired"}), NOW).row
    assert other["yields"] == 0 and attempts_used(other) == 3


def test_the_native_engine_gives_it_back_too():
    """A job whose running attempt stalls `region_lost` and then `lease_expired` folds to the same row
    in both engines, with one yield (the region_lost stall) and one attempt used by the other."""
    from bench import lifecycles
    from domain.codec import default_codec
    from tests.enginecompare import JOBS, assert_same, fold_both, require_native
    from tests.fakelog import T0, FakeMessage

    require_native()
    codec = default_codec()
    events = [e for e in next(iter(lifecycles.jobs(1, 1, heartbeats=1, checkpoints=1)))
              if not isinstance(e, ev.UploadCompleted)]
    started = next(e for e in events if isinstance(e, ev.AttemptStarted))
    cut = events.index(started) + 1  # the attempt runs; then its region is lost, and a later one stalls
    stalls = [ev.StallDetected.new(CLOCK.stamp(), job_id=started.job_id, stage=started.stage, attempt=started.attempt,
                                   recorded_by="f", correlation_id="u", kind=kind, stalled_attempt=started.attempt,
                                   since_s=1.0, detail=kind, sequence=kind) for kind in ("region_lost", "lease_expired")]
    log = events[:cut] + stalls
    messages = [FakeMessage(JOBS, 0, i, int((T0 + timedelta(seconds=i)).timestamp() * 1000),
                            codec.encode(e.to_record()), b"key", []) for i, e in enumerate(log)]
    python, native = fold_both(messages, slice_size=3)
    assert_same(python, native)
    (row,) = python["open"]
    assert row["yields"] == 1 and row["reason"].startswith("stalled (lease_expired)")


def test_the_drill_counts_as_reencoded_only_segments_region_b_encoded_again():
    from bench.failover import reencoded_seconds

    def checkpoint(job, rendition, index, minutes, duration=4.0):
        return ev.CheckpointRecorded.new(ev.Stamp(NOW + timedelta(minutes=minutes), f"c{job}{rendition}{index}{minutes}"),
                                         job_id=job, stage="transcode", attempt=1 if minutes < 0 else 2,
                                         recorded_by="w", correlation_id="u", sequence=index, segment_index=index,
                                         rendition=rendition, object_key="k", sha256="0" * 64, frames=100,
                                         media_start_s=4.0 * index, media_duration_s=duration)

    events = [checkpoint("j", r, i, -1) for r in ("720p", "480p", "audio") for i in (0, 1)]  # A recorded 0 and 1
    events += [checkpoint("j", r, 1, 1, 3.5) for r in ("720p", "480p", "audio")]  # B encoded 1 again, every rendition
    events += [checkpoint("j", "720p", 2, 1)]  # B encoded 2 for the first time: new work, not again
    events += [checkpoint("k", "720p", 0, 1)]  # another job only B encoded
    assert reencoded_seconds(events, NOW) == 3.5
    assert reencoded_seconds(events[:6], NOW) == 0.0


def test_every_job_in_flight_is_delayed_once_per_failover_and_the_notifier_sends_it():
    from domain.policy.webhooks import NOTIFICATION_TYPES
    from domain.regions import DELAYED_STATES, delayed_event

    to_b = failover(authority([]), "b")
    stamp = ev.Stamp(NOW, "d1")
    told = {state: delayed_event({"job_id": "j-" + state, "state": state}, to_b, recorded_by="failover@t", stamp=stamp)
            for state in ("accepted", "queued", "running", "retry_scheduled", "completed", "failed", "cancelled",
                          "rejected", "dead_lettered", "needs_review")}
    assert {state for state, event in told.items() if event is not None} == set(DELAYED_STATES)
    running = told["running"]
    assert (running.job_id, running.stage, running.attempt, running.epoch) == ("j-running", "region", 1, 1)
    assert (running.serving_region, running.from_region, running.state) == ("b", "a", "running")
    assert "region a was left for region b (outage: region a lost power)" in running.reason
    assert running.causation_id == to_b.event_id and running.correlation_id == to_b.correlation_id
    # The same failover run again: another event id, the same dedup key (the projection keeps one).
    again = delayed_event({"job_id": "j-running", "state": "running"}, to_b, recorded_by="failover@t2",
                          stamp=ev.Stamp(NOW + timedelta(seconds=30), "d2"))
    assert again.event_id != running.event_id and again.dedup_key == running.dedup_key
    # A later failover (the switch back) is another epoch: its own notification.
    back = failover(authority([to_b]), "a", minutes=5)
    assert delayed_event({"job_id": "j-running", "state": "queued"}, back, recorded_by="x",
                         stamp=stamp).dedup_key != running.dedup_key
    assert NOTIFICATION_TYPES["JobDelayed"] == "job.delayed"


def test_a_delayed_job_s_row_keeps_its_state():
    from domain.regions import delayed_event
    from tests.unit.test_fold import accepted

    row = evolve(None, accepted(), NOW).row

    delayed = delayed_event(row, failover(authority([]), "b"), recorded_by="failover@t", stamp=ev.Stamp(NOW, "d"))
    outcome = evolve(row, delayed, NOW + timedelta(seconds=1))
    assert outcome.applied and outcome.row["state"] == row["state"] and outcome.row["events"] == row["events"] + 1
    assert outcome.row["last_event_type"] == "JobDelayed"

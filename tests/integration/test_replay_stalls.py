"""A replay of the log reaches the same stall decisions as the live projection (issue 6, item 3).

Stall views judge on the log's own clock (broker LogAppendTime, advanced by watchdog ticks), never a
machine's clock, so a rebuilt schema must list exactly the stalled attempts, stalled handoffs and
missing work the live one listed, and an as-of replay must list what the live one listed then.

The log, against real Kafka and PostgreSQL, with stall thresholds of one second:
- phase 1: an attempt whose heartbeats stop (lease_expired), an attempt that heartbeats with frozen
  counters (no_progress), one frozen but within the grace of a silent seek (not stalled), a queued stage nobody claims (handoff), an upload with no job (expected
  work missing), a healthy job; one second later, ticks on every partition. Live snapshot 1.
- phase 2: the lease_expired attempt is retried and its next attempt runs (it leaves the view), the
  frozen attempt makes progress (it leaves the view), the handoff is claimed; one second later,
  ticks again. Live snapshot 2.
"""

from __future__ import annotations

import random
import time
import uuid
from datetime import datetime, timedelta, timezone

import psycopg
import pytest

from bench import lifecycles
from projections.replay import replay
from domain import events as ev
from tapeline import kafka
from tapeline.clock import system_clock
from tests.integration.test_projector import run_projector_until_caught_up
from tests.integration.test_replay import produce, rows

pytestmark = pytest.mark.integration

VIEWS = {  # view -> order; every column is a function of the log and the stall policy
    "stalled_attempts": "job_id, stage, attempt",
    "stalled_handoffs": "job_id, stage, attempt",
    "expected_work_missing": "upload_id",
}
POLICY = {"no_progress_timeout_s": 1.0, "handoff_timeout_s": 1.0, "intake_timeout_s": 1.0}


def set_policy(settings, schema: str) -> None:
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        conn.execute(f"UPDATE {schema}.stall_policy SET no_progress_timeout_s = %(no_progress_timeout_s)s, "
                     "handoff_timeout_s = %(handoff_timeout_s)s, intake_timeout_s = %(intake_timeout_s)s", POLICY)


def decisions(settings, schema: str) -> dict[str, list[dict]]:
    return {view: rows(settings, f"SELECT * FROM {schema}.{view} ORDER BY {order}") for view, order in VIEWS.items()}


class Job:
    """Hand-built lifecycle events of one job (the real models, so the real codec encodes them)."""

    def __init__(self) -> None:
        self.upload_id = f"u-{uuid.uuid4()}"
        self.job_id = ev.job_id_for(self.upload_id)
        self.common = dict(job_id=self.job_id, recorded_by="test", correlation_id=self.upload_id)
        self.tokens: dict[int, str] = {}

    def accepted(self) -> list[ev.Event]:
        return [ev.JobAccepted.new(system_clock.stamp(), stage="intake", attempt=0, upload_id=self.upload_id,
                                   source_key=f"uploads/{self.upload_id}/a.mp4", source_sha256="0" * 64,
                                   source_size_bytes=1_000_000, priority="standard", profile="default",
                                   media=lifecycles.MEDIA, ladder=lifecycles.LADDER, **self.common),
                self.queued(1)]

    def queued(self, attempt: int) -> ev.Event:
        return ev.StageQueued.new(system_clock.stamp(), stage="transcode", attempt=attempt, tier="standard",
                                  work_topic="work.transcode.standard", **self.common)

    def started(self, attempt: int, lease_s: float) -> ev.Event:
        self.tokens[attempt] = uuid.uuid4().hex
        return ev.AttemptStarted.new(system_clock.stamp(), stage="transcode", attempt=attempt, claim_token=self.tokens[attempt],
                                     lease_s=lease_s, worker="w1", work_topic="work.transcode.standard",
                                     work_partition=0, work_offset=attempt, **self.common)

    def heartbeat(self, attempt: int, sequence: int, frames: int, grace_s: float | None = None) -> ev.Event:
        return ev.Heartbeat.new(system_clock.stamp(), stage="transcode", attempt=attempt, claim_token=self.tokens[attempt],
                                sequence=sequence, frames_done=frames, frames_total=3000, out_time_s=frames / 25,
                                speed=1.0, progress_grace_s=grace_s, **self.common)


def ticks(settings, producer, sequence: int) -> list[ev.Event]:
    partitions = kafka.partition_count(producer, settings.jobs_topic)
    return [ev.WatchdogTick.new(system_clock.stamp(), job_id=f"tick:{p}", stage="watchdog", attempt=0, recorded_by="test",
                                correlation_id="watchdog", partition=p, sequence=sequence) for p in range(partitions)]


def produce_ticks(settings, producer, sequence: int) -> None:
    """One tick on each partition of the lifecycle log, on its own partition (not the key's)."""
    from domain.codec import default_codec

    codec = default_codec()
    producer.begin_transaction()
    for tick in ticks(settings, producer, sequence):
        producer.produce(settings.jobs_topic, key=tick.job_id.encode(), value=codec.encode(tick.to_record()),
                         partition=tick.partition)
    producer.commit_transaction(30)


def test_a_replay_and_an_as_of_replay_reach_the_live_stall_decisions(isolated):
    set_policy(isolated, "public")
    producer = kafka.transactional_producer(isolated, f"{isolated.app_name}.stall-writer")
    lost, frozen, unclaimed, seeking = Job(), Job(), Job(), Job()
    healthy = lifecycles.job(random.Random(3), heartbeats=3, checkpoints=1)
    orphan = lifecycles.upload(f"u-{uuid.uuid4()}")
    produce(isolated, producer, [*lost.accepted(), lost.started(1, lease_s=1.0), lost.heartbeat(1, 1, 100),
                                 *frozen.accepted(), frozen.started(1, lease_s=600.0), frozen.heartbeat(1, 1, 100),
                                 *unclaimed.accepted(), *healthy,
                                 *seeking.accepted(), seeking.started(1, lease_s=600.0), seeking.heartbeat(1, 1, 100, 60.0)],
            uploads=[lifecycles.upload(j.upload_id) for j in (lost, frozen, unclaimed, seeking)] + [orphan])
    time.sleep(1.5)
    # Alive with counters frozen; the seeking one decodes silently to its resume point, with a grace.
    produce(isolated, producer, [frozen.heartbeat(1, 2, 100), seeking.heartbeat(1, 2, 100, 60.0)])
    produce_ticks(isolated, producer, 1)
    run_projector_until_caught_up(isolated)
    first = decisions(isolated, "public")
    cut = rows(isolated, "SELECT max(now) AS t FROM log_clock")[0]["t"]  # the ticks: the newest records

    # What the live projection decided at the cut: one of each kind (the seeking attempt is in its grace).
    assert [(r["job_id"], r["kind"], r["attempt"]) for r in first["stalled_attempts"]] == sorted(
        [(lost.job_id, "lease_expired", 1), (frozen.job_id, "no_progress", 1)])
    assert [r["job_id"] for r in first["stalled_handoffs"]] == [unclaimed.job_id]
    assert [r["upload_id"] for r in first["expected_work_missing"]] == [orphan.upload_id]

    while datetime.now(timezone.utc) <= cut + timedelta(milliseconds=50):
        time.sleep(0.01)
    produce(isolated, producer, [
        ev.StallDetected.new(system_clock.stamp(), stage="transcode", attempt=1, kind="lease_expired", stalled_attempt=1,
                             claim_token=lost.tokens[1], since_s=1.0, **lost.common),
        ev.RetryScheduled.new(system_clock.stamp(), stage="transcode", attempt=1, next_attempt=2, not_before=cut,
                              error_class="worker_lost", **lost.common),
        lost.queued(2), lost.started(2, lease_s=600.0), lost.heartbeat(2, 1, 50),
        frozen.heartbeat(1, 3, 200), unclaimed.started(1, lease_s=600.0), unclaimed.heartbeat(1, 1, 10)])
    time.sleep(1.2)
    produce(isolated, producer, [lost.heartbeat(2, 2, 60), frozen.heartbeat(1, 4, 300),
                                 unclaimed.heartbeat(1, 2, 20)])
    produce_ticks(isolated, producer, 2)
    run_projector_until_caught_up(isolated)
    second = decisions(isolated, "public")
    assert second["stalled_attempts"] == [] and second["stalled_handoffs"] == []
    assert [r["upload_id"] for r in second["expected_work_missing"]] == [orphan.upload_id]

    # A full replay decides what the live projection decides now; an as-of replay, what it decided then.
    replay(isolated, "stalls_now")
    set_policy(isolated, "stalls_now")  # the policy is the watchdog's setting, not the log's (a swap copies it)
    assert decisions(isolated, "stalls_now") == second
    replay(isolated, "stalls_then", as_of=cut)
    set_policy(isolated, "stalls_then")
    assert decisions(isolated, "stalls_then") == first


def watchdog_decides(settings):
    """The watchdog's steps 3 and 4 on the live projection, handoffs only: its query, then `run_once`."""
    from processors.watchdog import run_once
    from tapeline.postgres import q

    with psycopg.connect(settings.database_url, row_factory=psycopg.rows.dict_row) as conn:
        handoffs = conn.execute(q("handoffs_due")).fetchall()
        ids = [r["job_id"] for r in handoffs]
        jobs = {r["job_id"]: r for r in conn.execute(q("job_state_by_ids"), {"job_ids": ids}).fetchall()}
    # The watchdog writes its thresholds to stall_policy; these tests wrote POLICY there themselves.
    return run_once([], handoffs, [], jobs, settings.model_copy(update=POLICY), "watchdog@test", due=[], clock=system_clock)


def test_a_re_driven_handoff_stays_listed_until_claimed_and_is_re_driven_once_per_timeout(isolated):
    set_policy(isolated, "public")  # handoff_timeout_s = 1
    producer = kafka.transactional_producer(isolated, f"{isolated.app_name}.redrive-writer")
    job = Job()
    produce(isolated, producer, job.accepted(), uploads=[lifecycles.upload(job.upload_id)])
    time.sleep(1.2)
    produce_ticks(isolated, producer, 1)
    run_projector_until_caught_up(isolated)
    listed = "SELECT job_id, redrives, redrive_due FROM stalled_handoffs"
    assert rows(isolated, listed) == [{"job_id": job.job_id, "redrives": 0, "redrive_due": True}]

    decided = watchdog_decides(isolated)  # the first re-drive
    assert decided.counts["redrive"] == 1
    produce(isolated, producer, [event for topic, event in decided.outgoing if topic == isolated.jobs_topic])
    produce_ticks(isolated, producer, 2)
    run_projector_until_caught_up(isolated)
    # Still unclaimed: still listed (before migration 019 it left the view here), not due again yet.
    assert rows(isolated, listed) == [{"job_id": job.job_id, "redrives": 1, "redrive_due": False}]
    assert watchdog_decides(isolated).outgoing == []

    time.sleep(1.2)  # a timeout after the re-drive: due again
    produce_ticks(isolated, producer, 3)
    run_projector_until_caught_up(isolated)
    assert rows(isolated, listed) == [{"job_id": job.job_id, "redrives": 1, "redrive_due": True}]
    assert watchdog_decides(isolated).counts["redrive"] == 1

    produce(isolated, producer, [job.started(1, lease_s=600.0)])  # a worker claims it: no longer stalled
    produce_ticks(isolated, producer, 4)
    run_projector_until_caught_up(isolated)
    assert rows(isolated, listed) == []

"""A zombie's late checkpoint is never used (issue 4, items 2 and 7), with real processes.

The broker fences a zombie worker's transactional producer, so a real zombie's late checkpoint
never reaches the log (`test_handover_faults.py` shows that). This test covers the layer behind it:
a late `CheckpointRecorded` that does land — as from a zombie on a broker whose fencing failed, or
a writer with another transactional id — carrying attempt 1's claim token after attempt 2 started.

Worker A transcodes attempt 1 and is killed after one checkpoint of every rendition; worker B takes
attempt 2 and is frozen (SIGSTOP) after the job's reusable prefix has grown to P segments. Then the
"zombie" writes, under attempt 1's claim token, valid-looking objects and `CheckpointRecorded`
events for segment P of every rendition (the very next segment every attempt 3 would need). B is
killed; worker C takes attempt 3. Asserted: the late checkpoints are kept as superseded evidence
and never applied, attempt 3 encodes from segment P (it trusted none of them), the outputs never
name a zombie object, and the job completes once with whole renditions.
"""

from __future__ import annotations

from tests.faults.conftest import OTHER_STAGES

import hashlib
import os
import signal
import time

import psycopg
import pytest

from domain import events as ev
from domain.codec import default_codec
from tapeline import kafka
from tapeline.objectstore import ObjectStore
from tapeline.clock import system_clock
from tests.conftest import wait_for
from tests.faults.test_checkpoint_resume import VIDEO, checkpoints_of_attempt, video_frames
from tests.faults.test_worker_faults import assert_completed_once, submit, wait_state
from tests.integration.helpers import committed_events, of_job

pytestmark = pytest.mark.integration


def prefix_length(recorded: dict[str, set[int]]) -> int:
    """Segments 0..P-1 recorded in every video rendition: the prefix a new attempt reuses."""
    length = 0
    while all(length in recorded.get(r, set()) for r in VIDEO):
        length += 1
    return length


def test_a_late_checkpoint_under_a_superseded_claim_is_never_reused(fault_settings, roles, long_video):
    for role in ("projector", "intake", "watchdog", *OTHER_STAGES):
        roles.start(role)
    first = roles.start("transcode")
    job_id = submit(fault_settings, long_video)
    wait_for(lambda: all(checkpoints_of_attempt(fault_settings, job_id, 1).get(r) for r in VIDEO), 120,
             "a checkpoint of every rendition from attempt 1", interval_s=0.05)
    os.killpg(first.pid, signal.SIGKILL)

    second = roles.start("transcode")
    both = lambda: {r: set(checkpoints_of_attempt(fault_settings, job_id, 1).get(r, [])) |  # noqa: E731
                    set(checkpoints_of_attempt(fault_settings, job_id, 2).get(r, [])) for r in VIDEO}
    wait_for(lambda: checkpoints_of_attempt(fault_settings, job_id, 2) and prefix_length(both()) >= 3, 120,
             "attempt 2 to extend the reusable prefix to 3 segments", interval_s=0.05)
    os.killpg(second.pid, signal.SIGSTOP)
    # A transaction open at the freeze commits or is aborted by the broker within its timeout.
    time.sleep(fault_settings.transaction_timeout_ms / 1000 + 1.0)

    events = of_job(committed_events(fault_settings), job_id)
    recorded: dict[str, dict[int, ev.CheckpointRecorded]] = {r: {} for r in VIDEO}
    for event in of_job(events, job_id, "CheckpointRecorded"):
        if event.rendition in recorded:
            recorded[event.rendition][event.segment_index] = event
    p = prefix_length({r: set(found) for r, found in recorded.items()})
    assert 3 <= p < 8, p
    attempt_1 = next(e for e in of_job(events, job_id, "AttemptStarted") if e.stage == "transcode" and e.attempt == 1)

    # The zombie: objects that hold real segment bytes and checkpoints that name them with their
    # true sha256, under attempt 1's claim token, for segment P of every rendition.
    store, codec = ObjectStore(fault_settings), default_codec()
    producer = kafka.idempotent_producer(fault_settings)
    partition = kafka.partition_for(job_id, kafka.partition_count(producer, fault_settings.jobs_topic))
    zombie_keys = set()
    for i, rendition in enumerate(VIDEO):
        before = recorded[rendition][p - 1]
        body = store.get_bytes(before.object_key)
        key = f"work/{job_id}/transcode/1/{rendition}/seg_{p:05d}.ts"
        store.s3.put_object(Bucket=store.bucket, Key=key, Body=body, ContentType="video/mp2t")
        zombie_keys.add(key)
        late = ev.CheckpointRecorded.new(system_clock.stamp(), 
            job_id=job_id, stage="transcode", attempt=1, claim_token=attempt_1.claim_token,
            recorded_by="zombie@test", correlation_id=attempt_1.correlation_id, sequence=1000 + i,
            segment_index=p, rendition=rendition, object_key=key, sha256=hashlib.sha256(body).hexdigest(),
            frames=before.frames, media_start_s=before.media_start_s + before.media_duration_s,
            media_duration_s=before.media_duration_s)
        producer.produce(fault_settings.jobs_topic, key=job_id.encode(), value=codec.encode(late.to_record()),
                         partition=partition)
    assert producer.flush(30) == 0

    os.killpg(second.pid, signal.SIGKILL)
    roles.start("transcode")
    wait_state(fault_settings, job_id)
    events = assert_completed_once(fault_settings, job_id)
    assert [(s.kind, s.stalled_attempt) for s in of_job(events, job_id, "StallDetected")] == \
        [("lease_expired", 1), ("lease_expired", 2)]

    # The late checkpoints are evidence only: superseded, never applied.
    with psycopg.connect(fault_settings.database_url) as conn:
        flags = conn.execute("SELECT payload->>'rendition', applied, superseded FROM lifecycle_evidence "
                             "WHERE job_id = %s AND recorded_by = 'zombie@test' ORDER BY 1", (job_id,)).fetchall()
    assert flags == [(r, False, True) for r in sorted(VIDEO)]

    # Attempt 3 trusted none of them: it encoded segment P onwards in every rendition itself.
    third = checkpoints_of_attempt(fault_settings, job_id, 3)
    for rendition in VIDEO:
        assert sorted(third[rendition]) == list(range(p, 8)), rendition
    succeeded = [e for e in of_job(events, job_id, "AttemptSucceeded") if e.stage == "transcode"]
    assert [e.attempt for e in succeeded] == [3]
    keys = {o.key for o in succeeded[0].outputs}
    assert not keys & zombie_keys
    for rendition in VIDEO:
        assert f"work/{job_id}/transcode/3/{rendition}/seg_{p:05d}.ts" in keys

    source_frames = video_frames(str(long_video))
    for rendition in of_job(events, job_id, "Published")[0].renditions:
        assert video_frames(rendition.url) == source_frames, rendition.name

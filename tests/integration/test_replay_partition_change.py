"""A log whose job has events in two partitions (the lifecycle topic's partition count changed under
a running system): replay workers, which split the log by partition, must refuse it rather than each
fold part of the job."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from processors.runtime import transact
from cli.wiring import build_runtime
from tests.conftest import tapeline_cli
from tests.integration.test_projector import lifecycle

pytestmark = pytest.mark.integration


def test_a_job_split_across_partitions_rolls_back_a_replay_with_workers_and_one_process_replays_it(isolated):
    accepted, queued = lifecycle(f"u-{uuid.uuid4()}")[:2]
    job_id = accepted.job_id
    runtime = build_runtime(isolated, "test")
    producer = runtime.events.transactional_producer(f"{isolated.app_name}.split-writer")
    try:  # JobAccepted in partition 0, its StageQueued in partition 1
        transact(producer, lambda: [runtime.produce_to(producer, isolated.jobs_topic, 0, accepted),
                                    runtime.produce_to(producer, isolated.jobs_topic, 1, queued)])
    finally:
        runtime.close()

    refused = tapeline_cli(isolated, "replay", "--into", "split", "--workers", "2")
    assert refused.returncode == 1, refused.stderr
    assert "have events in partitions read by different workers" in refused.stderr
    assert job_id in refused.stderr and "--workers 1" in refused.stderr
    with psycopg.connect(isolated.database_url) as conn:
        assert conn.execute("SELECT (SELECT count(*) FROM split.lifecycle_evidence) + "
                            "(SELECT count(*) FROM split.job_state) + "
                            "(SELECT count(*) FROM split.projector_offsets)").fetchone()[0] == 0

    redone = tapeline_cli(isolated, "replay", "--into", "split", "--workers", "1", "--force")
    assert redone.returncode == 0, redone.stderr
    with psycopg.connect(isolated.database_url) as conn:
        assert conn.execute("SELECT count(*) FROM split.lifecycle_evidence WHERE job_id = %s",
                            (job_id,)).fetchone()[0] == 2
        assert conn.execute("SELECT count(*) FROM split.job_state WHERE job_id = %s", (job_id,)).fetchone()[0] == 1

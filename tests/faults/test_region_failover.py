"""The region failover drill (issue 25 item 7), once: `bench/failover.py`'s round with three jobs.

Two complete regions of their own on free ports (region A: a Kafka node, its own PostgreSQL server,
an S3 endpoint and `tapeline run --role all`; region B: `tapeline stack up --region b` with
MirrorMaker 2 and the media replicator), a provider that does not dedupe posts; one job completes
in A, one is publishing (its post made at the provider, which answers slowly), one is transcoding (with
checkpoints) when every process of region A is
killed with SIGKILL (processors, Kafka, the PostgreSQL postmaster and its backends, the S3
endpoint); then `tapeline region failover --to b --why ... --json` as a user runs it.

Asserted: region B accepts uploads within 60 s of the command; every job ends in B exactly once
(one JobCompleted, one post at the provider, one output set: `devstack.chaos.audit`) or is held for
review; the attempt running in A is queued again as a `region_lost` stall that used no attempt;
the first resumed attempt starts after the command; and once region A's services come back, its
old `tapeline run --role all` exits 3 saying it is fenced and adds nothing to A's log.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from bench.failover import drill

pytestmark = pytest.mark.integration


def test_failover_drill_finishes_every_job_once_and_fences_region_a() -> None:
    work = Path(tempfile.mkdtemp(prefix="test-region-failover-"))
    work.chmod(0o755)  # each region's PostgreSQL server runs as `postgres` under it
    try:
        result = drill(work, jobs=3, seed=7)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"drill: accepting {result.accepting_s:.1f} s, first resumed {result.resumed_first_s:.1f} s, all done "
          f"{result.all_done_s:.1f} s, rpo {result.rpo_events} events / {result.rpo_s:.1f} s, re-encoded "
          f"{result.reencoded_s:.1f} s, stages at the kill {result.stages_at_kill}, steps {result.failover['steps_s']}")
    assert result.violations == [], result.violations
    assert (result.duplicates, result.lost) == (0, 0)
    assert result.accepting_s <= 60.0
    assert result.failover["from_region"] == "a" and result.failover["epoch"] == 1
    assert result.failover["planned"] is False  # region A did not answer: nothing was drained or written there
    assert all(posts <= 1 for posts in result.posts_per_job.values()), result.posts_per_job
    assert sum(result.posts_per_job.values()) + result.needs_review >= len(result.posts_per_job) - result.uploads_lost
    assert "completed/publish" in result.stages_at_kill.values()  # the drill's first job ended in A
    # One job's publish was in flight: its post made at the provider, the answer not yet back. Region B's
    # attempt found it by its idempotency key (the claim marker stayed in A's store) and did not post again.
    assert "running/publish" in result.stages_at_kill.values(), result.stages_at_kill
    unfinished = {job for job, stage in result.stages_at_kill.items() if not stage.startswith("completed/")}
    assert {a["job_id"] for a in result.lost_attempts} <= unfinished  # only what ran in A was lost with it
    assert all(yields >= 1 for yields in result.lost_yields.values()), result.lost_yields  # given back
    assert 0 < result.resumed_first_s < 120
    assert result.new_upload_state == "completed"  # region B took a new upload at once and finished it
    assert result.fence_held, result.fence_message
    assert "region a is fenced: region b took over" in result.fence_message

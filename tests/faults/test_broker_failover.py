"""A replicated log under a running pipeline (issue 24): a real three-node KRaft cluster (three
combined broker+controller JVMs from the stack's pinned jars, replication factor 3,
min.insync.replicas 2), shared by this module's tests, and the whole pipeline as real processes
on it. A node is killed with SIGKILL and started again; every job must end once (one
`JobCompleted`, one output set, one post at a provider that does not dedupe), the projection must
equal a fold of the log, and the pause the outage caused is measured and printed.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import Iterator

import psycopg
import pytest
from confluent_kafka.admin import AdminClient

from domain import events as ev
from tapeline import stack
from tapeline.chaos import ProviderProcess, audit, committed_messages
from domain.codec import default_codec
from tapeline.settings import Settings
from tests.conftest import Pipeline, isolated_settings, own_database, wait_for
from tests.faults.conftest import FAULT_TIMING
from tests.faults.test_worker_faults import submit
from tests.integration.roles import tiny_clips

pytestmark = pytest.mark.integration

CLUSTER_TIMING = {**FAULT_TIMING, "lease_s": 30.0, "heartbeat_interval_s": 1.0, "no_progress_timeout_s": 30.0,
                  "handoff_timeout_s": 45.0, "intake_timeout_s": 60.0, "transaction_timeout_ms": 15_000,
                  "kafka_session_timeout_ms": 6000}
"""The fault timings with every stall allowance longer than a leader election: the controller fences
a dead broker after broker.session.timeout.ms (Kafka's default, 9 s) and only then elects new
leaders, about 12 s in all here. With this module's allowances (and with the defaults, 120 s), an
election must neither cost an attempt nor be reported as a stall; with a handoff timeout shorter
than an election, queued work whose partition had no leader would be re-driven (a `handoff`
stall, which costs no attempt)."""


KNOWN = ("known, open (issue 24 item 2; docs/operating.md 'A replicated Kafka'): in about 3 runs of 20 on a "
         "loaded machine a worker's heartbeats did not land for a whole lease after the election, or the jobs had "
         "not ended 300 s after the node returned")
"""Why this module's kill test may end as an expected failure: only these two outcomes; a duplicate,
a lost job or a projection that differs from the log fails it."""


def _free_base_port() -> int:
    """A port p with p .. p+5 free on 127.0.0.1 (three brokers and three controllers, `Settings.kafka_nodes`),
    from a random start (two runs of this module at once pick different blocks)."""
    import random

    start = random.randrange(29100, 29900, 10)
    for base in [*range(start, 29900, 10), *range(29100, start, 10)]:
        ok = True
        for port in range(base, base + 6):
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free block of six ports between 29100 and 29900")


@pytest.fixture(scope="module")
def cluster(base_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """Settings of a fresh three-node cluster (its own home, ports and data) with this module's topics
    and database; PostgreSQL and S3 are the shared ones. The cluster is stopped at the end."""
    base = _free_base_port()
    tag = uuid.uuid4().hex[:8]
    with own_database(base_settings, tag) as url:
        settings = isolated_settings(base_settings, tag, url, home=tmp_path_factory.mktemp("cluster3"),
                                     kafka_bootstrap=f"127.0.0.1:{base}", kafka_controller_port=base + 1,
                                     kafka_brokers=3)
        try:
            stack.up(settings)
            yield settings
        finally:
            stack.down(settings)


def _leaders(settings: Settings, topic: str) -> dict[int, int]:
    """partition -> the node id leading it (-1: none)."""
    admin = AdminClient({"bootstrap.servers": settings.kafka_bootstrap_servers})
    return {p: meta.leader for p, meta in admin.list_topics(topic, timeout=10).topics[topic].partitions.items()}


def _node_pid(settings: Settings, node_id: int) -> int:
    report = stack.status(settings)["kafka"]
    return next(n["pid"] for n in report["nodes"] if n["node_id"] == node_id)


def _restart(settings: Settings, node_id: int) -> None:
    paths = stack.StackPaths(Path(settings.home).resolve())
    nodes = stack.kafka_nodes(settings, paths)
    stack.start_kafka_node(settings, paths, next(n for n in nodes if n.node_id == node_id), nodes)


def _lifecycle_gaps(settings: Settings, after: float) -> float:
    """The longest gap, seconds, between consecutive lifecycle records (broker time, any partition)
    from `after` (epoch seconds) on: how long the pipeline wrote nothing."""
    stamps = sorted(m.timestamp()[1] / 1000 for m in committed_messages(settings, timeout_s=60)
                    if m.timestamp()[1] / 1000 >= after)
    return max((b - a for a, b in zip(stamps, stamps[1:])), default=0.0)


def test_the_cluster_replicates_every_topic_three_times(cluster):
    report = stack.status(cluster)["kafka"]
    assert [n["up"] for n in report["nodes"]] == [True, True, True]
    assert report["brokers_registered"] == [1, 2, 3]
    assert report["quorum"]["leader"] in (1, 2, 3) and report["quorum"]["voters"] == [1, 2, 3]
    admin = AdminClient({"bootstrap.servers": cluster.kafka_bootstrap_servers})
    topics = admin.list_topics(timeout=10).topics
    for topic in cluster.all_topics():
        assert all(len(p.replicas) == 3 and len(p.isrs) == 3 for p in topics[topic].partitions.values()), topic


def test_killing_the_lifecycle_leader_mid_run_loses_and_duplicates_nothing(cluster, tmp_path):
    provider = ProviderProcess(tmp_path)
    settings = cluster.model_copy(update={**CLUSTER_TIMING, "webhook_url": provider.url,
                                          "app_name": f"{cluster.app_name}-{uuid.uuid4().hex[:6]}"})
    pipeline = Pipeline(settings, tmp_path / "run.log").start()
    try:
        clips = tiny_clips(tmp_path, 6, seconds=4.0, size="320x180")
        jobs = {submit(settings, clip): f"clip{i}" for i, clip in enumerate(clips)}
        # Kill the node leading most lifecycle partitions once the first job is transcoding.
        wait_for(lambda: any(m for m in committed_messages(settings, timeout_s=30)
                             if ev.Event.from_record(default_codec().decode(m.value())).event_type == "AttemptStarted"),
                 120, "a transcode attempt to start")
        leaders = _leaders(settings, settings.jobs_topic)
        victim = max(set(leaders.values()), key=list(leaders.values()).count)
        pid = _node_pid(settings, victim)
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: victim not in _leaders(settings, settings.jobs_topic).values(), 60,
                 f"new leaders for the partitions node {victim} led")
        elected_s = time.time() - killed_at
        time.sleep(3)
        _restart(settings, victim)
        try:
            wait_for(lambda: all(_state(settings, j) in ("completed", "dead_lettered", "needs_review") for j in jobs),
                     300, "every job to end")
        except pytest.fail.Exception:
            pytest.xfail(f"{KNOWN}: jobs not ended 300 s after the node returned")
        finally:
            print("job states:", {label: _state(settings, j) for j, label in jobs.items()},
                  "kafka:", {k: v for k, v in stack.status(settings)["kafka"].items() if k != "nodes"})
        pause_s = _lifecycle_gaps(settings, killed_at - 1)
        result = audit(settings, jobs, provider.posts())
        stalls = [e for m in committed_messages(settings)
                  if isinstance(e := ev.Event.from_record(default_codec().decode(m.value())), ev.StallDetected)]
        print(f"node {victim} killed: leaders moved after {elected_s:.1f} s; longest lifecycle gap {pause_s:.1f} s; "
              f"{result.completed}/{result.jobs} completed, duplicates {result.duplicates}, lost {result.lost}, "
              f"stalls {[(s.kind, s.detail) for s in stalls]}")
        assert result.violations == [] and result.duplicates == 0 and result.lost == 0
        assert result.completed == len(jobs)
        if stalls:
            pytest.xfail(f"{KNOWN}: the outage cost a stall: {[(s.kind, s.detail) for s in stalls]}")
    finally:
        pipeline.stop()
        provider.stop()
        print(pipeline.log_text()[-5000:])


def _state(settings: Settings, job_id: str) -> str | None:
    with psycopg.connect(settings.database_url) as conn:
        row = conn.execute("SELECT state FROM job_state WHERE job_id = %s", (job_id,)).fetchone()
    return row[0] if row else None

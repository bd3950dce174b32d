"""Broker faults on a local multi-node cluster (`tapeline stack up --brokers 3`), for the fault tests
and `bench/broker_failover.py`: which node leads what, kill or stop a node, start it again, and how
long the lifecycle log went without a write.

Nothing here runs in production; it drives the stack's own Kafka processes (their pids come from
`stack status`) with real signals.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import time
from pathlib import Path

from tapeline.kafka import admin_client

import devstack as stack
from tapeline.settings import Settings

CLUSTER_TIMING = {"lease_s": 30.0, "heartbeat_interval_s": 1.0, "no_progress_timeout_s": 30.0,
                  "handoff_timeout_s": 120.0, "intake_timeout_s": 120.0, "tick_interval_s": 0.5,
                  "caught_up_timeout_s": 20.0, "x264_preset": "ultrafast", "transaction_timeout_ms": 15_000,
                  "kafka_session_timeout_ms": 6000, "webhook_timeout_s": 3.0}
"""Seconds, for pipelines on a cluster whose nodes are killed: short enough that a test sees a real
stall soon, with every stall allowance longer than a leader election. The controller fences a dead
broker after `broker.session.timeout.ms` (Kafka's default, 9 s) and only then elects new leaders,
about 12 s in all here. The lease (30 s) and the no-progress timeout are four times shorter than
the defaults and still longer than an election, so an attempt must ride through one without a
stall. The handoff and intake timeouts keep their defaults (120 s): they are reports that cost no
attempt, and on this 2-core machine a killed node plus a busy pipeline delayed the intake of a
queue of uploads by more than 60 s (the intake waits for its writer and the projection), which a
60 s intake timeout reported as `expected_work_missing`. The transaction timeout (15 s) is
about an election: a transaction open when its partition's leader dies is aborted cleanly by the
client at 2/3 of it and written again (docs/design.md "Kafka errors: retried, aborted, fenced")."""


def free_port_block(size: int = 6, low: int = 29100, high: int = 29900) -> int:
    """A port p with p .. p+size-1 free on 127.0.0.1 (three brokers and three controllers need six,
    `Settings.kafka_nodes`), searched in steps of 10 from a random start so two runs at once pick
    different blocks. Raises `RuntimeError` when none is free."""
    start = random.randrange(low, high, 10)
    for base in [*range(start, high, 10), *range(low, start, 10)]:
        if all(_free(port) for port in range(base, base + size)):
            return base
    raise RuntimeError(f"no free block of {size} ports between {low} and {high}")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def partition_leaders(settings: Settings, topic: str, timeout_s: float = 10.0) -> dict[int, int]:
    """partition -> the node id leading it (-1: no leader), from the cluster's metadata."""
    admin = admin_client(settings)
    metadata = admin.list_topics(topic, timeout=timeout_s).topics[topic]
    return {p: meta.leader for p, meta in metadata.partitions.items()}


def busiest_leader(settings: Settings, topic: str) -> int:
    """The node id leading most partitions of `topic` (the lowest id on a tie)."""
    leaders = list(partition_leaders(settings, topic).values())
    return max(sorted(set(leaders) - {-1}), key=leaders.count)


def active_controller(settings: Settings) -> int:
    """The node id of the controller quorum's leader (`stack status` `quorum.leader`). Raises
    `RuntimeError` when no node has recorded one."""
    leader = stack.status(settings)["kafka"]["quorum"]["leader"]
    if leader is None:
        raise RuntimeError("no controller quorum leader recorded by any node")
    return int(leader)


def node_pid(settings: Settings, node_id: int) -> int | None:
    """The pid of the stack's process for node `node_id`, or None when it does not run."""
    report = stack.status(settings)["kafka"]
    return next((n["pid"] for n in report["nodes"] if n["node_id"] == node_id), None)


def signal_node(settings: Settings, node_id: int, signum: int = signal.SIGKILL) -> float:
    """Send `signum` to node `node_id`'s JVM; returns the epoch seconds it was sent at. SIGKILL is a
    crash (no controlled shutdown), SIGTERM a clean stop. Raises `RuntimeError` when the node does
    not run."""
    pid = node_pid(settings, node_id)
    if pid is None:
        raise RuntimeError(f"kafka node {node_id} does not run")
    sent_at = time.time()
    os.kill(pid, signum)
    return sent_at


def wait_node_exited(settings: Settings, node_id: int, timeout_s: float = 60.0) -> None:
    """Wait until node `node_id`'s process is gone. Raises `TimeoutError` after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while node_pid(settings, node_id) is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"kafka node {node_id} still runs {timeout_s:.0f} s after it was told to stop")
        time.sleep(0.2)


def start_node(settings: Settings, node_id: int) -> None:
    """Start node `node_id` again with its data (`stack.start_kafka_node`); returns once it is spawned
    (it rejoins the cluster within seconds)."""
    paths = stack.HomePaths(Path(settings.home).resolve())
    nodes = stack.kafka_nodes(settings, paths)
    stack.start_kafka_node(settings, paths, next(n for n in nodes if n.node_id == node_id), nodes)


def wait_not_leading(settings: Settings, topic: str, node_id: int, timeout_s: float = 60.0) -> float:
    """Wait until node `node_id` leads no partition of `topic` and every partition has a leader;
    returns the seconds waited. Raises `TimeoutError` after `timeout_s` seconds."""
    started = time.monotonic()
    while True:
        try:
            leaders = partition_leaders(settings, topic, timeout_s=5.0)
        except Exception:  # the metadata request itself failed over: ask again
            leaders = {0: -1}
        if node_id not in leaders.values() and -1 not in leaders.values():
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"node {node_id} still leads (or a partition has no leader) in {topic}: {leaders}")
        time.sleep(0.2)


def wait_in_sync(settings: Settings, timeout_s: float = 120.0) -> float:
    """Wait until the cluster reports no under-replicated partition; returns the seconds waited.
    Raises `TimeoutError` after `timeout_s` seconds."""
    started = time.monotonic()
    while stack.status(settings)["kafka"].get("under_replicated_partitions") != 0:
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"partitions still under-replicated after {timeout_s:.0f} s")
        time.sleep(0.5)
    return time.monotonic() - started


def longest_gap(stamps: list[float], since: float, until: float) -> float:
    """The longest stretch, seconds, in [since, until] without a lifecycle write: `since` is a
    fault's moment; the watchdog ticks every partition each `Settings.tick_s`, so on a healthy
    pipeline no gap is much longer than that, busy or idle. The stretch after the last stamp
    counts up to `until`."""
    inside = [since, *[t for t in stamps if since <= t <= until], until]
    return max(b - a for a, b in zip(inside, inside[1:]))

"""Broker failover benchmark: jobs through the whole pipeline on a three-node Kafka cluster while the
node leading most lifecycle partitions is killed (SIGKILL) at a random moment, several times.

A fresh cluster (`tapeline stack up --brokers 3` in a home of its own, on free ports, replication
factor 3, min.insync.replicas 2) is started beside the shared stack (PostgreSQL and S3 are the shared
ones), with `tapeline run --role all` on it and a provider that does NOT dedupe posts. Each round
submits `--jobs` jobs, waits a random 1-8 s (the jobs are then probing, transcoding or publishing),
kills the busiest lifecycle leader, waits for Kafka to elect new leaders, starts the node again 3 s
later and waits until every job of the round has ended and every partition is in sync again.

Per kill it measures: `elect_s`, seconds from the kill until the metadata shows a leader for every
lifecycle partition and none on the dead node (polled every 0.2 s: Kafka's own part, which the
controller bounds by `broker.session.timeout.ms`, 9 s by default, plus the election); `pause_s`, the
longest stretch from the kill on without a committed lifecycle record (the watchdog ticks every
partition each `tick_s`, so a healthy pipeline never goes longer than that). At the end
`devstack.chaos.audit` checks every job (ended once, one post, one output set, projection equal to
a fold of the log), and the log gives the attempts that started but did not succeed (`attempts_lost`)
and the `StallDetected` events.

Usage: python bench/broker_failover.py [--kills 3] [--jobs 4] [--seed 1] [--keep] [--smoke]
                                      [--cluster HOME BOOTSTRAP CONTROLLER_PORT]
(`--smoke`: one kill with two jobs, for `bench/run.py --smoke`; `--cluster`: use a running three-node
cluster started by `tapeline stack up --brokers 3` with that home and ports, and leave it running
with every node up and in sync: `tests/faults/test_broker_failover.py` runs the smoke on its module's
cluster so the suite starts one three-node cluster, not two.)
Prints the figures and ends with one line
`RESULT kills=... pause_median_s=... pause_max_s=... elect_median_s=... elect_max_s=... attempts_lost=...
stalls=... duplicates=... lost=...`.
Goal: pause_max_s <= elect_max_s + heartbeat_interval_s, duplicates 0, lost 0.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_settings, drop_bench_database  # noqa: E402
from bench.stall_latency import env_for  # noqa: E402
from domain import events as ev  # noqa: E402
from domain.codec import default_codec  # noqa: E402
from producers.submit import publish, upload  # noqa: E402
from devstack import broker_faults as faults  # noqa: E402
import devstack as stack  # noqa: E402
from domain.lifecycle import TERMINAL_STATES  # noqa: E402
from devstack.chaos import ProviderProcess, audit, committed_messages  # noqa: E402
from tapeline.samples import sample_video  # noqa: E402
from tapeline.settings import Settings  # noqa: E402

ROUND_TIMEOUT_S = 300.0
"""How long the jobs of one round may take to end after the node is back before the round is
reported stuck (the run then dumps every processor's stacks into its log and stops)."""


def job_states(settings: Settings, job_ids: list[str]) -> dict[str, str]:
    import psycopg

    with psycopg.connect(settings.database_url) as conn:
        return dict(conn.execute("SELECT job_id, state FROM job_state WHERE job_id = ANY(%s)", (job_ids,)).fetchall())


def wait_ended(settings: Settings, job_ids: list[str], timeout_s: float) -> bool:
    """Whether every job of `job_ids` reached an ending state within `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = job_states(settings, job_ids)
        if len(seen) == len(job_ids) and all(state in TERMINAL_STATES for state in seen.values()):
            return True
        time.sleep(0.5)
    return False


def dump_stacks(supervisor_pid: int) -> None:
    """SIGUSR1 every processor child: each writes its threads' stacks to the run log."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == supervisor_pid:
                    os.kill(int(entry.name), signal.SIGUSR1)
            except (OSError, ValueError):
                continue


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3, help="rounds, one leader kill each")
    parser.add_argument("--jobs", type=int, default=4, help="jobs submitted per round")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the processors' log (run.log) and the cluster's files")
    parser.add_argument("--smoke", action="store_true", help="tiny run: --kills 1 --jobs 2")
    parser.add_argument("--cluster", nargs=3, metavar=("HOME", "BOOTSTRAP", "CONTROLLER_PORT"),
                        help="a running three-node cluster to use (and leave running) instead of a fresh one")
    args = parser.parse_args()
    if args.smoke:
        args.kills, args.jobs = 1, 2
    random.seed(args.seed)

    work = Path(tempfile.mkdtemp(prefix="bench-broker-failover-"))
    if args.cluster:
        home, bootstrap, controller_port = args.cluster
        cluster = {"home": Path(home), "kafka_bootstrap": bootstrap, "kafka_controller_port": int(controller_port),
                   "kafka_brokers": 3}
    else:
        port = faults.free_port_block()
        cluster = {"home": work / "cluster", "kafka_bootstrap": f"127.0.0.1:{port}", "kafka_controller_port": port + 1,
                   "kafka_brokers": 3}
    cluster_settings = Settings().model_copy(update=cluster)
    stop_cluster = (lambda: None) if args.cluster else (lambda: stack.down(cluster_settings))
    provider = ProviderProcess(work)
    pipeline = None
    try:
        if not args.cluster:
            stack.up(cluster_settings)
        settings = bench_settings("brokerfail", **cluster, **faults.CLUSTER_TIMING, webhook_url=provider.url,
                                  webhook_dedupes=False)
    except BaseException:
        provider.stop()
        stop_cluster()
        raise
    log_path = work / "run.log"
    log = open(log_path, "ab")
    pipeline = subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--role", "all"], env=env_for(settings),
                                stdout=log, stderr=log, start_new_session=True)
    clip = sample_video("carphone_pristine.mp4")
    jobs: dict[str, str] = {}
    kills: list[dict[str, float]] = []
    stuck = False
    started = time.monotonic()
    try:
        for round_number in range(args.kills):
            wave = []
            for _ in range(args.jobs):
                submission = upload(settings, clip)
                publish(settings, submission.event)
                wave.append(submission.job_id)
                jobs[submission.job_id] = f"round-{round_number}"
            time.sleep(random.uniform(1.0, 8.0))
            victim = faults.busiest_leader(settings, settings.jobs_topic)
            killed_at = faults.signal_node(settings, victim, signal.SIGKILL)
            elect_s = faults.wait_not_leading(settings, settings.jobs_topic, victim, timeout_s=90)
            time.sleep(3)
            faults.start_node(settings, victim)
            if not wait_ended(settings, wave, ROUND_TIMEOUT_S):
                stuck = True
                print(f"round {round_number}: jobs not ended {ROUND_TIMEOUT_S:.0f} s after the kill: "
                      f"{job_states(settings, wave)}; stacks dumped into {log_path}", flush=True)
                dump_stacks(pipeline.pid)
                time.sleep(2)
                break
            ended_at = time.time()
            in_sync_s = faults.wait_in_sync(settings)
            kills.append({"node": victim, "at": killed_at, "until": ended_at, "elect_s": elect_s})
            print(f"round {round_number}: node {victim} killed, leaders moved after {elect_s:.1f} s, "
                  f"jobs ended {ended_at - killed_at:.1f} s after the kill, in sync {in_sync_s:.1f} s later",
                  flush=True)
    finally:
        os.killpg(pipeline.pid, signal.SIGTERM)
        try:
            pipeline.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(pipeline.pid, signal.SIGKILL)
        log.close()
        posts = provider.posts()
        provider.stop()
    elapsed = time.monotonic() - started
    try:
        result = audit(settings, jobs, posts)
        codec = default_codec()
        messages = committed_messages(settings)
        events = [ev.Event.from_record(codec.decode(m.value())) for m in messages]
        stamps = sorted(m.timestamp()[1] / 1000 for m in messages)
    finally:
        drop_bench_database(settings)
        stop_cluster()
    for kill in kills:
        kill["pause_s"] = faults.longest_gap(stamps, kill["at"], kill["until"])
        print(f"node {kill['node']:.0f}: elect {kill['elect_s']:.1f} s, pause {kill['pause_s']:.1f} s")
    started_attempts = sum(isinstance(e, ev.AttemptStarted) for e in events)
    succeeded = sum(isinstance(e, ev.AttemptSucceeded) for e in events)
    stalls = [e for e in events if isinstance(e, ev.StallDetected)]
    pauses, elects = [k["pause_s"] for k in kills] or [float("nan")], [k["elect_s"] for k in kills] or [float("nan")]
    print(f"\n{len(kills)} kills in {elapsed:.0f} s; jobs {result.jobs}, completed {result.completed}, "
          f"needs_review {len(result.needs_review)}, dead_lettered {len(result.dead_lettered)}")
    print(f"attempts started {started_attempts}, succeeded {succeeded}; stalls {[(s.kind, s.detail) for s in stalls]}")
    print(f"duplicates: {result.duplicates}, lost: {result.lost}; heartbeat interval "
          f"{settings.heartbeat_interval_s:g} s, tick {settings.tick_s:g} s")
    for line in result.violations:
        print("VIOLATION", line)
    if stuck or args.keep:
        print(f"kept: {work} (the processors' log: {log_path})")
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(f"RESULT kills={len(kills)} pause_median_s={statistics.median(pauses):.1f} pause_max_s={max(pauses):.1f} "
          f"elect_median_s={statistics.median(elects):.1f} elect_max_s={max(elects):.1f} "
          f"attempts_lost={started_attempts - succeeded} stalls={len(stalls)} "
          f"duplicates={result.duplicates} lost={result.lost}")
    return 0 if result.duplicates == 0 and result.lost == 0 and not stuck else 1


if __name__ == "__main__":
    sys.exit(main())

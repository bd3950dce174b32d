"""Network partitions benchmark: processors on test hosts (Linux network namespaces,
`devstack.netns`) across real link faults, as `tests/faults/test_network_partitions.py`
checks them, measured over several rounds.

Needs root (`ip netns`). Layout: this benchmark's own one-node KRaft broker bound to the service
address 10.250.k.1 in the root namespace, forwarders from that address to the shared PostgreSQL and
S3, the projector, intake, thumbnails and publish in the root namespace, a transcode worker on each
of hosts `w1` and `w2`, the leading watchdog on host `ops1` and a standby on `ops2`.

Each round: (1) submits a job and, once its attempt has checkpointed a segment (mid-transcode),
cuts the link of the worker host that claimed it (processes stay alive) until the other host's worker has started the next attempt, then heals it; (2) shapes both
worker links slow and lossy (`Topology.shape`, 4 Mbit/s, packets queued over 200 ms dropped) and
flaps them (1.5 s down every 6 s) while `--jobs` jobs run; (3) cuts the leading watchdog's host and
measures `takeover_s`, from the cut to the first committed tick of the other watchdog (the leader
lock then goes to the other ops host; the next round cuts that one).

At the end every job is checked on the log: one `JobCompleted` (`duplicates` counts extra ones and
published objects outside the one output set), none unfinished (`lost`), and `false_stalls` counts
`StallDetected` events of the slow-link jobs that the log's timings do not justify
(`devstack/link_faults.py` `justified`, the rule the test applies).

Usage: python bench/partitions.py [--rounds 3] [--jobs 2] [--smoke]   (`--smoke`: one round, one job)
Ends with one line `RESULT partitions=... takeover_s=... takeover_max_s=... duplicates=0 lost=0 false_stalls=...`
(`partitions`: links cut, the flaps not counted; `takeover_s`: the median).
Goal: duplicates 0, lost 0, false_stalls 0, takeover_max_s within the bound the test states.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg  # noqa: E402
from psycopg.conninfo import conninfo_to_dict  # noqa: E402

import devstack as stack  # noqa: E402
from bench.stall_latency import env_for  # noqa: E402
from devstack import broker_faults  # noqa: E402
from devstack.chaos import keys_under  # noqa: E402
from devstack.link_faults import PARTITION_TIMING, stamped  # noqa: E402
from devstack.link_faults import false_stalls as unjustified  # noqa: E402
from devstack.netns import Topology, unavailable  # noqa: E402
from devstack.tcp_proxy import TcpForwarder  # noqa: E402
from domain import events as ev  # noqa: E402
from domain.pipeline import STAGE_NAMES  # noqa: E402
from producers.submit import publish, upload  # noqa: E402
from tapeline.postgres import migrate  # noqa: E402
from tapeline.samples import sample_video  # noqa: E402
from tapeline.settings import Settings  # noqa: E402

JOB_TIMEOUT_S = 300.0


def wait(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout_s:.0f} s")
        time.sleep(0.3)
    return value


def state(settings: Settings, job_id: str) -> str | None:
    with psycopg.connect(settings.database_url) as conn:
        row = conn.execute("SELECT state FROM job_state WHERE job_id = %s", (job_id,)).fetchone()
    return row[0] if row else None


def clip(directory: Path, seconds: float, n: int, full_size: bool = False) -> Path:
    """A distinct clip (its own sha256) of `seconds` of the sample looped (it is 5.3 s long), at
    640x360, or with `full_size` its own 1280x720 stream copied (the test's long video: a transcode
    that runs long enough to be cut mid-way)."""
    path = directory / f"clip-{n}.mp4"
    encode = ["-c", "copy"] if full_size else ["-vf", "scale=640:360", "-c:v", "libx264", "-preset", "ultrafast",
                                                "-c:a", "aac"]
    subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-stream_loop", "-1", "-i", str(sample_video()),
                    "-t", f"{seconds:g}", "-metadata", f"comment={uuid.uuid4().hex}", *encode, "-y", str(path)],
                   check=True, timeout=120)
    return path


def submit(settings: Settings, path: Path) -> str:
    submission = upload(settings, path)
    publish(settings, submission.event)
    return submission.job_id


def explain(settings: Settings, job_id: str, work: Path) -> None:
    """Print what the log holds of `job_id` and the watchdogs' and workers' last log lines: a step
    that timed out says why."""
    print(f"job {job_id} on the log:")
    for at, e in stamped(settings):
        if e.job_id == job_id:
            print(f"  {at:.1f} {e.event_type} {e.stage} attempt={e.attempt} "
                  f"{getattr(e, 'kind', '') or ''} {getattr(e, 'worker', '') or ''}")
    for log in sorted(work.glob("watchdog-*.log")) + sorted(work.glob("transcode-*.log")):
        print(f"--- {log.name}")
        print("\n".join(log.read_text(errors="replace").splitlines()[-15:]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2, help="jobs on the slow, lossy links per round")
    parser.add_argument("--smoke", action="store_true", help="tiny run: --rounds 1 --jobs 1")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.jobs = 1, 1
    if (reason := unavailable()) is not None:
        print(f"bench/partitions.py makes network namespaces (ip netns): {reason}")
        return 2
    base = Settings()
    work = Path(tempfile.mkdtemp(prefix="bench-partitions-"))
    topology = Topology(("w1", "w2", "ops1", "ops2")).open()
    forwarders: list[TcpForwarder] = []
    processes: list[subprocess.Popen] = []
    tag = uuid.uuid4().hex[:8]
    dbname = f"bench_partitions_{tag}"
    settings = None
    try:
        svc = topology.service
        pg = conninfo_to_dict(base.database_url)
        pg_port, s3_port = int(pg.get("port", 5432)), int(base.s3_endpoint.rsplit(":", 1)[1].strip("/"))
        forwarders += [TcpForwarder((svc, pg_port), ("127.0.0.1", pg_port)).start(),
                       TcpForwarder((svc, s3_port), ("127.0.0.1", s3_port)).start()]
        with psycopg.connect(base.database_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{dbname}"')
        port = broker_faults.free_port_block(size=2)
        settings = base.model_copy(update={
            "topic_prefix": f"partitions{tag}", "app_name": f"bench-partitions-{tag}", "jobs_partitions": 3,
            "work_partitions": 2, "uploads_partitions": 2, "reuse_results": False, "cleanup_orphans": False,
            "database_url": f"postgresql://{pg['user']}:{pg['password']}@{svc}:{pg_port}/{dbname}",
            "s3_endpoint": f"http://{svc}:{s3_port}", "home": work / "stack", "kafka_bootstrap": f"{svc}:{port}",
            "kafka_controller_port": port + 1, "kafka_brokers": 1, **PARTITION_TIMING})
        migrate(settings.database_url, settings.db_schema, settings.reader_role)
        stack.up(settings)

        def start(role: str, host: str | None) -> subprocess.Popen:
            log = open(work / f"{role}-{host or 'services'}-{len(processes)}.log", "ab")
            wrap = topology.hosts[host].wrap() if host else []
            process = subprocess.Popen([*wrap, sys.executable, "-m", "cli.main", "run", "--role", role],
                                       env={**env_for(settings), "TAPELINE_INSTANCE_ID": host or "services"},
                                       stdout=log, stderr=log, start_new_session=True)
            processes.append(process)
            return process

        def ticks_by(host: str) -> list[float]:
            return [at for at, e in stamped(settings) if isinstance(e, ev.WatchdogTick)
                    and e.recorded_by.startswith(f"watchdog@{host}:")]

        start("watchdog", "ops1")
        wait(lambda: ticks_by("ops1"), 120, "no tick from the first watchdog")
        for role in ("projector", "intake", *[s for s in STAGE_NAMES if s != "transcode"]):
            start(role, None)
        start("watchdog", "ops2")
        for host in ("w1", "w2"):
            start("transcode", host)

        jobs, slow_jobs, takeovers, cuts, leader = [], [], [], 0, "ops1"
        for round_ in range(args.rounds):
            # (1) the claiming worker's host is cut off mid-transcode, healed once the other took over.
            job = submit(settings, clip(work, 32.0, len(jobs), full_size=True))
            jobs.append(job)
            first = wait(lambda: [e for _, e in stamped(settings) if isinstance(e, ev.AttemptStarted)
                                  and e.job_id == job and e.stage == "transcode"], 120, "no transcode attempt")
            # mid-transcode, as the test cuts it: once the attempt has checkpointed a segment
            wait(lambda: [e for _, e in stamped(settings) if isinstance(e, ev.CheckpointRecorded) and e.job_id == job
                          and e.attempt == first[0].attempt], 120, "no checkpoint of the first attempt")
            if [e for _, e in stamped(settings) if isinstance(e, ev.AttemptSucceeded) and e.job_id == job
                    and e.stage == "transcode"]:
                raise RuntimeError(f"job {job}: the transcode ended before its host could be cut (clip too short)")
            host = first[0].worker.split("@")[1].split(":")[0]
            topology.cut(host)
            cuts += 1
            try:
                wait(lambda: [e for _, e in stamped(settings) if isinstance(e, ev.AttemptStarted) and e.job_id == job
                              and e.stage == "transcode" and e.attempt > first[0].attempt], 120, "no second attempt")
            except TimeoutError:
                explain(settings, job, work)
                raise
            topology.heal(host)
            # (2) slow, lossy, flapping links to both workers.
            stop = threading.Event()
            for name in ("w1", "w2"):
                topology.shape(name)
            flappers = [topology.flap(name, 1.5, 6.0, stop) for name in ("w1", "w2")]
            try:
                batch = [submit(settings, clip(work, 8.0, len(jobs) + n)) for n in range(args.jobs)]
                jobs += batch
                slow_jobs += batch
                for job_id in batch:
                    wait(lambda: state(settings, job_id) == "completed", JOB_TIMEOUT_S, f"job {job_id} unfinished")
            finally:
                stop.set()
                for thread in flappers:
                    thread.join(10)
                for name in ("w1", "w2"):
                    topology.unshape(name)
            # (3) the leading watchdog's host is cut off; the other takes over.
            standby = "ops2" if leader == "ops1" else "ops1"
            seen = len(ticks_by(standby))
            topology.cut(leader)
            cuts += 1
            cut_at = time.time()
            wait(lambda: len(ticks_by(standby)) > seen, 120, "no takeover")
            takeovers.append(min(t for t in ticks_by(standby) if t >= cut_at) - cut_at)
            print(f"round {round_ + 1}: worker host {host} cut; watchdog {leader} cut, {standby} took over in "
                  f"{takeovers[-1]:.1f} s", flush=True)
            topology.heal(leader)
            # the healed ops host's watchdog stopped (its session is gone); start it again as the standby
            start("watchdog", leader)
            leader = standby

        for job_id in jobs:
            try:
                wait(lambda: state(settings, job_id) == "completed", JOB_TIMEOUT_S, "")
            except TimeoutError:
                pass
        events = stamped(settings)
        duplicates = lost = false_stalls = 0  # (false_stalls: a count here; `unjustified` lists them)
        for job_id in jobs:
            completions = [e for _, e in events if e.job_id == job_id and isinstance(e, ev.JobCompleted)]
            if state(settings, job_id) != "completed" or not completions:
                lost += 1
                continue
            duplicates += len(completions) - 1
            published = [e for _, e in events if e.job_id == job_id and isinstance(e, ev.AttemptSucceeded)
                         and e.stage == "publish"]
            duplicates += len(published) - 1
            duplicates += len(keys_under(settings, f"published/{job_id}/") - {o.key for o in published[-1].outputs})
        for job_id in slow_jobs:
            false_stalls += len(unjustified(events, job_id, settings))
        print(f"RESULT partitions={cuts} takeover_s={statistics.median(takeovers):.1f} "
              f"takeover_max_s={max(takeovers):.1f} duplicates={duplicates} lost={lost} false_stalls={false_stalls}")
        return 0 if duplicates == lost == false_stalls == 0 else 1
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # its own session: the role and its ffmpeg
                process.wait()
        if settings is not None:
            stack.down(settings)  # the broker is this benchmark's own: its topics go with its home
        for forwarder in forwarders:
            forwarder.stop()
        topology.close()
        try:
            stack.drop_database(base.database_url, dbname)
        except psycopg.Error as exc:
            print(f"could not drop {dbname}: {exc}")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

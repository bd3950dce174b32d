"""Chaos benchmark: every crash point, then random crash points and SIGSTOP/SIGCONT pauses, with
several jobs each, through a real pipeline publishing to a real provider that does NOT dedupe.

Round 1 enables each crash point of `tapeline.crashpoints.PIPELINE_CRASH_POINTS` in turn (fires
once) while `--jobs` jobs run. Round 2 runs `--random` rounds; each re-arms a random crash point
and, with probability 1/2, pauses a random processor (SIGSTOP, 0.5-8 s, longer than the lease
sometimes, then SIGCONT). At the end `devstack.chaos.audit` checks every job: ended with a reason,
one post per completed job, one committed `JobCompleted`, one published output set, projection equal
to a fold over the log.

Usage: python bench/chaos.py [--jobs 2] [--random 10] [--seed 1] [--points P,...] [--smoke]
(`--points`: round 1 enables only these crash points; `--smoke`: one job, one crash point
(`transcode.CheckpointRecorded.after_commit`: a kill mid-transcode), no random rounds, for
`bench/run.py --smoke`.)
Prints the figures and ends with one line
`RESULT crash_points=... enabled=... covered=... crashes=... pauses=... jobs=... duplicates=... lost=... needs_review=...`.
Goal: every crash point covered, duplicates 0, lost 0 (`enabled`: the crash points round 1 enabled).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_settings, drop_bench_database  # noqa: E402
from bench.stall_latency import env_for  # noqa: E402
from producers.submit import publish, upload  # noqa: E402
from domain.lifecycle import TERMINAL_STATES  # noqa: E402
from devstack.chaos import ProviderProcess, audit  # noqa: E402
from tapeline.crashpoints import PIPELINE_CRASH_POINTS, tier_for_point  # noqa: E402
from tapeline.samples import sample_video  # noqa: E402
from domain.pipeline import STAGE_NAMES  # noqa: E402
from tapeline.settings import Settings  # noqa: E402

PAUSABLE = ("intake", *STAGE_NAMES, "projector", "watchdog")
"""Roles a random SIGSTOP may pause: every stage of the registry (domain/pipeline.py) among them."""


def states(settings: Settings, job_ids: list[str]) -> dict[str, str]:
    with psycopg.connect(settings.database_url) as conn:
        return dict(conn.execute("SELECT job_id, state FROM job_state WHERE job_id = ANY(%s)", (job_ids,)).fetchall())


def children(parent: int) -> dict[str, int]:
    """{role: pid} of the supervisor's children."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"--role" in cmdline:
            found[cmdline[cmdline.index(b"--role") + 1].decode()] = int(entry)
    return found


def run_round(settings: Settings, label: str, count: int, video: Path, timeout_s: float = 240.0,
              pause: tuple[int, float] | None = None, tier: str = "standard") -> dict[str, str]:
    """Submit `count` jobs of priority `tier`, optionally pause one process for a while, wait until all ended."""
    job_ids = {}
    for _ in range(count):
        submission = upload(settings, video, priority=tier)
        publish(settings, submission.event)
        job_ids[submission.job_id] = label
    if pause is not None:
        pid, seconds = pause
        time.sleep(random.uniform(0.5, 2.0))
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(seconds)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = states(settings, list(job_ids))
        if len(seen) == len(job_ids) and all(state in TERMINAL_STATES for state in seen.values()):
            break
        time.sleep(0.5)
    return job_ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="jobs per round")
    parser.add_argument("--random", type=int, default=10, help="rounds with a random crash point and maybe a pause")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--points", default=None, help="comma-separated crash points for round 1 (default: all)")
    parser.add_argument("--smoke", action="store_true", help="tiny run: --jobs 1 --random 0 --points "
                        "transcode.CheckpointRecorded.after_commit")
    args = parser.parse_args()
    if args.smoke:
        args.jobs, args.random, args.points = 1, 0, "transcode.CheckpointRecorded.after_commit"
    first_round = PIPELINE_CRASH_POINTS if args.points is None else tuple(args.points.split(","))
    unknown = set(first_round) - set(PIPELINE_CRASH_POINTS)
    if unknown:
        parser.error(f"unknown crash points: {', '.join(sorted(unknown))}")
    random.seed(args.seed)

    work = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    provider = ProviderProcess(work)
    settings = bench_settings("chaos", **{
        "lease_s": 4.0, "heartbeat_interval_s": 0.5, "no_progress_timeout_s": 8.0, "handoff_timeout_s": 15.0,
        "tick_interval_s": 0.5, "caught_up_timeout_s": 20.0, "x264_preset": "ultrafast",
        "transaction_timeout_ms": 3000, "webhook_timeout_s": 3.0, "webhook_url": provider.url, "webhook_dedupes": False,
        "restart_backoff_s": (0.5,), "max_attempts": 6})
    points_file, once = work / "crash-points", work / "crashed"
    points_file.write_text("")
    log = open(work / "run.log", "ab")
    env = dict(env_for(settings), TAPELINE_CRASH_POINTS_FILE=str(points_file), TAPELINE_CRASH_ONCE_DIR=str(once))
    pipeline = subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--role", "all"], env=env,
                                stdout=log, stderr=log, start_new_session=True)
    small, longer = sample_video("carphone_pristine.mp4"), sample_video("bigbuckbunny.mp4")
    jobs: dict[str, str] = {}
    crashes, pauses = 0, 0
    started = time.monotonic()
    try:
        time.sleep(5)
        for point in first_round:
            points_file.write_text(point + "\n")
            video = longer if ".Heartbeat." in point else small  # heartbeats need a clip longer than an interval
            jobs.update(run_round(settings, point, args.jobs, video, tier=tier_for_point(point)))
            crashes += (once / point).exists()
            points_file.write_text("")
            print(f"{point:<40} fired={(once / point).exists()}", flush=True)
        for round_number in range(args.random):
            point = random.choice(PIPELINE_CRASH_POINTS)
            (once / point).unlink(missing_ok=True)  # re-arm it
            points_file.write_text(point + "\n")
            pause = None
            if random.random() < 0.5:
                roles = children(pipeline.pid)
                role = random.choice([r for r in PAUSABLE if r in roles])
                pause = (roles[role], random.uniform(0.5, 8.0))
                pauses += 1
            label = f"random-{round_number}:{point}" + (f"+pause:{pause[1]:.1f}s" if pause else "")
            jobs.update(run_round(settings, label, args.jobs, random.choice([small, longer]), pause=pause,
                                  tier=tier_for_point(point)))
            crashes += (once / point).exists()
            points_file.write_text("")
            print(f"{label:<60} fired={(once / point).exists()}", flush=True)
    finally:
        points_file.write_text("")
        os.killpg(pipeline.pid, signal.SIGTERM)
        pipeline.wait(60)
        posts = provider.posts()
        provider.stop()
    elapsed = time.monotonic() - started
    try:
        result = audit(settings, jobs, posts)
    finally:
        drop_bench_database(settings)
    covered = len({p.name for p in once.iterdir()} & set(PIPELINE_CRASH_POINTS)) if once.exists() else 0
    print(f"\ncrash points: {len(PIPELINE_CRASH_POINTS)}, covered: {covered}")
    print(f"crashes injected: {crashes}, pauses: {pauses}, jobs: {result.jobs} in {elapsed:.0f} s")
    print(f"completed: {result.completed}, needs_review: {len(result.needs_review)}, "
          f"dead_lettered: {len(result.dead_lettered)}")
    print(f"duplicates: {result.duplicates}, lost: {result.lost}")
    for line in result.violations:
        print("VIOLATION", line)
    print(f"RESULT crash_points={len(PIPELINE_CRASH_POINTS)} enabled={len(first_round)} covered={covered} "
          f"crashes={crashes} pauses={pauses} "
          f"jobs={result.jobs} duplicates={result.duplicates} lost={result.lost} "
          f"needs_review={len(result.needs_review)}")
    return 0 if result.duplicates == 0 and result.lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

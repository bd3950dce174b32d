"""Stall-detection latency against real processes: kill -9 of a worker, of a whole host, and a hung ffmpeg, lease L.

Two "hosts" run transcode: each is a supervisor (`cli.supervisor.supervise`, as under
`tapeline run --role all`, with its rescue on exit) with one transcode worker child and its own
`TAPELINE_HOME` (so neither sees the other's holdings). The projector, intake, watchdog and publish
run as plain processes beside them. For each run: submit a 32 s real video, wait until its transcode
reports progress, then one of
  - worker kill: kill -9 the worker that holds it; its supervisor sees it exit and rescues the
    attempt (`StallDetected(worker_exited)`). Goal: next attempt <= 1 s median, <= 2 s max, at any lease;
  - host kill: kill -9 that worker's whole host, supervisor included; nobody saw it die, so the
    watchdog finds its lease expired (`StallDetected(lease_expired)`) and the other host runs the
    next attempt; a replacement host (a fresh home) is started at once. Goals: detection within
    L + 1 s; next attempt within L (median) and L + 2 s (max);
  - hang: SIGSTOP its ffmpeg while the worker keeps heartbeating, and measure (stop -> StallDetected(no_progress)).
Times are from broker timestamps (LogAppendTime, same host clock as the kill). The fault comes at a
random point between two heartbeats (the bench sees progress right after a heartbeat is projected).

Usage: python bench/stall_latency.py [--lease 5] [--runs 5] [--host-runs 5] [--hang-runs 3] [--loops 6] [--smoke]
(`--smoke`: one run of each on a 16 s source, for `bench/run.py --smoke`.)
Prints the figures and ends with one line `RESULT lease_s=... worker_restart_median_s=... ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_settings, drop_bench_database  # noqa: E402
from producers.submit import publish, upload  # noqa: E402
from projections.writes import PAYLOAD_OMITS  # noqa: E402
from tapeline.samples import sample_video  # noqa: E402
from domain.pipeline import STAGE_NAMES  # noqa: E402
from tapeline.settings import Settings  # noqa: E402


def env_for(settings: Settings) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if value is not None and name != "instance_id":
            env[f"TAPELINE_{name.upper()}"] = json.dumps(value) if isinstance(value, (tuple, dict)) else str(value)
    return env


def start(role: str, settings: Settings, logs: Path) -> subprocess.Popen:
    log = open(logs / f"{role}-{uuid.uuid4().hex[:4]}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--role", role], env=env_for(settings),
                            stdout=log, stderr=log, start_new_session=True)


HOST = ("import sys; from tapeline.settings import Settings; from cli.supervisor import supervise; "
        "from cli.wiring import rescue_on_exit; settings = Settings(); "
        "sys.exit(supervise(('transcode',), grace_s=5.0, on_exit=rescue_on_exit(settings)))")
"""A transcode host: the supervisor of `tapeline run --role all`, with only the transcode role."""


def start_host(settings: Settings, logs: Path) -> subprocess.Popen:
    """A supervisor with one transcode worker, in its own process group and with its own home."""
    name = f"host-{uuid.uuid4().hex[:4]}"
    home = logs / name
    home.mkdir()
    log = open(logs / f"{name}.log", "ab")
    return subprocess.Popen([sys.executable, "-c", HOST], env={**env_for(settings), "TAPELINE_HOME": str(home)},
                            stdout=log, stderr=log, start_new_session=True)


def summary(label: str, values: list[float]) -> str:
    return f"{label}: median {statistics.median(values):.2f} s, max {max(values):.2f} s" if values else f"{label}: no runs"


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def maximum(values: list[float]) -> float:
    return max(values) if values else float("nan")


def query(settings: Settings, sql: str, *params):
    with psycopg.connect(settings.database_url, row_factory=psycopg.rows.dict_row) as conn:
        return conn.execute(sql, params).fetchall()


def wait(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def running_with_progress(settings: Settings, job_id: str):
    rows = query(settings, "SELECT * FROM job_state WHERE job_id = %s", job_id)
    return rows[0] if rows and rows[0]["state"] == "running" and (rows[0]["progress_frames"] or 0) > 100 else None


def completed(settings: Settings, job_id: str) -> bool:
    """Whether the projection shows `job_id` completed."""
    return bool(query(settings, "SELECT 1 FROM job_state WHERE job_id = %s AND state = 'completed'", job_id))


def event_time(settings: Settings, job_id: str, event_type: str, **match) -> float | None:
    """Broker time (epoch s) of the job's first `event_type` whose fields equal `match`, or None.

    A field the evidence row has a column for (`writes.PAYLOAD_OMITS`: attempt, stage, ...) is read
    from that column: since migration 017 it is no longer in the payload."""
    rows = query(settings, "SELECT * FROM lifecycle_evidence WHERE job_id = %s AND event_type = %s"
                           " ORDER BY broker_ts", job_id, event_type)
    for row in rows:
        if all((row[k] if k in PAYLOAD_OMITS else row["payload"].get(k)) == v for k, v in match.items()):
            return row["broker_ts"].timestamp()
    return None


def run_again(redone: int, why: str) -> int:
    """Say why a run is made again (its fault found nothing to act on) and return the new count of
    runs made again; SystemExit at the fourth, so a machine where it always happens fails loudly."""
    if redone >= 3:
        raise SystemExit(f"{why}, four times")
    print(f"{why}; again")
    return redone + 1


def ended_before(settings: Settings, job_id: str, moment: float) -> bool:
    """Whether attempt 1 of the job's transcode had succeeded before `moment` (epoch s): a kill then
    found no attempt to rescue."""
    ended = event_time(settings, job_id, "AttemptSucceeded", stage="transcode", attempt=1)
    return ended is not None and ended < moment


def last_lease_start(settings: Settings, job_id: str, before: float) -> float:
    """Broker time (epoch s) of attempt 1's last claim or heartbeat before `before`: its lease ends
    one lease later."""
    rows = query(settings, "SELECT max(broker_ts) AS at FROM lifecycle_evidence WHERE job_id = %s AND attempt = 1"
                           " AND event_type IN ('AttemptStarted', 'Heartbeat') AND broker_ts < to_timestamp(%s)",
                 job_id, before)
    return rows[0]["at"].timestamp()


def parent_of(pid: int) -> int:
    """The parent pid of `pid` (from /proc/<pid>/stat)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def children_named(parent: int, name: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            comm = Path(f"/proc/{entry}/comm").read_text().strip()
        except OSError:
            continue
        if comm == name and int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            found.append(int(entry))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lease", type=float, default=5.0, help="lease L, seconds")
    parser.add_argument("--runs", type=int, default=5, help="kill -9 runs of a supervised worker")
    parser.add_argument("--host-runs", type=int, default=5, help="kill -9 runs of a whole host (supervisor included)")
    parser.add_argument("--hang-runs", type=int, default=3, help="SIGSTOP-ffmpeg runs")
    parser.add_argument("--loops", type=int, default=6, help="copies of the 5.3 s sample (6: about 32 s)")
    parser.add_argument("--smoke", action="store_true", help="tiny run: one run of each, --loops 3")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.host_runs, args.hang_runs, args.loops = 1, 1, 1, 3

    settings = bench_settings(
        "stall", lease_s=args.lease, no_progress_timeout_s=args.lease, tick_interval_s=0.25, handoff_timeout_s=600.0,
        x264_preset="ultrafast", transaction_timeout_ms=int(args.lease * 600))
    work = Path(tempfile.mkdtemp(prefix="bench-stall-"))
    video = work / "long.mp4"
    subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-stream_loop", str(args.loops - 1), "-i", str(sample_video()), "-c", "copy",
                    "-y", str(video)], check=True)
    processes = [start(role, settings, work) for role in ("projector", "intake", "watchdog", *(s for s in STAGE_NAMES if s != "transcode"))]
    hosts = [start_host(settings, work) for _ in range(2)]
    figures: dict[str, list[float]] = {"worker_detect": [], "worker_restart": [], "host_detect": [],
                                       "host_restart": [], "hang_detect": [], "lease_left": [], "after_expiry": []}
    plan = ["worker"] * args.runs + ["host"] * args.host_runs + ["hang"] * args.hang_runs
    try:
        run, redone = 0, 0
        while run < len(plan):
            fault = plan[run]
            run += 1
            submission = upload(settings, video)
            publish(settings, submission.event)
            job = submission.job_id
            row = wait(lambda: running_with_progress(settings, job), 120, "a transcode under way")
            pid = int(row["worker"].rsplit(":", 1)[1])
            time.sleep(random.uniform(0, settings.heartbeat_s))  # a random point between two heartbeats
            if fault == "hang":
                ffmpeg = wait(lambda: children_named(pid, "ffmpeg") or completed(settings, job), 30,
                              "the worker's ffmpeg")
                if ffmpeg is True:  # the transcode ended between two ffmpeg runs we polled: again
                    redone = run_again(redone, f"run {run} (hang): the job completed before its ffmpeg was seen")
                    run -= 1
                    continue
                ffmpeg = ffmpeg[0]
                attempt_stopped = row["attempt"]
                try:
                    os.kill(ffmpeg, signal.SIGSTOP)
                except ProcessLookupError:  # that ffmpeg ended between the poll and the signal: again
                    redone = run_again(redone, f"run {run} (hang): its ffmpeg ended before it could be stopped")
                    run -= 1
                    continue
                t0 = time.time()
                try:
                    t_stall = wait(lambda: event_time(settings, job, "StallDetected", kind="no_progress"), 60,
                                   "no_progress")
                except SystemExit:
                    # Said with the job's row: a job that moved on without that ffmpeg (it ended or
                    # another attempt runs) is a fault that found nothing to act on; anything else fails.
                    row = (query(settings, "SELECT * FROM job_state WHERE job_id = %s", job) or [None])[0]
                    os.kill(ffmpeg, signal.SIGCONT)
                    seen = {k: row.get(k) for k in ("state", "stage", "attempt", "progress_frames", "progress_at",
                                                     "last_heartbeat_at", "progress_grace_s", "leased_until")} if row else None
                    if row is None or row["state"] != "running" or row["attempt"] != attempt_stopped:
                        redone = run_again(redone, f"run {run} (hang): the job moved on without the stopped ffmpeg ({seen})")
                        run -= 1
                        continue
                    raise SystemExit(f"run {run} (hang): no no_progress within 60 s of SIGSTOP; the job's row: {seen}")
                figures["hang_detect"].append(t_stall - t0)
                os.kill(ffmpeg, signal.SIGCONT)
                print(f"run {run} (hang): no_progress detected {t_stall - t0:.2f} s after SIGSTOP")
            else:
                host = next(h for h in hosts if h.pid == parent_of(pid))
                kind = "worker_exited" if fault == "worker" else "lease_expired"
                if fault == "worker":
                    os.kill(pid, signal.SIGKILL)
                else:
                    os.killpg(host.pid, signal.SIGKILL)
                t0 = time.time()
                if fault == "host":
                    hosts = [h for h in hosts if h is not host] + [start_host(settings, work)]
                seen = wait(lambda: (event_time(settings, job, "StallDetected", kind=kind) or
                                     ended_before(settings, job, t0)), 60, kind)
                if seen is True:  # the transcode had finished before the kill (a fast machine): again
                    redone = run_again(redone, f"run {run} ({fault} kill): the transcode ended before the kill")
                    run -= 1
                    wait(lambda: completed(settings, job), 180, "the job to complete")
                    continue
                t_stall = seen
                t_next = wait(lambda: event_time(settings, job, "AttemptStarted", attempt=2), 60, "attempt 2")
                figures[f"{fault}_detect"].append(t_stall - t0)
                figures[f"{fault}_restart"].append(t_next - t0)
                lease_note = ""
                if fault == "host":  # split the wait: the lease still to run at the kill, then our detection
                    expiry = last_lease_start(settings, job, before=t0) + args.lease
                    figures["lease_left"].append(expiry - t0)
                    figures["after_expiry"].append(t_stall - expiry)
                    lease_note = f"; the lease had {expiry - t0:.2f} s left, detected {t_stall - expiry:.2f} s after it ended"
                print(f"run {run} ({fault} kill): StallDetected({kind}) {t_stall - t0:.2f} s, next attempt started "
                      f"{t_next - t0:.2f} s after kill -9 (lease {args.lease:g} s){lease_note}")
            wait(lambda: completed(settings, job), 180, "the job to complete")
    finally:
        for process in processes + hosts:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        drop_bench_database(settings)
    lease = args.lease
    print(f"\nlease L = {lease:g} s, heartbeat every {settings.heartbeat_s:g} s, watchdog tick {settings.tick_s:g} s")
    print(summary("worker kill -9 -> StallDetected(worker_exited)", figures["worker_detect"]))
    print(summary("worker kill -9 -> next attempt", figures["worker_restart"]) + "; goal median <= 1 s, max <= 2 s")
    print(summary("host kill -9 -> StallDetected(lease_expired)", figures["host_detect"]) + f"; goal <= L + 1 s = {lease + 1:g} s")
    print(summary("host kill -9 -> next attempt", figures["host_restart"]) +
          f"; goal median <= L = {lease:g} s, max <= L + 2 s")
    print(summary("  of which: lease left at the kill (L - time since the last heartbeat)", figures["lease_left"]))
    print(summary("  of which: lease end -> StallDetected (log clock tick, projection, watchdog)", figures["after_expiry"]))
    print(summary("SIGSTOP ffmpeg -> no_progress", figures["hang_detect"]) +
          f" (no-progress timeout {settings.no_progress_timeout_s:g} s)")
    print(f"RESULT lease_s={lease:g} "
          f"worker_detect_median_s={median(figures['worker_detect']):.2f} "
          f"worker_restart_median_s={median(figures['worker_restart']):.2f} "
          f"worker_restart_max_s={maximum(figures['worker_restart']):.2f} "
          f"host_detect_median_s={median(figures['host_detect']):.2f} host_detect_max_s={maximum(figures['host_detect']):.2f} "
          f"host_restart_median_s={median(figures['host_restart']):.2f} "
          f"host_restart_max_s={maximum(figures['host_restart']):.2f} "
          f"no_progress_detect_median_s={median(figures['hang_detect']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

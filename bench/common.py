"""What every benchmark shares: its own topics and database on the local stack."""

from __future__ import annotations

import os
import resource
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tapeline.postgres import migrate  # noqa: E402
from tapeline.objectstore import ObjectStore  # noqa: E402
import devstack as stack  # noqa: E402
from tapeline.settings import Settings  # noqa: E402


def bench_settings(name: str, **overrides: Any) -> Settings:
    """Bring the local stack up and return settings with a fresh topic prefix, app name and database
    (`<name>_<tag>`), small partition counts, the topics created and the migrations applied;
    `overrides` are applied last."""
    base = Settings()
    stack.up(base)
    tag = uuid.uuid4().hex[:8]
    dbname = f"bench_{name}_{tag}"
    with psycopg.connect(base.database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    settings = base.model_copy(update={
        "topic_prefix": f"{name}{tag}", "app_name": f"bench-{name}-{tag}", "jobs_partitions": 3, "work_partitions": 2,
        "uploads_partitions": 2, "database_url": base.database_url.rsplit("/", 1)[0] + "/" + dbname,
        "reuse_results": False,  # benches resubmit one clip to measure transcodes, not result reuse
        "cleanup_orphans": False,  # the bucket is shared: never sweep objects of jobs this bench does not know
        **overrides})
    stack.ensure_topics(settings)
    migrate(settings.database_url, settings.db_schema, settings.reader_role)  # the schema the processes use
    return settings


def drop_bench_database(settings: Settings, extra_prefixes: tuple[str, ...] = ()) -> None:
    """Drop the database `bench_settings` created, its topics, and its jobs' objects in the bucket
    (`delete_bench_objects`, with `extra_prefixes`)."""
    removed = delete_bench_objects(settings, extra_prefixes)
    print(f"cleanup: removed {removed} objects of this benchmark from the bucket", file=sys.stderr)
    stack.delete_topics(settings)
    dbname = settings.database_url.rsplit("/", 1)[1]
    stack.drop_database(Settings().database_url, dbname)


def delete_bench_objects(settings: Settings, extra_prefixes: tuple[str, ...] = ()) -> int:
    """Remove from the (shared) bucket the objects of this benchmark's jobs: `uploads/{upload_id}/`,
    `work/{job}/`, `markers/{job}/` and `published/{job}/` of every job in its database's job_state,
    and every key under `extra_prefixes` (objects a benchmark wrote without a projected job).
    Returns the number of objects removed."""
    prefixes = list(extra_prefixes)
    try:
        with psycopg.connect(settings.database_url) as conn:
            rows = conn.execute("SELECT job_id, upload_id FROM job_state").fetchall()
    except psycopg.errors.UndefinedTable:
        rows = []
    for job_id, upload_id in rows:
        prefixes.append(f"uploads/{upload_id}/")
    for job_id in [row[0] for row in rows]:
        prefixes += [f"work/{job_id}/", f"markers/{job_id}/", f"published/{job_id}/"]
    store, removed = ObjectStore(settings), 0
    for prefix in prefixes:
        token = None
        while True:
            objects, token = store.list_page(prefix, token, 1000)
            keys = [o.key for o in objects]
            if keys:  # ObjectStore.delete_many refuses published/: these are the bench's own
                store.s3.delete_objects(Bucket=store.bucket, Delete={"Objects": [{"Key": k} for k in keys],
                                                                     "Quiet": True})
                removed += len(keys)
            if token is None:
                break
    return removed


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(database_url: str) -> dict[str, float]:
    """CPU seconds (user + system) used so far on this machine, by who used them, read from Linux's
    `/proc` (proc(5): `/proc/stat`, `/proc/PID/stat` fields 14-17, in clock ticks). Subtract two
    calls to get a window's figures. Keys:

    - `machine_busy`, `machine_idle`: every CPU summed (`/proc/stat`: busy is user, nice, system, irq,
      softirq, steal; idle is idle and iowait);
    - `postgresql`: the server's postmaster, its reaped children (backends that ended) and its live
      children (found from this connection's backend PID's parent);
    - `kafka_broker`: every JVM whose command line runs `kafka.Kafka`;
    - `children`: this process's reaped child processes, and theirs (`RUSAGE_CHILDREN`).

    Only meaningful when PostgreSQL and Kafka run on this machine (the local stack); a group whose
    process is not found is 0.
    """
    with open("/proc/stat") as stat:
        ticks = [int(value) for value in stat.readline().split()[1:]]
    busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + (ticks[7] if len(ticks) > 7 else 0)
    figures = {"machine_busy": busy / CLOCK_TICKS, "machine_idle": (ticks[3] + ticks[4]) / CLOCK_TICKS}
    with psycopg.connect(database_url) as conn:
        backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        postmaster = (_process_stat(backend) or (0, None))[1]  # None: the server is not on this machine
    figures["postgresql"] = figures["kafka_broker"] = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _process_stat(int(entry.name))
        if stat is None:
            continue
        pid, parent, own, reaped = int(entry.name), stat[1], stat[2], stat[3]
        if pid == postmaster:
            figures["postgresql"] += own + reaped
        elif parent == postmaster and pid != backend:
            figures["postgresql"] += own
        elif b"kafka.Kafka" in _read(entry / "cmdline"):
            figures["kafka_broker"] += own + reaped
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    figures["children"] = usage.ru_utime + usage.ru_stime
    return figures


def _process_stat(pid: int) -> tuple[int, int, float, float] | None:
    """(pid, parent pid, own CPU s, reaped children's CPU s) of a process, or None once it is gone."""
    raw = _read(Path(f"/proc/{pid}/stat"))
    if not raw:
        return None
    fields = raw[raw.rindex(b")") + 2:].split()  # after "pid (comm) ": state is field 3
    return (pid, int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS,
            (int(fields[13]) + int(fields[14])) / CLOCK_TICKS)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """`after - before` per key of `cpu_seconds`, rounded to 0.1 s."""
    return {key: round(after[key] - before[key], 1) for key in before}

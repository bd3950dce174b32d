"""Replay workers per partition: the bulk replay's decode and fold spread over processes, one writer.

A fresh replay (`projections/replay.py`) spends most of its time in Python, decoding and folding
(about 60 of the 80 µs a record costs on this project's 2-core machine); PostgreSQL needs far
less. The fold is per job, and every event of a job is in one partition of the lifecycle log (its
key is the job id, docs/design.md "Topics"), so the partitions can be folded independently:

- the parent computes the stop offsets once (`kafka_scan.bounds`) and splits the partitions of every
  topic among `workers` child processes (`partition_plan.split`: largest first, onto the least
  loaded);
- each worker reads its partitions with its own consumer and folds them with `bulk.FoldState`
  (the projector's own `decode_batch` and `fold_batch`, `projections/fold.py`), and sends what the database must get,
  already encoded as COPY rows (`writes.RowEncoder`): evidence per slice, final job rows as jobs
  end, open job rows, dedup keys and uploads at the end; dead letters and replay marks as
  parameters;
- the parent holds the database connections: it streams the workers' evidence bytes into the one
  `COPY ... FREEZE` of `bulk.BulkReplay` as they arrive, spools job rows and keys to temporary
  files until the evidence COPY ends, then writes the job rows, the uploads (merged: the first
  copy by broker time, every copy counted), the log clock, the offsets, the dead letters, and the
  replay marks (after every dead letter, so a mark never misses a row written by another worker),
  rebuilds the indexes and commits: ONE transaction, so the crash contract of the bulk path holds
  (a crash, a killed worker or Ctrl-C leaves the schema migrated, with no projection row);
- meanwhile a second connection builds the dedup keys' table and primary key, which that
  transaction swaps in before its commit (`keys_aside.DedupKeysAside`: the one thing committed
  before the replay, a staging table the next replay into the schema drops if the replay never
  commits).

A worker that fails sends its traceback and exits; one that dies is seen as its pipe closing. Either
way the parent rolls back, stops the others and raises `ReplayFailed`. A job whose events are in
two partitions (the lifecycle topic's partition count changed under a running system) would be
folded by two workers, each seeing part of it: every worker reports the job ids it saw, and when
two share one the parent rolls back and says to use `--workers 1` (one process folding every
partition, as the projector does).

This module runs the processes (the worker's loop, the parent's `run`); the pure planning and
merging (`split`, `default_workers`, `jobs_in_several_workers`, `merge_summary`) is in
`partition_plan.py`, the dedup keys built aside in `keys_aside.py`.
"""

from __future__ import annotations

import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Callable

# A worker runs this module (`python -m projections.partitioned N`), so its top imports only what a
# worker with the native engine needs; psycopg, the bulk writer, the projector, the models and the
# Python codec are imported where they are used (the parent's `run`, the Python engine). Measured:
# a worker ready in 0.36 s of CPU instead of 1.2 s.
from tapeline import kafka_scan
from projections.batch import BatchResult
from projections.native import EngineSetup, NativeFoldState, NativeUnsupported
from projections.partition_plan import (ParallelOutcome, ReplayFailed, add_counts, chunks, jobs_in_several_workers,
                                        merge_summary, split)
from tapeline.crashpoints import crash_point
from tapeline.settings import Settings

if TYPE_CHECKING:
    import psycopg

Position = kafka_scan.Position
KEYS_PER_MESSAGE = 50_000
"""Dedup keys (or open job rows) a worker encodes per message at the end."""
WORKER_SLICE_RECORDS = 1000
"""Records a worker folds per slice. Smaller slices leave less freed-but-kept memory behind (measured
on a 924k-record log, one worker's peak RSS: 170 MB at 1000, 197 MB at 5000, 285 MB at 20000) at no
measurable cost in speed."""


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB since it started its program: `VmHWM` of
    /proc/self/status (Linux). Not `getrusage().ru_maxrss`: Linux keeps that across fork and execve
    (getrusage(2)), so a child of a big process (the benchmark) would report its parent's size."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class WorkerPlan:
    """What one worker reads and how it reports."""

    settings: Settings
    span: kafka_scan.Bounds
    clock_topic: str
    dlq_topic: str
    batch_size: int = 5000
    flush_rows: int = 2000
    engine: str = "python"
    """`python` or `native` (`projections/native.py`)."""
    native_setup: EngineSetup | None = None
    """The parent's `native.engine_setup()` (engine native): the worker need not import the codec."""


def worker_main(plan: WorkerPlan, pipe: Connection) -> None:
    """A replay worker's process (`python -m projections.partitioned`, its plan pickled on stdin):
    read `plan.span`, fold it, send encoded rows on `pipe` (its stdout).

    Messages, each a `(tag, payload)` tuple: ("evidence", (bytes, offsets done)), ("job_rows",
    bytes), ("keys", bytes), ("dead", (dead letters, replay marks)), then ("done", summary dict), or
    ("error", traceback text), or ("unsupported", reason) when the native engine cannot fold the log.
    """
    import gc

    gc.disable()  # as in BulkReplay: the state only grows and holds no cycles
    try:
        phases = {}
        if plan.engine == "native":
            state, evidence, text = NativeFoldState(plan.clock_topic, plan.dlq_topic, plan.flush_rows,
                                                    plan.native_setup), None, None
        else:
            from projections import writes
            from projections.bulk import FoldState

            state = FoldState(plan.clock_topic, plan.dlq_topic, plan.flush_rows)
            evidence, text = writes.RowEncoder(writes.EVIDENCE_TYPES), writes.RowEncoder()
        native = state.native
        totals, job_ids = BatchResult(), set()
        consumer = kafka_scan.reader(plan.settings, "replay-worker", queue_kbytes=8 * 1024)
        try:
            done_offsets = 0
            pieces = kafka_scan.read(consumer, plan.span, batch_size=plan.batch_size)
            while True:
                reading = time.perf_counter()
                piece = next(pieces, None)
                phases["read"] = phases.get("read", 0.0) + time.perf_counter() - reading
                if piece is None:
                    break
                result, folded = state.fold(piece.records, piece.ends, phases)
                add_counts(totals, result)
                if native:  # evidence rows already encoded; job ids kept by the engine
                    chunk = folded
                else:
                    job_ids.update(row[6] for row in folded.evidence)  # writes.EVIDENCE_COLUMNS: job_id
                    encoding = time.perf_counter()
                    chunk = bytes(evidence.encode(folded.evidence))
                    phases["encode"] = phases.get("encode", 0.0) + time.perf_counter() - encoding
                done_offsets = sum(state.positions.get(p, plan.span.start[p]) - plan.span.start[p]
                                   for p in plan.span.stop)
                pipe.send(("evidence", (chunk, done_offsets)))
                crash_point("replay.worker.after_slice")
                dead = state.take_dead() if state.pending_dead else []
                for dead_letters, replays in dead:
                    pipe.send(("dead", (dead_letters, replays)))
                if state.final_count() >= plan.flush_rows:
                    pipe.send(("job_rows", _final_rows(state, text)))
        finally:
            consumer.close()
        pipe.send(("job_rows", _final_rows(state, text)))
        if native:
            job_ids = state.job_ids()
            for chunk in state.open_rows_copy():
                pipe.send(("job_rows", chunk))
            for chunk in state.keys_copy():
                pipe.send(("keys", chunk))
        else:
            for rows in chunks(state.open_rows(), KEYS_PER_MESSAGE):
                pipe.send(("job_rows", bytes(text.encode(rows))))
            for keys in chunks(((key,) for key in state.seen), KEYS_PER_MESSAGE):
                pipe.send(("keys", bytes(text.encode(keys))))
        pipe.send(("done", {"counts": (totals.records, totals.applied, totals.duplicates, totals.superseded,
                                       totals.dead_letters),
                            "job_ids": job_ids, "uploads": state.uploads, "clock": state.clock, "positions": state.positions,
                            "phases": phases, "rss_mb": peak_rss_mb()}))
    except NativeUnsupported as exc:  # the parent rolls back and replays with the Python engine
        try:
            pipe.send(("unsupported", str(exc)))
        except (BrokenPipeError, OSError):
            pass
        raise SystemExit(1)
    except BaseException:  # noqa: BLE001 - reported to the parent, which rolls back and raises
        try:
            pipe.send(("error", traceback.format_exc()))
        except (BrokenPipeError, OSError):
            pass
        raise SystemExit(1)
    finally:
        pipe.close()


def _final_rows(state, text) -> bytes:
    """The queued final job rows in text COPY format (they become stubs)."""
    return state.take_final_rows_copy() if state.native else bytes(text.encode(state.take_final_rows()))


def run(settings: Settings, conn: psycopg.Connection, span: kafka_scan.Bounds, workers: int, projection: str,
        batch_size: int = 5000, on_progress: Callable[[int], None] | None = None,
        before_commit: Callable[[psycopg.Connection], None] | None = None, engine: str = "python") -> ParallelOutcome:
    """Replay `span` into the fresh schema of `conn` (autocommit, search_path set) with `workers`
    processes, in one transaction (the dedup keys' table built beside it, `DedupKeysAside`). `before_commit(conn)` writes more rows in that transaction (the
    replay's `projection_source`). Raises `ReplayFailed` (rolled back) when a worker fails or dies,
    `NativeUnsupported` (rolled back) when a worker's native engine cannot fold its records."""
    from domain import lifecycle
    from projections.bulk import BulkReplay
    from projections.keys_aside import DedupKeysAside, copy_spooled
    from projections.native import engine_setup

    parts = split(span, workers)
    outcome = ParallelOutcome(workers=len(parts))
    keys_table = DedupKeysAside.definition(conn)  # read before the replay's transaction locks the table
    writer = BulkReplay(conn, projection, clock_topic=settings.jobs_topic, dlq_topic=settings.dlq_topic,
                        built_elsewhere=("applied_dedup_keys",) if keys_table else ())
    aside: DedupKeysAside | None = None
    processes, pipes, progress = [], {}, {}
    job_rows, keys = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    setup = engine_setup() if engine == "native" else None
    replays: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    try:
        for number, part in enumerate(parts):
            # A new interpreter (never a fork of one holding librdkafka and libpq state) that imports
            # only what a worker needs; its stderr is ours (its log lines and tracebacks show).
            process = subprocess.Popen([sys.executable, "-m", "projections.partitioned", str(number)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       start_new_session=True)  # a terminal's Ctrl-C is ours to handle, not theirs
            processes.append(process)
            name = f"replay worker {number} (pid {process.pid})"
            try:
                process.stdin.write(pickle.dumps(WorkerPlan(settings, part, settings.jobs_topic, settings.dlq_topic,
                                                            min(batch_size, WORKER_SLICE_RECORDS),
                                                            writer.state.flush_rows, engine, setup)))
                process.stdin.close()
            except BrokenPipeError:
                raise ReplayFailed(f"{name} exited before it read its plan; nothing was committed") from None
            receiver = Connection(os.dup(process.stdout.fileno()), writable=False)
            process.stdout.close()
            pipes[receiver] = (name, process)
            progress[receiver] = 0
        open_pipes = set(pipes)
        while open_pipes:
            waiting = time.perf_counter()
            ready = wait(list(open_pipes))
            writer._add("wait", time.perf_counter() - waiting)
            for pipe in ready:
                try:
                    tag, payload = pipe.recv()
                except (EOFError, OSError, pickle.UnpicklingError):  # closed between or inside a message
                    name, process = pipes[pipe]
                    try:
                        code = process.wait(5)
                    except subprocess.TimeoutExpired:
                        code = None
                    raise ReplayFailed(f"{name} died (exit code {code}) before it finished; nothing was "
                                       "committed") from None
                if tag == "evidence":
                    chunk, progress[pipe] = payload
                    if chunk:
                        writer.write_evidence_rows(chunk)
                    if on_progress is not None:
                        on_progress(sum(progress.values()))
                elif tag == "job_rows":
                    job_rows.write(payload)
                elif tag == "keys":
                    keys.write(payload)
                elif tag == "dead":
                    dead, marks = payload
                    replays.extend(marks)  # written after every dead letter, in each worker's log order
                    if dead:
                        writer.queue_dead(dead, [])
                elif tag == "done":
                    summaries.append(payload)
                    open_pipes.discard(pipe)
                elif tag == "unsupported":
                    raise NativeUnsupported(f"{pipes[pipe][0]}: {payload}")
                elif tag == "error":
                    raise ReplayFailed(f"{pipes[pipe][0]} failed; nothing was committed:\n{payload}")
        shared = jobs_in_several_workers([summary["job_ids"] for summary in summaries])
        if shared:
            raise ReplayFailed(f"{len(shared)} job(s) have events in partitions read by different workers (e.g. "
                               f"{sorted(shared)[0]}): the lifecycle topic's partition count changed under a running "
                               "system, so a job's events are not in one partition; nothing was committed. Replay "
                               "with --workers 1")
        for summary in summaries:
            merge_summary(writer.state, outcome, summary)
        if keys_table:  # the keys and their primary key, built beside this transaction's own work
            aside = DedupKeysAside(settings.database_url, keys_table, keys)

        def write_spooled(conn: psycopg.Connection) -> None:
            if replays:
                writer.queue_dead([], replays)
                writer._flush()
            copy_spooled(conn, "job_state", lifecycle.JOB_STATE_COLUMNS, job_rows)
            if aside is None:
                copy_spooled(conn, "applied_dedup_keys", ("dedup_key",), keys)
            if before_commit is not None:
                before_commit(conn)

        writer.finish(before_final_rows=write_spooled, after_indexes=aside.install if aside is not None else None)
        outcome.phases.update(writer.phases)
        writer = None
    except BaseException as exc:
        if writer is not None:
            writer.abort(exc)
        if aside is not None:
            aside.discard()
        raise
    finally:
        for process in processes:
            try:
                if process.poll() is None:
                    process.terminate()
                process.wait(10)
            except BaseException:  # noqa: BLE001 - a second Ctrl-C or a stuck worker: kill, reap the rest too
                process.kill()
                process.wait()
        for pipe in pipes:
            pipe.close()
        job_rows.close()
        keys.close()
    parent_mb = peak_rss_mb()
    outcome.rss_mb += parent_mb
    outcome.rss_mb_by_process.insert(0, round(parent_mb, 1))
    return outcome


def _worker_entry() -> None:
    """`python -m projections.partitioned N`: read a pickled `WorkerPlan` from stdin, report on stdout."""
    plan = pickle.load(sys.stdin.buffer)
    pipe = Connection(os.dup(sys.stdout.fileno()), readable=False)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # nothing else may write into the message stream,
    sys.stdout = sys.stderr  # not Python code nor a C library writing to fd 1
    worker_main(plan, pipe)
    # Everything is sent and the pipe closed. Skip the interpreter's teardown: its final garbage
    # collection walks the whole heap (0.3-0.4 s of CPU per worker, measured with py-spy), taken from
    # the parent's index builds that run meanwhile.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker_entry()

"""The pure part of a replay by workers (`projections/partitioned.py`): how the partitions are split
among the workers, how many workers a replay gets, and how the workers' end summaries are merged into
the parent's state and totals. No process, pipe or database here: `partitioned.py` runs the workers
and `keys_aside.py` builds the dedup keys beside the replay's transaction."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from domain.errors import TapelineError
from tapeline import kafka_scan
from projections.batch import BatchResult

if TYPE_CHECKING:
    from projections.bulk import FoldState


class ReplayFailed(TapelineError):
    """A replay worker failed or died; the replay was rolled back."""


def split(span: kafka_scan.Bounds, workers: int) -> list[kafka_scan.Bounds]:
    """Partitions with records to read, split among at most `workers` parts of about equal offsets
    (largest partition first, each onto the part with the fewest offsets so far)."""
    sizes = sorted(((span.stop[p] - span.start[p], p) for p in span.stop if span.stop[p] > span.start[p]),
                   key=lambda item: (-item[0], item[1]))
    parts = [kafka_scan.Bounds() for _ in range(max(1, min(workers, len(sizes))))]
    loads = [0] * len(parts)
    for size, position in sizes:
        least = loads.index(min(loads))
        parts[least].start[position], parts[least].stop[position] = span.start[position], span.stop[position]
        loads[least] += size
    return [part for part in parts if part.stop]


def default_workers(total_offsets: int, cores: int | None = None) -> int:
    """Workers for a replay of `total_offsets` when none is asked for: one process (no workers) below
    200,000 offsets, where starting processes costs more than it saves; else the number of cores."""
    return 1 if total_offsets < 200_000 else max(1, cores or os.cpu_count() or 1)


def jobs_in_several_workers(job_ids: list[set[str]]) -> set[str]:
    """Job ids that more than one worker saw events of (each worker's set of job ids given)."""
    seen: set[str] = set()
    shared: set[str] = set()
    for ids in job_ids:
        shared |= seen & ids
        seen |= ids
    return shared


def add_counts(totals: BatchResult, result: BatchResult) -> None:
    """Add `result`'s counts (records, applied, duplicates, superseded, dead letters) to `totals`."""
    totals.records += result.records
    totals.applied += result.applied
    totals.duplicates += result.duplicates
    totals.superseded += result.superseded
    totals.dead_letters += result.dead_letters


def chunks(items: Iterable, size: int) -> Iterator[list]:
    """`items` in lists of `size` (the last one shorter); none for no items."""
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


@dataclass
class ParallelOutcome:
    """Totals of a replay by workers (what `replay` puts in its `ReplayResult`)."""

    counts: BatchResult = field(default_factory=BatchResult)
    phases: dict[str, float] = field(default_factory=dict)
    """The parent's seconds per phase (wait, copy_evidence, write_final_rows, build_indexes, commit)
    and the workers' summed (read, decode, fold, encode: CPU spread over processes)."""
    workers: int = 0
    rss_mb: float = 0.0
    """Peak resident memory of the parent plus each worker's peak (MB): an upper bound of the total."""
    rss_mb_by_process: list[float] = field(default_factory=list)
    """Each process's peak (MB): the parent's first, then the workers'."""


def merge_summary(state: FoldState, outcome: ParallelOutcome, summary: dict[str, Any]) -> None:
    """Fold one worker's end summary into the parent's state (uploads, clock, positions) and totals."""
    records, applied, duplicates, superseded, dead_letters = summary["counts"]
    counts = outcome.counts
    counts.records += records
    counts.applied += applied
    counts.duplicates += duplicates
    counts.superseded += superseded
    counts.dead_letters += dead_letters
    from projections.bulk import UPLOAD_COLUMNS

    broker_ts = UPLOAD_COLUMNS.index("broker_ts")
    for upload_id, row in summary["uploads"].items():  # upsert_upload: the first copy's fields, all copies counted
        kept = state.uploads.get(upload_id)
        if kept is None:
            state.uploads[upload_id] = row
        else:
            first = row if row[broker_ts] < kept[broker_ts] else kept
            state.uploads[upload_id] = first[:-1] + [kept[-1] + row[-1]]
    for partition, now in summary["clock"].items():
        if partition not in state.clock or now > state.clock[partition]:
            state.clock[partition] = now
    state.positions.update(summary["positions"])
    for phase, seconds in summary["phases"].items():
        outcome.phases[phase] = outcome.phases.get(phase, 0.0) + seconds
    outcome.rss_mb += summary["rss_mb"]
    outcome.rss_mb_by_process.append(round(summary["rss_mb"], 1))

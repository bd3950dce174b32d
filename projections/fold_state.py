"""The in-memory fold of a fresh replay (pure: no I/O): `FoldState` holds the job rows, the applied
dedup keys (`KeySet`, compact), the uploads, the log clock and the positions, folded slice by slice
with the projector's own `decode_batch` and `fold_batch` (`projections/fold.py`). The bulk path
(`projections/bulk.py`) and the replay workers (`projections/partitioned.py`) write what it queues.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

from domain import lifecycle
from projections.batch import BatchResult
from projections.fold import Decoded, Folded, decode_batch, fold_batch
from projections.writes import job_params

UPLOAD_COLUMNS = ("upload_id", "job_id", "filename", "size_bytes", "sha256", "priority", "broker_ts", "submitter",
                  "copies")


class FoldState:
    """The in-memory fold of a fresh replay: job rows, applied dedup keys, uploads, the log clock
    and positions, folded slice by slice with the projector's own `decode_batch` and `fold_batch`.

    Shared by the one-process bulk path (`BulkReplay`) and the replay workers
    (`projections/partitioned.py`). A job whose row reaches a final state is queued for writing
    (`take_final_rows`) and then kept as a `{"state": ...}` stub; dead letters and replay marks are
    queued in log order (`take_dead`).
    """

    native = False

    def __init__(self, clock_topic: str | None = None, dlq_topic: str | None = None, flush_rows: int = 2000) -> None:
        """`flush_rows`: final job rows (or slices with dead letters) queued before `flush_due`."""
        self.clock_topic, self.dlq_topic, self.flush_rows = clock_topic, dlq_topic, flush_rows
        self.rows: dict[str, dict[str, Any]] = {}
        self.seen = KeySet()
        self.uploads: dict[str, list] = {}
        """upload id -> `UPLOAD_COLUMNS` values (the first copy's fields, then the count of copies)."""
        self.clock: dict[int, Any] = {}
        self.positions: dict[tuple[str, int], int] = {}
        self.pending_final: list[str] = []
        self.pending_dead: list[tuple[list, list]] = []

    def fold(self, messages: list, end_positions: dict[tuple[str, int], int] | None,
             phases: dict[str, float]) -> tuple[BatchResult, Folded]:
        """Decode and fold one slice (in consumption order); seconds spent go to `phases` (decode, fold)."""
        started = time.perf_counter()
        result = BatchResult(records=len(messages), positions=self.positions)
        decoded: list[Decoded] = decode_batch(messages, result, end_positions)
        decoded_at = time.perf_counter()
        folded = fold_batch(decoded, self.rows, self.seen, result, self.clock_topic, self.dlq_topic,
                            binary_payload=True)
        # A job in a final state never changes again (lifecycle.evolve returns it as is, not applied, for
        # any later event, looking at its state only): its row is written at the next flush, then
        # only a stub stays in memory.
        rows = self.rows
        self.pending_final.extend(job_id for job_id in folded.changed if rows[job_id]["state"] in lifecycle.FINAL_STATES)
        if folded.dead or folded.replays:
            self.pending_dead.append((folded.dead, folded.replays))
        for upload in folded.uploads:  # upsert_upload: the first copy's fields, every copy counted
            kept = self.uploads.get(upload["upload_id"])
            if kept is None:
                self.uploads[upload["upload_id"]] = [upload[c] for c in UPLOAD_COLUMNS[:-1]] + [1]
            else:
                kept[-1] += 1
        for partition, now in folded.clock.items():  # advance_log_clock: never backwards
            if partition not in self.clock or now > self.clock[partition]:
                self.clock[partition] = now
        phases["decode"] = phases.get("decode", 0.0) + decoded_at - started
        phases["fold"] = phases.get("fold", 0.0) + time.perf_counter() - decoded_at
        return result, folded

    def final_count(self) -> int:
        """Final job rows queued."""
        return len(self.pending_final)

    def flush_due(self) -> bool:
        """Whether `flush_rows` final rows or slices with dead letters are queued."""
        return len(self.pending_final) >= self.flush_rows or len(self.pending_dead) >= self.flush_rows

    def take_final_rows(self) -> list[tuple]:
        """The queued final jobs' rows (`lifecycle.JOB_STATE_COLUMNS` order); they become stubs."""
        rows, taken = self.rows, []
        for job_id in self.pending_final:
            taken.append(_job_tuple(rows[job_id]))
            rows[job_id] = _FINAL_STUBS[rows[job_id]["state"]]
        self.pending_final = []
        return taken

    def take_dead(self) -> list[tuple[list, list]]:
        """The queued (dead letters, replay marks) of each slice that had some, in log order."""
        taken, self.pending_dead = self.pending_dead, []
        return taken

    def open_rows(self) -> Iterator[tuple]:
        """Rows of the jobs not written yet (`lifecycle.JOB_STATE_COLUMNS` order); call after `take_final_rows`."""
        return (_job_tuple(row) for row in self.rows.values() if row.get("job_id") is not None)


_FINAL_STUBS = {state: {"state": state} for state in lifecycle.FINAL_STATES}
"""What stays in memory of a job whose row was written in a final state (no `job_id`: not written again)."""


class KeySet:
    """The set of applied dedup keys, stored compactly: `{job_id}:{rest}` as one set of `rest` per
    job id, each distinct `rest` (e.g. `transcode:1:Heartbeat:17`, shared by every job) stored once.
    About 20 bytes per key instead of ~170 for a set of strings. Keys without `:` go in a plain set.
    Supports what `fold_batch` uses (`in`, `add`) and iteration (the full keys, for the final COPY).
    """

    def __init__(self) -> None:
        self.by_head: dict[str, set[str]] = {}
        self.rests: dict[str, str] = {}
        self.plain: set[str] = set()
        self.count = 0

    def __contains__(self, key: str) -> bool:
        head, sep, rest = key.partition(":")
        if not sep:
            return key in self.plain
        rests = self.by_head.get(head)
        if rests is not None and rest in rests:
            return True
        self._missed = (key, head, rest)  # `fold_batch` adds a key right after finding it missing
        return False

    _missed: tuple[str, str, str] = ("", "", "")

    def add(self, key: str) -> None:
        missed = self._missed
        if key is missed[0]:
            head, sep, rest = missed[1], ":", missed[2]
        else:
            head, sep, rest = key.partition(":")
        if not sep:
            if key not in self.plain:
                self.plain.add(key)
                self.count += 1
            return
        rests = self.by_head.get(head)
        if rests is None:
            rests = self.by_head[head] = set()
        if rest not in rests:
            rests.add(self.rests.setdefault(rest, rest))
            self.count += 1

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        yield from self.plain
        for head, rests in self.by_head.items():
            for rest in rests:
                yield f"{head}:{rest}"


def _job_tuple(row: dict[str, Any]) -> tuple:
    params = job_params(row)
    return tuple(params[c] for c in lifecycle.JOB_STATE_COLUMNS)

"""Both fold engines on the same records: `fold_both` runs the Python one (`bulk.FoldState`, as the
bulk replay uses it) and the native one (`native.NativeFoldState` over `tapeline_native`) and gathers
everything each made; `assert_same` compares it all (evidence rows, final and open job rows, dedup
keys, uploads, clock, positions, dead letters, counts). `require_native` is the rule of the native
tests: where cargo exists the engine must be built, so they fail instead of skipping."""

from __future__ import annotations

import json
import re
import shutil
import struct
from datetime import datetime, timedelta, timezone
from types import ModuleType


from domain import lifecycle
from tests.conftest import missing_under_ci
from projections import native, writes
from projections.bulk import FoldState
from projections.native import EngineSetup, NativeFoldState


def require_native() -> ModuleType:
    """`tapeline_native`, for a test module's top level. Without cargo on PATH and without the module
    the calling module is skipped (nothing could build it), except under CI (`CI` set: .ci/run's bootstrap
    builds it), where that fails; otherwise the module must import and be
    built from this repository's `schemas/lifecycle.json`, or collecting the test module fails (CI has
    cargo: a broken or stale build fails it instead of skipping the engine's tests)."""
    if shutil.which("cargo") is None and native.tapeline_native is None:
        missing_under_ci("no cargo on PATH and tapeline_native not built: the native engine cannot be tested "
                         "here (under CI the bootstrap should have built it)", module_level=True)
    import tapeline_native  # an ImportError here fails the collection, as it should where cargo exists

    native.check_build()  # NativeUnsupported for a build from another lifecycle.json
    return tapeline_native


JOBS, DLQ, UPLOADS = "t.jobs", "t.dlq", "t.uploads"
EPOCH_2000 = datetime(2000, 1, 1, tzinfo=timezone.utc)
FLOAT_COLUMNS = {"source_duration_s", "lease_s", "progress_out_time_s", "progress_speed", "progress_grace_s"}
TS_COLUMNS = {"leased_until", "progress_at", "created_at", "updated_at", "completed_at", "queued_at",
              "last_heartbeat_at", "retry_due_at"}
INT_COLUMNS = {"attempt", "attempts", "source_size_bytes", "source_width", "source_height", "progress_frames",
               "events", "log_partition", "yields", "redrives", "retry_next_attempt", "budget_base"}


def parse_evidence(data: bytes) -> list[tuple]:
    """Binary COPY rows (writes.EVIDENCE_TYPES) back into Python values."""
    rows, pos = [], 0
    while pos < len(data):
        (count,), pos = struct.unpack_from(">h", data, pos), pos + 2
        row = []
        for kind in writes.EVIDENCE_TYPES[:count]:
            (size,), pos = struct.unpack_from(">i", data, pos), pos + 4
            if size < 0:
                row.append(None)
                continue
            raw, pos = data[pos:pos + size], pos + size
            if kind == "text":
                row.append(raw.decode())
            elif kind in ("int4", "int8"):
                row.append(int.from_bytes(raw, "big", signed=True))
            elif kind == "timestamptz":
                row.append(EPOCH_2000 + timedelta(microseconds=int.from_bytes(raw, "big", signed=True)))
            elif kind == "bool":
                row.append(raw == b"\x01")
            else:  # the json payload: its text, kept as written (so the spelling must match too)
                json.loads(raw)
                row.append(raw.decode())
        rows.append(tuple(row))
    return rows


def parse_text_rows(chunks: list[bytes]) -> list[dict]:
    """Text COPY rows of job_state back into Python values."""
    rows = []
    for line in b"".join(chunks).decode().split("\n")[:-1]:  # (not splitlines: a value may hold U+2028)
        row = {}
        for column, field in zip(lifecycle.JOB_STATE_COLUMNS, line.split("\t")):
            if field == "\\N":
                row[column] = None
                continue
            field = unescape(field)
            if column in FLOAT_COLUMNS:
                row[column] = float(field)
            elif column in INT_COLUMNS:
                row[column] = int(field)
            elif column in TS_COLUMNS:
                row[column] = datetime.fromisoformat(field + ":00")
            elif column == "degraded":
                row[column] = field == "t"
            elif column in writes.JSON_COLUMNS:
                row[column] = json.loads(field)
            else:
                row[column] = field
        rows.append(row)
    return rows


COPY_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "b": "\b", "v": "\v", "f": "\f", "\\": "\\"}


def unescape(field: str) -> str:
    """A text COPY field's value (the escapes `encode.rs text_escaped` writes)."""
    return re.sub(r"\\(.)", lambda m: COPY_ESCAPES[m.group(1)], field)


def python_row(values: tuple) -> dict:
    row = dict(zip(lifecycle.JOB_STATE_COLUMNS, values))
    for column in writes.JSON_COLUMNS:
        if row[column] is not None:
            row[column] = row[column].obj
    return row


def fold_both(messages: list, slice_size: int = 97, flush_rows: int = 5,
              setup: EngineSetup | None = None) -> tuple[dict, dict]:
    """Fold `messages` with each engine (in slices of `slice_size`, final rows taken every
    `flush_rows` final jobs, as a replay does); what each made. `setup`: `native.engine_setup()`
    (computed per call when not given)."""
    made = {}
    for name, state in (("python", FoldState(JOBS, DLQ, flush_rows)),
                        ("native", NativeFoldState(JOBS, DLQ, flush_rows, setup=setup))):
        evidence, final, dead, counts = [], [], [], [0, 0, 0, 0, 0]
        for start in range(0, len(messages), slice_size):
            result, folded = state.fold(messages[start:start + slice_size], None, {})
            counts = [a + b for a, b in zip(counts, (result.records, result.applied, result.duplicates,
                                                     result.superseded, result.dead_letters))]
            if state.native:
                evidence += parse_evidence(folded)
                if state.flush_due():
                    final += parse_text_rows([state.take_final_rows_copy()])
            else:
                evidence += parse_evidence(bytes(writes.RowEncoder(writes.EVIDENCE_TYPES).encode(folded.evidence)))
                if state.flush_due():
                    final += [python_row(r) for r in state.take_final_rows()]
            dead += state.take_dead()
        if state.native:
            final += parse_text_rows([state.take_final_rows_copy()])
            open_rows = parse_text_rows(state.open_rows_copy())
            keys = {unescape(key) for key in b"".join(state.keys_copy()).decode().split("\n")[:-1]}
        else:
            final += [python_row(r) for r in state.take_final_rows()]
            open_rows = [python_row(r) for r in state.open_rows()]
            keys = set(state.seen)
        made[name] = {"evidence": evidence, "final": sorted(final, key=lambda r: r["job_id"]),
                      "open": sorted(open_rows, key=lambda r: r["job_id"]), "keys": keys, "dead": dead,
                      "counts": counts, "uploads": state.uploads, "clock": state.clock,
                      "positions": dict(state.positions)}
    return made["python"], made["native"]


def assert_same(python: dict, native: dict) -> None:
    assert native["counts"] == python["counts"]
    assert len(native["evidence"]) == len(python["evidence"])
    for ours, theirs in zip(native["evidence"], python["evidence"]):
        assert ours == theirs
    for kind in ("final", "open"):
        assert [r["job_id"] for r in native[kind]] == [r["job_id"] for r in python[kind]]
        for ours, theirs in zip(native[kind], python[kind]):
            ours, theirs = nan_named(ours), nan_named(theirs)
            assert ours == theirs, {c: (ours[c], theirs[c]) for c in ours if ours[c] != theirs[c]}
    for name in ("keys", "uploads", "clock", "positions"):
        assert native[name] == python[name], name
    assert plain(native["dead"]) == plain(python["dead"])


def nan_named(row: dict) -> dict:
    """`row` with each float NaN as the string "NaN" (NaN != NaN: two rows holding one would never be equal)."""
    return {c: "NaN" if isinstance(v, float) and v != v else v for c, v in row.items()}


def plain(dead: list) -> list:
    """Dead letters with their jsonb headers unwrapped (psycopg's `Jsonb` compares by identity)."""
    return [([{k: getattr(v, "obj", v) for k, v in d.items()} for d in letters], marks) for letters, marks in dead]

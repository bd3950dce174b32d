"""The native fold engine (`projections/native.py`, `native/`) against the Python one, record for record.

Both engines fold the same hand-made log (the replay benchmark's lifecycles, the golden files of
older writer schemas, poison records); every evidence row, job row, dedup key, upload, clock value,
position, dead letter and count must come out equal. (The real-services comparison, through
PostgreSQL, is `tests/integration/test_native_replay.py`.)
"""

from __future__ import annotations

import json
import random
import struct
from datetime import datetime, timedelta, timezone

import pytest

from bench import lifecycles
from domain import lifecycle
from projections import writes
from projections.bulk import FoldState
from projections.native import NativeFoldState, NativeUnsupported, tapeline_native
from domain import events as ev
from domain.codec import default_codec
from tapeline.clock import system_clock
from tests.fakelog import T0, FakeMessage

pytestmark = pytest.mark.skipif(tapeline_native is None, reason="tapeline_native is not built")

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
    for line in b"".join(chunks).decode().splitlines():
        row = {}
        for column, field in zip(lifecycle.JOB_STATE_COLUMNS, line.split("\t")):
            if field == "\\N":
                row[column] = None
                continue
            field = field.replace("\\t", "\t").replace("\\n", "\n").replace("\\r", "\r").replace("\\\\", "\\")
            if column in FLOAT_COLUMNS:
                row[column] = float(field)
            elif column in INT_COLUMNS:
                row[column] = int(field)
            elif column in TS_COLUMNS:
                row[column] = datetime.fromisoformat(field + ":00")
            elif column == "degraded":
                row[column] = field == "t"
            elif column in ("ladder", "outputs", "renditions"):
                row[column] = json.loads(field)
            else:
                row[column] = field
        rows.append(row)
    return rows


def python_row(values: tuple) -> dict:
    row = dict(zip(lifecycle.JOB_STATE_COLUMNS, values))
    for column in ("ladder", "outputs", "renditions"):
        if row[column] is not None:
            row[column] = row[column].obj
    return row


def fold_both(messages: list, slice_size: int = 97) -> tuple[dict, dict]:
    """Fold `messages` with each engine (in slices, final rows taken as they come); what each made."""
    made = {}
    for name, state in (("python", FoldState(JOBS, DLQ, 5)), ("native", NativeFoldState(JOBS, DLQ, 5))):
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
            keys = set(b"".join(state.keys_copy()).decode().splitlines())
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
            assert ours == theirs, {c: (ours[c], theirs[c]) for c in ours if ours[c] != theirs[c]}
    for name in ("keys", "uploads", "clock", "positions"):
        assert native[name] == python[name], name
    assert plain(native["dead"]) == plain(python["dead"])


def plain(dead: list) -> list:
    """Dead letters with their jsonb headers unwrapped (psycopg's `Jsonb` compares by identity)."""
    return [([{k: getattr(v, "obj", v) for k, v in d.items()} for d in letters], marks) for letters, marks in dead]


def message(topic: str, partition: int, offset: int, at_s: float, value: bytes | None) -> FakeMessage:
    ts = T0 + timedelta(seconds=at_s)
    return FakeMessage(topic, partition, offset, int(ts.timestamp() * 1000), value, b"key", [("h", b"v")])


def test_bench_lifecycles_fold_equal() -> None:
    codec, messages, offsets = default_codec(), [], {}
    rng = random.Random(3)
    for number, events in enumerate(lifecycles.jobs(11, 40, heartbeats=6, checkpoints=3)):
        partition = number % 3
        for event in events:
            topic = UPLOADS if isinstance(event, ev.UploadCompleted) else JOBS
            offset = offsets.get((topic, partition), 0)
            offsets[(topic, partition)] = offset + 1
            messages.append(message(topic, partition, offset, len(messages) * 0.37 + rng.random(),
                                    codec.encode(event.to_record())))
            if rng.random() < 0.05:  # a redelivered copy: a duplicate
                offsets[(topic, partition)] += 1
                messages.append(message(topic, partition, offset + 1, len(messages) * 0.37,
                                        codec.encode(event.to_record())))
    python, native = fold_both(messages)
    assert python["counts"][2] > 0 and python["final"]
    assert_same(python, native)


def test_golden_older_writers_fold_equal() -> None:
    messages = []
    for path in ("tests/golden/lifecycle-v1.records.jsonl", "tests/golden/providers-v1.records.jsonl"):
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                messages.append(message(JOBS, 0, len(messages), len(messages) * 1.5, bytes.fromhex(record["value_hex"])))
    python, native = fold_both(messages, slice_size=7)
    assert python["counts"][1] > 0
    assert_same(python, native)


def test_poison_records_are_dead_letters_in_both() -> None:
    codec = default_codec()
    accepted = next(iter(lifecycles.jobs(5, 1, heartbeats=2, checkpoints=1)))
    good = [codec.encode(e.to_record()) for e in accepted if not isinstance(e, ev.UploadCompleted)]
    nul = accepted[1].model_copy(update={"recorded_by": "intake@\x00x"})
    values = [good[0], b"not avro", None, good[1][:-3], good[1] + b"\x00", codec.encode(nul.to_record())] + good[1:]
    messages = [message(JOBS, 0, i, i * 2.0, value) for i, value in enumerate(values)]
    dead_letter = ev.DeadLetter.new(system_clock.stamp(), job_id="x", stage="intake", attempt=0, recorded_by="intake@a", correlation_id="c",
                                    source_topic="t.uploads", source_partition=0, source_offset=7, key=b"k",
                                    value=b"\x00\x01", headers={"h": b"v"}, error_class="invalid_input", error="bad",
                                    processor="intake")
    messages.append(message(DLQ, 0, 0, 99.0, codec.encode(dead_letter.to_record())))
    python, native = fold_both(messages, slice_size=4)
    assert python["counts"][4] == 6
    assert_same(python, native)


@pytest.mark.parametrize("lease", [float("nan"), float("inf"), 1e12, -1e14])
def test_a_lease_evolve_raises_on_is_the_same_dead_letter(lease) -> None:
    codec = default_codec()
    events = [e for e in next(iter(lifecycles.jobs(5, 1, heartbeats=2, checkpoints=1)))
              if not isinstance(e, ev.UploadCompleted)]
    events = [e.model_copy(update={"lease_s": lease}) if isinstance(e, ev.AttemptStarted) else e for e in events]
    messages = [message(JOBS, 0, i, i * 2.0, codec.encode(e.to_record())) for i, e in enumerate(events)]
    python, native = fold_both(messages, slice_size=3)
    assert python["counts"][4] >= 1
    assert_same(python, native)


def test_bytes_in_a_lifecycle_event_is_unsupported() -> None:
    dead_letter = ev.DeadLetter.new(system_clock.stamp(), job_id="x", stage="intake", attempt=0, recorded_by="intake@a", correlation_id="c",
                                    source_topic="t.uploads", source_partition=0, source_offset=7, key=b"k",
                                    value=b"v", headers={}, error_class="invalid_input", error="bad", processor="intake")
    with pytest.raises(NativeUnsupported, match="bytes"):
        NativeFoldState(JOBS, DLQ).fold([message(JOBS, 0, 0, 1.0, default_codec().encode(dead_letter.to_record()))],
                                        None, {})


def test_strings_that_need_escaping_come_out_equal() -> None:
    codec = default_codec()
    odd = 'quote " backslash \\ tab \t newline \n cr \r bell \x07 \x08 \x0b \x0c é \u2028 😀 end:: '
    events = [e for e in next(iter(lifecycles.jobs(6, 1, heartbeats=1, checkpoints=1)))
              if not isinstance(e, ev.UploadCompleted)]
    events = [e.model_copy(update={"reason": odd}) if "reason" in type(e).model_fields else e for e in events]
    events += [e.model_copy(update={"worker": odd, "dedup_key": e.dedup_key + odd})
               for e in events if isinstance(e, ev.AttemptStarted)]
    stall = ev.StallDetected.new(system_clock.stamp(), job_id=events[0].job_id, stage="transcode", attempt=1, recorded_by="w@" + odd,
                                 correlation_id=odd, kind="handoff", stalled_attempt=1, since_s=0.25, detail=odd)
    messages = [message(JOBS, 0, i, i * 2.0, codec.encode(e.to_record())) for i, e in enumerate(events + [stall])]
    python, native = fold_both(messages, slice_size=5)
    assert any(row[12] == "w@" + odd and json.loads(row[17])["detail"] == odd for row in python["evidence"])  # recorded_by, payload
    assert_same(python, native)

"""The native fold engine (`projections/native.py`, `native/`) against the Python one, record for record.

Both engines fold the same hand-made log (the replay benchmark's lifecycles, the golden files of
older writer schemas, poison records); every evidence row, job row, dedup key, upload, clock value,
position, dead letter and count must come out equal. (The real-services comparison, through
PostgreSQL, is `tests/integration/test_native_replay.py`; generated lifecycles over every event kind,
`tests/unit/test_fold_differential.py`.) Where cargo exists these tests must run: `require_native`.
"""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta, timezone

import pytest

from bench import lifecycles
from projections.native import NativeFoldState, NativeUnsupported
from domain import events as ev
from domain.lifecycle import ENDING as LIFECYCLE_ENDING
from domain.codec import default_codec
from tapeline.clock import system_clock
from tests.enginecompare import DLQ, JOBS, UPLOADS, assert_same, fold_both, require_native
from tests.fakelog import T0, FakeMessage

require_native()


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


def test_ending_events_without_the_claim_fold_equal() -> None:
    """Issue 44 item 6: an ending event without the running attempt's claim token ends the job only
    as its rule's `without_claim` says, in both engines (a stalled attempt's dead letter, a cancel)."""
    codec = default_codec()
    messages = []
    for number, kind in enumerate(sorted(LIFECYCLE_ENDING)):
        for stalled in (False, True):
            events = [e for e in next(iter(lifecycles.jobs(20 + 2 * number + stalled, 1, heartbeats=1, checkpoints=0)))
                      if not isinstance(e, ev.UploadCompleted)]
            started = next(i for i, e in enumerate(events) if isinstance(e, ev.AttemptStarted))
            head, job_id = events[:started + 1], events[0].job_id
            stage, attempt = head[-1].stage, head[-1].attempt
            common = dict(job_id=job_id, stage=stage, attempt=attempt, recorded_by="x@y", correlation_id="c")
            if stalled:
                head.append(ev.StallDetected.new(system_clock.stamp(), kind="lease_expired", stalled_attempt=attempt,
                                                 since_s=1.0, detail="d", **common))
            fields = {name: "javascript:alert(1)" if name == "master_url" else "r" for name in ("master_url", "reason")}
            model = ev.Event.registry[kind]
            extra = {"error_class": "transient", "attempts": 1, "evidence": "e", "operator": "o"}
            values = {k: v for k, v in {**fields, **extra}.items() if k in model.model_fields}
            head.append(model.new(system_clock.stamp(), **common, **values))
            messages += [message(JOBS, 0, len(messages) + i, (len(messages) + i) * 2.0, codec.encode(e.to_record()))
                         for i, e in enumerate(head)]
    python, native = fold_both(messages, slice_size=5)
    ended = sorted(row["state"] for row in python["final"] + python["open"] if row["state"] != "running")
    assert python["counts"][3] == 7 and ended == ["cancelled", "cancelled", "dead_lettered"], ended  # 7 superseded
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


def test_broker_times_after_2112_are_exact_in_both():
    """`projector.broker_time` was `fromtimestamp(millis / 1000.0)`: past about 2112 the float cannot
    hold a microsecond, so a broker time of 9999-12-31 22:00:00.001 came out as ...00.001007 (the
    native engine, exact, said .001000). Found by tests/unit/test_fold_differential.py."""
    from tapeline.ports import broker_time

    late = datetime(9999, 12, 31, 22, 0, 0, 1000, tzinfo=timezone.utc)
    millis = int((late - datetime(1970, 1, 1, tzinfo=timezone.utc)) / timedelta(milliseconds=1))
    assert broker_time(FakeMessage(JOBS, 0, 0, millis, b"")) == late
    events = [e for e in next(iter(lifecycles.jobs(5, 1, heartbeats=1, checkpoints=1)))
              if not isinstance(e, ev.UploadCompleted)]
    codec = default_codec()
    messages = [FakeMessage(JOBS, 0, i, millis + i * 7, codec.encode(e.to_record())) for i, e in enumerate(events)]
    python, native = fold_both(messages, slice_size=3)
    assert python["evidence"][0][3] == late
    assert_same(python, native)


def test_a_build_from_another_lifecycle_file_is_refused(monkeypatch):
    """The engine's constants come from schemas/lifecycle.json at build time (native/build.rs); a build
    from another version of the file (changed since, not rebuilt) must not fold: the replay falls back."""
    import types

    from projections import native
    from domain.lifecycle_data import PATH

    native.check_build()  # this build: from this file
    data = json.loads(PATH.read_text())
    data["reopenable_states"] = ["dead_lettered"]
    monkeypatch.setattr(native, "tapeline_native", types.SimpleNamespace(LIFECYCLE_JSON=json.dumps(data)))
    with pytest.raises(NativeUnsupported, match="built from another lifecycle.json"):
        native.check_build()
    with pytest.raises(NativeUnsupported, match="built from another lifecycle.json"):
        NativeFoldState(JOBS, DLQ)


def test_heartbeats_and_stalls_with_a_tool_state_fold_equal() -> None:
    """Issue 45: `Heartbeat.tool_state` and `StallDetected.tool_state` (a nullable nested record)
    come out of both engines as the same evidence payload, whole and with nulls."""
    codec = default_codec()
    events = [e for e in next(iter(lifecycles.jobs(7, 1, heartbeats=2, checkpoints=1)))
              if not isinstance(e, ev.UploadCompleted)]
    state = ev.ToolState(tool="ffmpeg", process_state="T", cpu_s=0.0, window_s=59.75, cpu_wait_s=1.5,
                         last_progress="frame=392 out_time=00:00:15.680000 progress=continue",
                         stderr_tail='error "one"\nerror two')
    bare = ev.ToolState(tool="ffmpeg")
    beats = [e for e in events if isinstance(e, ev.Heartbeat)]
    events = [e.model_copy(update={"tool_state": state if e is beats[0] else bare}) if isinstance(e, ev.Heartbeat)
              else e for e in events]
    stall = ev.StallDetected.new(system_clock.stamp(), job_id=events[0].job_id, stage="transcode", attempt=1,
                                 recorded_by="watchdog", correlation_id="c", kind="no_progress", stalled_attempt=1,
                                 since_s=121.0, detail="frames stuck at 392", tool_state=state)
    messages = [message(JOBS, 0, i, i * 2.0, codec.encode(e.to_record())) for i, e in enumerate(events + [stall])]
    python, native = fold_both(messages, slice_size=4)
    payloads = [json.loads(row[17]) for row in python["evidence"]]
    assert [p["tool_state"]["process_state"] for p in payloads if p.get("tool_state")] == ["T", None, "T"]
    assert_same(python, native)

"""Replay workers: how partitions are split, how a worker's end summary merges, and the COPY rows
a worker encodes without a connection (the integration test in test_replay.py replays with two
workers and compares with the live projection row for row)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from projections import partition_plan, partitioned, writes
from tapeline import kafka_scan
from projections.bulk import FoldState


def bounds(sizes: dict[tuple[str, int], int]) -> kafka_scan.Bounds:
    span = kafka_scan.Bounds()
    for position, size in sizes.items():
        span.start[position], span.stop[position] = 10, 10 + size
    return span


def test_split_balances_offsets_and_skips_empty_partitions():
    span = bounds({("jobs", 0): 900, ("jobs", 1): 500, ("jobs", 2): 400, ("jobs", 3): 0, ("uploads", 0): 100})
    parts = partition_plan.split(span, 2)
    assert [sorted(part.stop) for part in parts] == [[("jobs", 0), ("uploads", 0)], [("jobs", 1), ("jobs", 2)]]
    assert [part.total for part in parts] == [1000, 900]
    assert parts[0].start[("jobs", 0)] == 10 and parts[0].stop[("jobs", 0)] == 910


def test_split_never_makes_more_parts_than_partitions_with_records():
    span = bounds({("jobs", 0): 5, ("jobs", 1): 0})
    assert [sorted(part.stop) for part in partition_plan.split(span, 4)] == [[("jobs", 0)]]
    assert partition_plan.split(bounds({("jobs", 0): 0}), 2) == []


def test_merge_keeps_the_first_upload_by_broker_time_and_counts_every_copy():
    state, outcome = FoldState(), partition_plan.ParallelOutcome()
    early, late = datetime(2026, 1, 1, tzinfo=timezone.utc), datetime(2026, 1, 2, tzinfo=timezone.utc)

    def upload(ts, filename, copies):
        return ["u1", "j1", filename, 10, "abc", "standard", ts, "team", copies]

    summary = {"job_ids": {"j1"}, "counts": (3, 2, 1, 0, 0), "clock": {0: early}, "positions": {("jobs", 0): 7},
               "phases": {"fold": 1.5}, "rss_mb": 2.0}
    partition_plan.merge_summary(state, outcome, {**summary, "uploads": {"u1": upload(late, "late.mp4", 1)}})
    partition_plan.merge_summary(state, outcome, {**summary, "uploads": {"u1": upload(early, "early.mp4", 2)},
                                        "clock": {0: late - timedelta(hours=1)}, "positions": {("jobs", 1): 4}})
    assert state.uploads["u1"] == upload(early, "early.mp4", 3)
    assert state.clock == {0: late - timedelta(hours=1)}
    assert state.positions == {("jobs", 0): 7, ("jobs", 1): 4}
    counts = outcome.counts
    assert (counts.records, counts.applied, counts.duplicates) == (6, 4, 2)
    assert outcome.phases == {"fold": 3.0} and outcome.rss_mb == 4.0


def test_row_encoder_writes_copy_text_and_binary_rows():
    text = writes.RowEncoder()
    ts = datetime(2026, 11, 29, 12, 0, 0, 250000, tzinfo=timezone.utc)
    assert bytes(text.encode([("a\tb", 1, None, ts), ("c", 2, True, ts)])) == (
        b"a\\tb\t1\t\\N\t2026-11-29 12:00:00.250000+00:00\nc\t2\tt\t2026-11-29 12:00:00.250000+00:00\n")
    with pytest.raises(TypeError, match="binary format"):
        text.encode([("a", b"\x00")])
    binary = writes.RowEncoder(("text", "int8", "bytea"))
    assert bytes(binary.encode([("ab", 5, b"\x01{}")])) == (
        b"\x00\x03" + b"\x00\x00\x00\x02ab" + b"\x00\x00\x00\x08" + (5).to_bytes(8, "big")
        + b"\x00\x00\x00\x03\x01{}")


def test_peak_rss_is_this_program_s_own_not_its_parent_s():
    import subprocess
    import sys

    ballast = bytearray(300 * 1024 * 1024)  # this process is over 300 MB resident; a child it starts is not
    ballast[::4096] = b"x" * len(ballast[::4096])
    child = subprocess.run([sys.executable, "-c", "from projections.partitioned import peak_rss_mb; print(peak_rss_mb())"],
                           capture_output=True, text=True, check=True)
    assert partitioned.peak_rss_mb() > 300
    assert 5 < float(child.stdout) < 150


def test_a_job_seen_by_two_workers_is_found():
    assert partition_plan.jobs_in_several_workers([{"a", "b"}, {"c"}, {"d", "b"}, {"c", "e"}]) == {"b", "c"}
    assert partition_plan.jobs_in_several_workers([{"a"}, {"b"}, set()]) == set()

"""`projections.read_model.tier_backlog`: per-tier waiting/running/recently-completed counts from job_state."""

from __future__ import annotations

import uuid

from projections.read_model import open_reader, tier_backlog


def _insert(conn, state: str, priority: str | None, completed_ago_s: float | None = None) -> None:
    completed = None if completed_ago_s is None else f"now() - interval '{completed_ago_s} seconds'"
    conn.execute(
        "INSERT INTO job_state (job_id, upload_id, state, stage, priority, attempts, created_at, updated_at, completed_at) "
        f"VALUES (%s, %s, %s, 'transcode', %s, 1, now(), now(), {completed or 'NULL'})",
        (str(uuid.uuid4()), str(uuid.uuid4()), state, priority))


def test_counts_per_tier_and_drain_estimate(isolated):
    with open_reader(isolated) as conn:
        for state in ("accepted", "queued", "retry_scheduled", "running", "running"):
            _insert(conn, state, "index")
        _insert(conn, "queued", "archive")
        _insert(conn, "queued", None)  # a job without a tier counts as standard
        _insert(conn, "completed", "index", completed_ago_s=10)
        _insert(conn, "completed", "index", completed_ago_s=20)
        _insert(conn, "completed", "index", completed_ago_s=900)  # outside the window
        _insert(conn, "failed", "index")
        backlog = tier_backlog(conn, window_s=300)
    assert set(backlog) == {"archive", "standard", "index"}
    index = backlog["index"]
    assert (index.waiting, index.running, index.completed_recently, index.backlog) == (3, 2, 2, 5)
    assert index.drain_estimate_s(4) == 600.0  # 2 completions per 300 s -> 150 s per job
    assert (backlog["archive"].waiting, backlog["standard"].waiting) == (1, 1)
    assert backlog["archive"].drain_estimate_s() is None

"""The stall views select exactly what the stall rule calls stalled (real PostgreSQL).

`domain/policy/stall.py` is the rule; the views `stalled_attempts`, `stalled_handoffs` and
`expected_work_missing` pre-select candidates with the same comparisons so the watchdog reads few
rows. Seeded random projections (running and queued jobs on three partitions with their own log
clocks, uploads with and without jobs) go into a real database; each view must return the rows the
pure functions select, with the same kind and seconds.
"""

from __future__ import annotations

import dataclasses
import random
from datetime import datetime, timedelta, timezone

import psycopg
from psycopg.rows import dict_row

from domain.policy.stall import StallThresholds, attempt_stall, handoff_redrive_due, work_missing
from tapeline.postgres import q

THRESHOLDS = StallThresholds(no_progress_timeout_s=30.0, handoff_timeout_s=20.0, intake_timeout_s=40.0)
STAGE_NO_PROGRESS_S = {"thumbnails": 50.0, "archive": 10.0}
"""Stages with a no-progress timeout of their own (as the watchdog writes `StageSpec.no_progress_s`)."""


def thresholds_of(stage: str) -> StallThresholds:
    return dataclasses.replace(THRESHOLDS, no_progress_timeout_s=STAGE_NO_PROGRESS_S.get(stage, 30.0))
CLOCKS = {0: datetime(2026, 12, 4, 12, 0, tzinfo=timezone.utc),
          1: datetime(2026, 12, 4, 12, 0, 7, 250_000, tzinfo=timezone.utc),
          2: datetime(2026, 12, 4, 11, 59, 51, tzinfo=timezone.utc)}


def maybe(rng: random.Random, value, none_share: float = 0.15):
    return None if rng.random() < none_share else value


def generated(seed: int = 26):
    rng = random.Random(seed)
    jobs, uploads = [], []
    for n in range(240):
        partition = rng.randrange(3)
        now = CLOCKS[partition]
        # Times around each threshold, a few exactly on it (the rule says "past": strictly before now).
        # A claim sets the last heartbeat and the lease together (both NULL before the first claim).
        heartbeat = maybe(rng, now - timedelta(seconds=rng.choice([0, 1, 4.5, 9, 10, 11, 25, 60]) + rng.random() * 0.01))
        lease_s = rng.choice([5.0, 10.0, 120.0])
        jobs.append({
            "job_id": f"j{n}", "upload_id": f"u{n}", "state": rng.choice(["running", "running", "queued", "completed"]),
            "stage": rng.choice(["transcode", "publish", "thumbnails", "archive"]), "attempt": rng.randint(1, 3), "log_partition": partition,
            "last_heartbeat_at": heartbeat,
            "leased_until": heartbeat and heartbeat + timedelta(seconds=lease_s),
            "progress_at": maybe(rng, now - timedelta(seconds=rng.choice([0, 9.5, 10, 10.5, 29.5, 30, 30.5, 45, 49.5,
                                                                             50.5, 100]))),
            "progress_grace_s": maybe(rng, rng.choice([0.0, 20.0, 80.0]), 0.6),
            "queued_at": maybe(rng, now - timedelta(seconds=rng.choice([0, 5, 19.9, 20, 20.1, 50])), 0.1),
            "redrives": rng.choice([0, 0, 1]),
        })
    newest = max(CLOCKS.values())
    for n in range(80):
        uploads.append({"upload_id": f"up{n}", "job_id": f"j{n}" if rng.random() < 0.3 else f"nojob{n}",
                        "broker_ts": newest - timedelta(seconds=rng.choice([0, 10, 39.9, 40, 40.1, 90]))})
    return jobs, uploads


def load(conn: psycopg.Connection, jobs: list[dict], uploads: list[dict]) -> None:
    conn.execute("DELETE FROM job_state")
    conn.execute("DELETE FROM uploads")
    conn.execute("DELETE FROM log_clock")
    for partition, now in CLOCKS.items():
        conn.execute("INSERT INTO log_clock (partition, now) VALUES (%s, %s)", (partition, now))
    conn.execute("UPDATE stall_policy SET no_progress_timeout_s = %s, handoff_timeout_s = %s, intake_timeout_s = %s",
                 (THRESHOLDS.no_progress_timeout_s, THRESHOLDS.handoff_timeout_s, THRESHOLDS.intake_timeout_s))
    conn.execute(q("set_stage_stall_policy"), {"stages": ["publish"], "no_progress_s": [5.0]})
    conn.execute(q("set_stage_stall_policy"), {"stages": list(STAGE_NO_PROGRESS_S),  # replaces, not adds
                                               "no_progress_s": list(STAGE_NO_PROGRESS_S.values())})
    for job in jobs:
        conn.execute(
            "INSERT INTO job_state (job_id, upload_id, state, stage, attempt, log_partition, last_heartbeat_at, "
            "leased_until, progress_at, progress_grace_s, queued_at, redrives, created_at, updated_at) "
            "VALUES (%(job_id)s, %(upload_id)s, %(state)s, %(stage)s, %(attempt)s, %(log_partition)s, "
            "%(last_heartbeat_at)s, %(leased_until)s, %(progress_at)s, %(progress_grace_s)s, %(queued_at)s, "
            "%(redrives)s, now(), now())", job)
    for upload in uploads:
        conn.execute("INSERT INTO uploads (upload_id, job_id, filename, size_bytes, sha256, priority, broker_ts) "
                     "VALUES (%(upload_id)s, %(job_id)s, 'a.mp4', 1, 'x', 'standard', %(broker_ts)s)", upload)


def test_the_stall_views_select_what_the_stall_rule_calls_stalled(isolated) -> None:
    jobs, uploads = generated()
    with psycopg.connect(isolated.database_url, row_factory=dict_row) as conn:
        load(conn, jobs, uploads)
        attempts = {(r["job_id"], r["kind"], round(r["since_s"], 3))
                    for r in conn.execute(q("stalled_attempts")).fetchall()}
        handoffs = {r["job_id"] for r in conn.execute(q("handoffs_due")).fetchall()}
        missing = {r["upload_id"] for r in conn.execute(q("expected_work_missing")).fetchall()}
        conn.rollback()

    expected_attempts = set()
    for job in jobs:
        if job["state"] != "running":
            continue
        stall = attempt_stall(leased_until=job["leased_until"], last_heartbeat_at=job["last_heartbeat_at"],
                              progress_at=job["progress_at"], progress_grace_s=job["progress_grace_s"],
                              now=CLOCKS[job["log_partition"]], thresholds=thresholds_of(job["stage"]))
        if stall is not None:
            expected_attempts.add((job["job_id"], stall.kind, round(stall.since_s, 3)))
    expected_handoffs = {job["job_id"] for job in jobs if job["state"] == "queued"
                         and handoff_redrive_due(queued_at=job["queued_at"], now=CLOCKS[job["log_partition"]],
                                                 thresholds=THRESHOLDS)}
    job_ids = {job["job_id"] for job in jobs}
    expected_missing = {u["upload_id"] for u in uploads
                        if work_missing(uploaded_at=u["broker_ts"], has_job=u["job_id"] in job_ids,
                                        now=max(CLOCKS.values()), thresholds=THRESHOLDS)}

    # The generated data reaches every branch, on both sides of every threshold.
    assert {kind for _, kind, _ in expected_attempts} == {"lease_expired", "no_progress"}
    by_stage = {j["job_id"]: j["stage"] for j in jobs}
    assert {by_stage[j] for j, kind, _ in expected_attempts if kind == "no_progress"} >= set(STAGE_NO_PROGRESS_S)
    assert 10 < len(expected_attempts) < sum(j["state"] == "running" for j in jobs)
    assert 0 < len(expected_handoffs) < sum(j["state"] == "queued" for j in jobs)
    assert 0 < len(expected_missing) < len(uploads)
    assert attempts == expected_attempts, (sorted(attempts - expected_attempts), sorted(expected_attempts - attempts))
    assert handoffs == expected_handoffs, (sorted(handoffs - expected_handoffs), sorted(expected_handoffs - handoffs))
    assert missing == expected_missing, (sorted(missing - expected_missing), sorted(expected_missing - missing))


def test_the_suspect_view_selects_what_the_rule_calls_suspect(isolated) -> None:
    """Issue 45 item 1: `suspect_attempts` pre-selects the running attempts `attempt_suspect` calls
    suspect (still for more than the fraction of their allowance or lease, not stalled yet); the
    reader (`read_model.suspect_attempts`) then decides with the rule and the view's thresholds."""
    from domain.policy.stall import attempt_suspect
    from projections import read_model as read

    jobs, uploads = generated()
    fraction = 0.6
    with psycopg.connect(isolated.database_url, row_factory=dict_row, autocommit=True) as conn:
        load(conn, jobs, uploads)
        conn.execute("UPDATE stall_policy SET suspect_fraction = %s", (fraction,))
        viewed = {r["job_id"] for r in conn.execute(q("suspect_attempts")).fetchall()}
        decided = {(s["job_id"], s["suspect_of"], s["since_s"], s["allowance_s"]) for s in read.suspect_attempts(conn)}
    expected = set()
    for job in jobs:
        if job["state"] != "running":
            continue
        found = attempt_suspect(leased_until=job["leased_until"], last_heartbeat_at=job["last_heartbeat_at"],
                                progress_at=job["progress_at"], progress_grace_s=job["progress_grace_s"],
                                now=CLOCKS[job["log_partition"]],
                                thresholds=dataclasses.replace(thresholds_of(job["stage"]), suspect_fraction=fraction))
        if found is not None:
            expected.add((job["job_id"], found.kind, round(found.still_s, 3), round(found.allowance_s, 3)))
    assert {kind for _, kind, _, _ in expected} == {"no_progress", "lease"}  # both branches reached
    assert 5 < len(expected) < sum(j["state"] == "running" for j in jobs)
    assert viewed == {job_id for job_id, _, _, _ in expected}, (sorted(viewed ^ {e[0] for e in expected}))
    assert decided == expected

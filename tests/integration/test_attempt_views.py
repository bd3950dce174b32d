"""The `attempts` and `stage_durations` views (migration 006) against real PostgreSQL: hand-made
lifecycles with exact broker times through the projector's own `apply_batch`, and one real video
through the whole pipeline."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import psycopg
import pytest

from processors.runtime import transact
from cli.wiring import build_runtime
from projections import read_model as read
from projections.projector import apply_batch
from tapeline.kafka import broker_time
from tapeline.postgres import connect, migrate
from domain import events as ev
from domain.codec import default_codec
from tapeline.samples import sample_video
from tapeline.clock import system_clock
from tests.conftest import tapeline_cli
from tests.fakelog import FakeLog, at
from tests.integration.helpers import committed_messages
from tests.integration.test_projector import lifecycle

pytestmark = pytest.mark.integration
SCHEMA = "handmade"
MEDIA = ev.SourceMedia(format_name="mov", duration_s=5.28, width=1280, height=720, display_width=1280,
                       display_height=720, rotation=0, fps=25.0, frames=132, video_codec="h264")
LADDER = [ev.Rendition(name="720p", width=1280, height=720, video_bitrate_kbps=2800)]


class Job:
    """Builds one job's events with the real models."""

    def __init__(self) -> None:
        self.upload_id = f"u-{uuid.uuid4()}"
        self.job_id = ev.job_id_for(self.upload_id)
        self.common = dict(job_id=self.job_id, recorded_by="test", correlation_id=self.upload_id)

    def accepted(self):
        return ev.JobAccepted.new(system_clock.stamp(), stage="intake", attempt=0, upload_id=self.upload_id, source_key="k",
                                  source_sha256="0" * 64, source_size_bytes=1, priority="standard", profile="default",
                                  media=MEDIA, ladder=LADDER, **self.common)

    def queued(self, stage, attempt):
        return ev.StageQueued.new(system_clock.stamp(), stage=stage, attempt=attempt, tier="standard", work_topic="w", **self.common)

    def started(self, stage, attempt, token, worker):
        return ev.AttemptStarted.new(system_clock.stamp(), stage=stage, attempt=attempt, claim_token=token, lease_s=10.0, worker=worker,
                                     work_topic="w", work_partition=0, work_offset=attempt, **self.common)

    def heartbeat(self, attempt, token, sequence, frames, out_time_s):
        return ev.Heartbeat.new(system_clock.stamp(), stage="transcode", attempt=attempt, claim_token=token, sequence=sequence,
                                frames_done=frames, out_time_s=out_time_s, speed=2.0, **self.common)

    def succeeded(self, stage, attempt, token):
        return ev.AttemptSucceeded.new(system_clock.stamp(), stage=stage, attempt=attempt, claim_token=token, outputs=[], renditions=LADDER,
                                       elapsed_s=1.0, **self.common)

    def event(self, cls, stage, attempt, token=None, **fields):
        return cls.new(system_clock.stamp(), stage=stage, attempt=attempt, claim_token=token, **fields, **self.common)


@pytest.fixture(scope="module")
def handmade(isolated):
    """Four jobs in one partition of a fake lifecycle topic, applied into schema `handmade`.

    J: attempt 1 stalls (a zombie heartbeat arrives late), 2 yields after one checkpoint, 3 fails,
       4 succeeds; publish succeeds; then a redelivery of two of its events (duplicates).
    K: attempt 1 still running.   L: attempt 1 ends with JobFailed.
    M: attempt 2 is claimed first; the older attempt 1's claim arrives after it (never applied).
    """
    log = FakeLog()
    j, k, l, m = Job(), Job(), Job(), Job()
    started_2 = j.started("transcode", 2, "b", "w2")
    succeeded_4 = j.succeeded("transcode", 4, "d")
    for at_s, event in [
        (0, j.accepted()), (1, j.queued("transcode", 1)), (3, j.started("transcode", 1, "a", "w1")),
        (5, j.heartbeat(1, "a", 1, 100, 4.0)), (7, j.heartbeat(1, "a", 2, 200, 8.0)),
        (20, j.event(ev.StallDetected, "transcode", 1, kind="lease_expired", stalled_attempt=1, since_s=13.0)),
        (20, j.event(ev.RetryScheduled, "transcode", 1, next_attempt=2, not_before=at(0), error_class="worker_lost",
                     occurred_at=at(0))),
        (20, j.queued("transcode", 2)),
        (21, j.heartbeat(1, "a", 3, 300, 12.0)),  # the zombie of attempt 1, late: superseded
        (22, started_2),
        (24, j.event(ev.CheckpointRecorded, "transcode", 2, "b", sequence=0, segment_index=0, rendition="720p",
                     object_key="work/x/0.ts", sha256="1" * 64, frames=100, media_start_s=0.0, media_duration_s=4.0)),
        (26, j.event(ev.AttemptYielded, "transcode", 2, "b", reason="SIGTERM")),
        (26, j.queued("transcode", 3)),
        (30, j.started("transcode", 3, "c", "w1")),
        (31, j.event(ev.AttemptFailed, "transcode", 3, "c", error_class="storage_transient", retryable=True,
                     reason="S3 503")),
        (31, j.event(ev.RetryScheduled, "transcode", 3, "c", next_attempt=4, not_before=at(60),
                     error_class="storage_transient", occurred_at=at(0))),
        (91, j.queued("transcode", 4)),
        (92, j.started("transcode", 4, "d", "w2")),
        (93, j.heartbeat(4, "d", 1, 132, 5.28)),
        (100, succeeded_4), (100, j.queued("publish", 1)),
        (101, j.started("publish", 1, "p", "p1")),
        (102, j.succeeded("publish", 1, "p")),
        (102, j.event(ev.JobCompleted, "publish", 1, "p", master_url="http://x/m.m3u8")),
        (200, k.accepted()), (201, k.queued("transcode", 1)), (202, k.started("transcode", 1, "e", "w3")),
        (205, k.heartbeat(1, "e", 1, 50, 2.0)),
        (300, l.accepted()), (300, l.queued("transcode", 1)), (301, l.started("transcode", 1, "f", "w1")),
        (305, l.event(ev.JobFailed, "transcode", 1, "f", error_class="invalid_input", reason="bad")),
        (400, m.accepted()), (400, m.queued("transcode", 1)), (401, m.queued("transcode", 2)),
        (402, m.started("transcode", 2, "h", "w2")), (403, m.started("transcode", 1, "g", "w1")),
        (500, started_2), (500, succeeded_4),  # a redelivery: same events again, new offsets
    ]:
        log.append(at_s, event)
    migrate(isolated.database_url, SCHEMA)
    with connect(isolated.database_url, schema=SCHEMA, autocommit=True) as conn:
        conn.row_factory = psycopg.rows.dict_row
        result = apply_batch(conn, log.messages)
    assert result.duplicates == 2
    return {"j": j, "k": k, "l": l, "m": m}


def select(settings, sql, *params, schema=SCHEMA):
    with connect(settings.database_url, schema=schema) as conn:
        conn.row_factory = psycopg.rows.dict_row
        return conn.execute(sql, params).fetchall()


def attempts_of(settings, job_id, schema=SCHEMA):
    return {(r["stage"], r["attempt"]): r for r in select(
        settings, "SELECT * FROM attempts WHERE job_id = %s ORDER BY claim_offset", job_id, schema=schema)}


def test_one_row_per_attempt_with_outcome_waste_and_progress(isolated, handmade):
    rows = attempts_of(isolated, handmade["j"].job_id)
    assert list(rows) == [("transcode", 1), ("transcode", 2), ("transcode", 3), ("transcode", 4), ("publish", 1)]
    summary = {key: (r["worker"], r["claim_token"], r["started_at"], r["ended_at"], r["outcome"], r["error_class"],
                     r["heartbeats"], r["progress_frames"], r["segments"], r["late_events"], r["wasted_s"])
               for key, r in rows.items()}
    assert summary == {
        ("transcode", 1): ("w1", "a", at(3), at(20), "stalled", "worker_lost", 2, 200, 0, 1, 17.0),
        ("transcode", 2): ("w2", "b", at(22), at(26), "yielded", None, 0, None, 1, 0, 4.0),
        ("transcode", 3): ("w1", "c", at(30), at(31), "failed", "storage_transient", 0, None, 0, 0, 1.0),
        ("transcode", 4): ("w2", "d", at(92), at(100), "succeeded", None, 1, 132, 0, 0, 0.0),
        ("publish", 1): ("p1", "p", at(101), at(102), "succeeded", None, 0, None, 0, 0, 0.0),
    }
    stalled = rows[("transcode", 1)]
    assert (stalled["progress_out_time_s"], stalled["last_heartbeat_at"]) == (8.0, at(7))
    assert stalled["last_event_at"] == at(21)  # the zombie's late heartbeat
    assert stalled["duration_s"] == 17.0 and rows[("transcode", 4)]["duration_s"] == 8.0
    assert stalled["lease_s"] == 10.0


def test_running_failed_by_job_and_never_current_claims(isolated, handmade):
    running = attempts_of(isolated, handmade["k"].job_id)[("transcode", 1)]
    assert (running["outcome"], running["ended_at"], running["wasted_s"], running["duration_s"]) == \
        ("running", None, None, None)
    assert (running["heartbeats"], running["progress_frames"], running["last_event_at"]) == (1, 50, at(205))

    failed = attempts_of(isolated, handmade["l"].job_id)[("transcode", 1)]
    assert (failed["outcome"], failed["error_class"], failed["ended_at"], failed["wasted_s"]) == \
        ("failed", "invalid_input", at(305), 4.0)

    m = attempts_of(isolated, handmade["m"].job_id)
    assert [(key, r["outcome"], r["ended_at"], r["wasted_s"]) for key, r in m.items()] == [
        (("transcode", 2), "running", None, None),
        (("transcode", 1), "superseded", at(403), 0.0)]


def test_stage_durations(isolated, handmade):
    rows = {r["stage"]: r for r in select(isolated, "SELECT * FROM stage_durations WHERE job_id = %s",
                                          handmade["j"].job_id)}
    transcode, publish = rows["transcode"], rows["publish"]
    assert (transcode["queued_at"], transcode["first_started_at"], transcode["succeeded_at"]) == (at(1), at(3), at(100))
    assert (transcode["queue_wait_s"], transcode["run_s"], transcode["wasted_s"], transcode["total_s"]) == \
        (2.0, 17.0 + 4.0 + 1.0 + 8.0, 17.0 + 4.0 + 1.0, 99.0)
    assert (transcode["attempts"], transcode["times_queued"]) == (4, 4)
    assert (publish["queued_at"], publish["first_started_at"], publish["succeeded_at"], publish["queue_wait_s"],
            publish["run_s"], publish["wasted_s"], publish["total_s"], publish["attempts"]) == \
        (at(100), at(101), at(102), 1.0, 1.0, 0.0, 2.0, 1)
    running = select(isolated, "SELECT * FROM stage_durations WHERE job_id = %s", handmade["k"].job_id)
    assert [(r["stage"], r["queue_wait_s"], r["run_s"], r["succeeded_at"], r["total_s"], r["attempts"])
            for r in running] == [("transcode", 1.0, 0.0, None, None, 1)]


def test_the_read_model_counts_a_running_attempt_and_reused_segments(isolated, handmade):
    """Issue 45: the view counts ended attempts only ("run time 0 s" for an attempt running 30 s); the
    read model adds the running attempt's seconds so far. And the media a job's stage holds in applied
    checkpoints (`with_checkpoints`, the share of `percent_done` a retry reuses) is read from evidence."""
    from projections.presenter import percent_done

    settings = isolated.model_copy(update={"db_schema": SCHEMA})
    with read.open_reader(settings) as conn:
        running = read.stage_durations(conn, handmade["k"].job_id, now=at(232))  # claimed at 202
        assert [(d["stage"], d["run_s"], d["running"]) for d in running] == [("transcode", 30.0, True)]
        ended = read.stage_durations(conn, handmade["j"].job_id, now=at(232))
        assert [(d["stage"], d["run_s"], d["running"]) for d in ended] == [("transcode", 30.0, False),
                                                                           ("publish", 1.0, False)]
        j = read.job_row(conn, handmade["j"].job_id)
        assert j["checkpointed_s"] is None  # completed: nothing to count
        waiting = read.with_checkpoints(conn, [{**j, "state": "retry_scheduled", "stage": "transcode"}])[0]
        assert waiting["checkpointed_s"] == 4.0  # attempt 2's segment 0, 0.0 + 4.0 s of media
        assert percent_done(waiting) == pytest.approx(5.0 + 85.0 * 4.0 / 5.28, abs=0.05)


def test_views_are_documented_and_live_in_each_schema(isolated, handmade):
    for schema in ("public", SCHEMA):
        undocumented = select(isolated, """
            SELECT c.relname, a.attname FROM pg_attribute a
            JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = %s AND c.relname IN ('attempts', 'stage_durations') AND a.attnum > 0
              AND col_description(c.oid, a.attnum) IS NULL""", schema)
        assert undocumented == []
        views = select(isolated, "SELECT table_name FROM information_schema.views WHERE table_schema = %s"
                                 " AND table_name IN ('attempts', 'stage_durations') ORDER BY 1", schema)
        assert [v["table_name"] for v in views] == ["attempts", "stage_durations"]
    assert select(isolated, "SELECT count(*) AS n FROM public.attempts")[0]["n"] == 0  # the other schema's rows only


def test_reader_role_may_read_the_views(isolated, handmade):
    role = select(isolated, "SELECT 1 FROM pg_roles WHERE rolname = 'tapeline_reader'")
    assert role, "role tapeline_reader is missing: `tapeline stack up` (as root) creates it"
    granted = select(isolated, "SELECT has_table_privilege('tapeline_reader', %s, 'SELECT') AS a,"
                               " has_table_privilege('tapeline_reader', %s, 'SELECT') AS b",
                     f"{SCHEMA}.attempts", f"{SCHEMA}.stage_durations")
    assert granted == [{"a": True, "b": True}]


def test_replay_into_a_schema_rebuilds_the_views(isolated, handmade):
    """`tapeline replay --into` migrates a fresh schema (006 included) and the views fill from the log."""
    runtime = build_runtime(isolated, "test")
    producer = runtime.events.transactional_producer(f"{isolated.app_name}.views-writer")
    events = lifecycle(f"u-{uuid.uuid4()}")
    transact(producer, lambda: runtime.produce(producer, [(isolated.jobs_topic, e) for e in events]))
    runtime.close()
    done = tapeline_cli(isolated, "replay", "--into", "views_rebuilt", "--json")
    assert done.returncode == 0, done.stderr
    rows = select(isolated, "SELECT stage, attempt, claim_token, outcome, error_class, heartbeats, progress_frames"
                            " FROM attempts WHERE job_id = %s", events[0].job_id, schema="views_rebuilt")
    # The zombie's AttemptFailed (another token) does not end the attempt; the JobFailed does.
    assert rows == [{"stage": "transcode", "attempt": 1, "claim_token": "t1", "outcome": "failed",
                     "error_class": "invalid_input", "heartbeats": 1, "progress_frames": 10}]


def test_real_video_one_clean_attempt_per_stage(isolated, pipeline):
    """A real run: exactly one succeeded attempt per stage with no waste, times equal to the log's."""
    done = tapeline_cli(isolated, "submit", str(sample_video("bigbuckbunny.mp4")), "--wait", "--json",
                        "--timeout", "300")
    result = json.loads(done.stdout)
    assert result["state"] == "completed", result
    job_id = result["job_id"]
    codec = default_codec()
    log = [(broker_time(m), ev.Event.from_record(codec.decode(m.value()))) for m in committed_messages(isolated)]
    log = [(ts, e) for ts, e in log if e.job_id == job_id]
    first = {}
    for ts, e in log:
        first.setdefault((e.event_type, e.stage), (ts, e))
    rows = attempts_of(isolated, job_id, schema="public")
    stages = ("transcode", "thumbnails", "publish")  # the default profile
    assert list(rows) == [(stage, 1) for stage in stages]
    for stage in stages:
        started_ts, started = first[("AttemptStarted", stage)]
        succeeded_ts, _ = first[("AttemptSucceeded", stage)]
        row = rows[(stage, 1)]
        heartbeats = [e for _, e in log if e.event_type == "Heartbeat" and e.stage == stage]
        checkpoints = [e for _, e in log if e.event_type == "CheckpointRecorded" and e.stage == stage]
        assert (row["outcome"], row["wasted_s"], row["error_class"], row["segments"], row["late_events"]) == \
            ("succeeded", 0.0, None, len(checkpoints), 0)
        assert (len(checkpoints) > 0) == (stage == "transcode")  # segments of every rendition, and the audio
        assert (row["worker"], row["claim_token"], row["started_at"], row["ended_at"]) == \
            (started.worker, started.claim_token, started_ts, succeeded_ts)
        assert row["heartbeats"] == len(heartbeats)
        assert row["duration_s"] == pytest.approx((succeeded_ts - started_ts).total_seconds(), abs=1e-6)
    durations = {r["stage"]: r for r in select(isolated, "SELECT * FROM stage_durations WHERE job_id = %s", job_id,
                                                 schema="public")}
    assert sorted(durations) == sorted(stages)
    for stage, row in durations.items():
        queued_ts, _ = first[("StageQueued", stage)]
        started_ts, _ = first[("AttemptStarted", stage)]
        succeeded_ts, _ = first[("AttemptSucceeded", stage)]
        assert (row["queued_at"], row["first_started_at"], row["succeeded_at"], row["attempts"], row["wasted_s"]) == \
            (queued_ts, started_ts, succeeded_ts, 1, 0.0)
        assert row["queue_wait_s"] == pytest.approx((started_ts - queued_ts) / timedelta(seconds=1), abs=1e-6)
        assert row["total_s"] == pytest.approx((succeeded_ts - queued_ts) / timedelta(seconds=1), abs=1e-6)


def test_status_of_a_job_lists_its_attempts(isolated, handmade):
    settings = isolated.model_copy(update={"db_schema": SCHEMA})
    job_id = handmade["j"].job_id
    done = tapeline_cli(settings, "status", job_id, "--json")
    assert done.returncode == 0, done.stderr
    history = json.loads(done.stdout)["attempt_history"]
    assert [(a["stage"], a["attempt"], a["worker"], a["outcome"], a["error_class"], a["duration_s"], a["wasted_s"])
            for a in history] == [
        ("transcode", 1, "w1", "stalled", "worker_lost", 17.0, 17.0),
        ("transcode", 2, "w2", "yielded", None, 4.0, 4.0),
        ("transcode", 3, "w1", "failed", "storage_transient", 1.0, 1.0),
        ("transcode", 4, "w2", "succeeded", None, 8.0, 0.0),
        ("publish", 1, "p1", "succeeded", None, 1.0, 0.0)]
    assert history[0]["started_at"] == at(3).isoformat() and history[0]["ended_at"] == at(20).isoformat()
    diagnosis = json.loads(done.stdout)["diagnosis"]  # domain/diagnosis.py over this job's applied events
    assert (diagnosis["summary"], diagnosis["stall"], diagnosis["permanent"]) == (
        "Completed; it recovered by itself after transcode attempt 1 stalled: the worker stopped heartbeating; "
        "transcode attempt 3 failed: storage_transient (S3 503). Other jobs of the same file: 1 failed, 2 running.",
        "the worker stopped heartbeating", None)  # the handmade jobs K, L and M share J's upload sha256
    text = tapeline_cli(settings, "status", job_id)
    assert "what to do: Nothing to do. If this repeats on one worker host or one file, look there." in text.stdout
    assert "transcode attempt 1 by w1: stalled (worker_lost), started 00:00:03 UTC, ran 17.0 s, wasted 17.0 s" \
        in text.stdout
    with read.open_reader(settings) as conn:
        durations = read.stage_durations(conn, job_id)
    assert [(d["stage"], d["attempts"], d["total_s"]) for d in durations] == [("transcode", 4, 99.0),
                                                                              ("publish", 1, 2.0)]


def test_every_table_and_view_of_a_migrated_schema_is_documented_column_by_column(isolated):
    """Issue 6: tables and views documented column by column, in the database (`\\d+` shows it).
    The stall views, the log clock and the stall policy had no comments before migration 019."""
    undocumented = select(isolated, """
        SELECT c.relname || '.' || a.attname AS name FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relkind IN ('r', 'v') AND a.attnum > 0 AND NOT a.attisdropped
          AND col_description(c.oid, a.attnum) IS NULL ORDER BY 1""")
    assert [r["name"] for r in undocumented] == []
    bare = select(isolated, """
        SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND c.relkind IN ('r', 'v') AND obj_description(c.oid, 'pg_class') IS NULL
        ORDER BY 1""")
    assert [r["relname"] for r in bare] == []
    relations = select(isolated, "SELECT count(*) AS n FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                                 " WHERE n.nspname = 'public' AND c.relkind IN ('r', 'v')")
    assert relations[0]["n"] >= 20  # the check ran over the whole schema

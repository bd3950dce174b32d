"""The crash-point harness (issue 7, item 4): for every crash point in turn, a small real job runs
through the real pipeline, the process reaching that point is killed with SIGKILL, supervision
restarts it, and at the end:

- every crash point fired (covered);
- every job is completed, dead-lettered or in needs_review with a reason;
- the provider (a real HTTP server that does NOT dedupe) received exactly one post per completed
  job and none for any other;
- the log holds exactly one committed `JobCompleted` per completed job;
- the published objects are exactly one set per completed job;
- the projection equals a fold over the log.

One pipeline serves every point: the enabled point is switched through `TAPELINE_CRASH_POINTS_FILE`
and each fires once (`TAPELINE_CRASH_ONCE_DIR`).
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import psycopg
import pytest

from projections import fold
from schemas import models as ev
from schemas.codec import default_codec
from tapeline.crashpoints import PIPELINE_CRASH_POINTS
from tapeline.samples import sample_video
from tests.conftest import Pipeline, wait_for
from tests.faults.conftest import FAULT_TIMING, job_row
from tests.faults.test_publish_crashes import ProviderServer
from tests.faults.test_worker_faults import submit
from tests.integration.helpers import committed_messages, keys_under

pytestmark = pytest.mark.integration
ENDED = ("completed", "dead_lettered", "needs_review", "failed", "rejected")


def clip_for(point: str):
    """Transcode heartbeats need an encode longer than a heartbeat interval; the rest the smallest clip."""
    return sample_video("bigbuckbunny.mp4" if point.startswith("transcode.Heartbeat") else "carphone_pristine.mp4")


def fold_log(settings) -> dict[str, dict]:
    """The job rows a fold over the committed lifecycle log gives (the projector's rules, in memory)."""
    codec, rows, applied = default_codec(), {}, set()
    for message in committed_messages(settings):
        event = ev.Event.from_record(codec.decode(message.value()))
        if isinstance(event, ev.WatchdogTick) or event.dedup_key in applied:
            continue
        ts = datetime.fromtimestamp(message.timestamp()[1] / 1000, tz=timezone.utc)
        outcome = fold.evolve(rows.get(event.job_id), event, ts)
        if outcome.applied and outcome.row is not None:
            rows[event.job_id] = outcome.row
            applied.add(event.dedup_key)
    return rows


def test_every_crash_point_leaves_no_duplicate_and_no_lost_job(isolated, tmp_path):
    provider = ProviderServer(tmp_path)
    settings = isolated.model_copy(update={
        **FAULT_TIMING, "app_name": f"{isolated.app_name}-chaos-{uuid.uuid4().hex[:6]}", "webhook_url": provider.url,
        "webhook_dedupes": False, "restart_backoff_s": (0.5,), "max_attempts": 6})
    points_file, once = tmp_path / "crash-points", tmp_path / "crashed"
    points_file.write_text("")
    pipeline = Pipeline(settings, tmp_path / "run.log", extra_env={
        "TAPELINE_CRASH_POINTS_FILE": str(points_file), "TAPELINE_CRASH_ONCE_DIR": str(once)}).start()
    jobs: dict[str, str] = {}
    try:
        for point in PIPELINE_CRASH_POINTS:
            points_file.write_text(point + "\n")
            job_id = submit(settings, clip_for(point))
            jobs[job_id] = point
            wait_for(lambda: (lambda r: r and r["state"] in ENDED)(job_row(settings, job_id)), 120,
                     f"the job run with crash point {point} to end")
            wait_for(lambda: (once / point).exists(), 30, f"crash point {point} to fire")
            points_file.write_text("")
    finally:
        points_file.write_text("")
        pipeline.stop()
        provider_posts = provider.posts()
        provider.stop()
        print(pipeline.log_text()[-3000:])

    fired = {path.name for path in once.iterdir()}
    assert set(PIPELINE_CRASH_POINTS) <= fired, f"not covered: {sorted(set(PIPELINE_CRASH_POINTS) - fired)}"
    codec = default_codec()
    events = [ev.Event.from_record(codec.decode(m.value())) for m in committed_messages(settings)]
    folded = fold_log(settings)
    with psycopg.connect(settings.database_url, row_factory=psycopg.rows.dict_row) as conn:
        projected = {r["job_id"]: r for r in conn.execute("SELECT * FROM job_state").fetchall()}
    summary = {}
    for job_id, point in jobs.items():
        row = projected[job_id]
        state = row["state"]
        summary[point] = state
        assert state in ("completed", "dead_lettered", "needs_review"), (point, state, row["reason"])
        posts = [p for p in provider_posts if p["payload"]["job_id"] == job_id]
        completions = [e for e in events if e.job_id == job_id and isinstance(e, ev.JobCompleted)]
        if state == "completed":
            assert len(posts) == 1, (point, posts)
            assert len(completions) == 1, point
            publishes = [e for e in events if e.job_id == job_id and isinstance(e, ev.AttemptSucceeded)
                         and e.stage == "publish" and e.claim_token == row["claim_token"]]
            assert len(publishes) == 1, point
            assert keys_under(settings, f"published/{job_id}/") == {o.key for o in publishes[0].outputs}, point
        else:
            assert row["reason"], (point, state)
            assert posts == [] and completions == [], (point, state)
        for column in ("state", "stage", "attempt", "claim_token", "error_class", "master_url"):
            assert folded[job_id][column] == row[column], (point, column)
    # Only the crash between the claim marker and the provider call may need a person; it never posts.
    reviewed = {point for point, state in summary.items() if state == "needs_review"}
    assert reviewed <= {"publish.after_marker", "publish.Heartbeat.after_produce", "publish.Heartbeat.after_commit",
                        "publish.before_provider_call"}, summary
    print({"points": len(PIPELINE_CRASH_POINTS), "completed": list(summary.values()).count("completed"),
           "needs_review": sorted(reviewed)})

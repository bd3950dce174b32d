"""The crash-point harness (issue 7, item 4): every crash point is enabled once, a small real job
runs through the real pipeline, the process reaching that point is killed with SIGKILL, supervision
restarts it, and at the end:

- every crash point fired (covered);
- every job is completed, dead-lettered or in needs_review with a reason;
- the provider (a real HTTP server that does NOT dedupe) received exactly one post per completed
  job and none for any other;
- the log holds exactly one committed `JobCompleted` per completed job;
- the published objects are exactly one set per completed job;
- the projection equals a fold over the log.

One pipeline serves every point: the enabled points are switched through `TAPELINE_CRASH_POINTS_FILE`
and each fires once (`TAPELINE_CRASH_ONCE_DIR`). The points run in rounds of one job each
(`tapeline.crashpoints.crash_point_rounds`): a round enables at most one point per process (intake,
each stage, projector, watchdog), so one job meets several kills, each in a different process, and
the 53 points take 15 jobs instead of 53.
"""

from __future__ import annotations

import uuid

import pytest

from domain import pipeline
from domain.lifecycle import TERMINAL_STATES
from devstack.chaos import ProviderProcess, audit
from tapeline.crashpoints import PIPELINE_CRASH_POINTS, crash_point_rounds
from tapeline.samples import sample_video
from tests.conftest import Pipeline, wait_for
from tests.faults.conftest import FAULT_TIMING, job_row
from producers.submit import publish, upload

pytestmark = pytest.mark.integration
NEEDS_A_PERSON = {"publish.after_marker", "publish.Heartbeat.after_produce", "publish.Heartbeat.after_commit",
                  "publish.before_provider_call"}
"""A crash after the claim marker and before the provider call: the post may be in flight, the
provider does not dedupe, so the job waits for a person (never posted blindly)."""


def clip_for(points: tuple[str, ...]):
    """A media stage's heartbeats (transcode, thumbnails: `uses_media_tool` in the registry) need its
    ffmpeg to run longer than a heartbeat interval; a round without them the smallest clip."""
    def media_heartbeat(point: str) -> bool:
        stage, _, rest = point.partition(".")
        return rest.startswith("Heartbeat.") and stage in pipeline.BY_NAME and pipeline.spec(stage).uses_media_tool
    return sample_video("bigbuckbunny.mp4" if any(map(media_heartbeat, points)) else "carphone_pristine.mp4")


def test_every_crash_point_leaves_no_duplicate_and_no_lost_job(isolated, tmp_path):
    provider = ProviderProcess(tmp_path)
    settings = isolated.model_copy(update={
        **FAULT_TIMING, "app_name": f"{isolated.app_name}-chaos-{uuid.uuid4().hex[:6]}", "webhook_url": provider.url,
        "webhook_dedupes": False, "restart_backoff_s": (0.5,), "max_attempts": 6})
    points_file, once = tmp_path / "crash-points", tmp_path / "crashed"
    points_file.write_text("")
    pipeline = Pipeline(settings, tmp_path / "run.log", extra_env={
        "TAPELINE_CRASH_POINTS_FILE": str(points_file), "TAPELINE_CRASH_ONCE_DIR": str(once)}).start()
    jobs: dict[str, str] = {}
    try:
        for points, tier in crash_point_rounds(PIPELINE_CRASH_POINTS):
            points_file.write_text("".join(point + "\n" for point in points))
            submission = upload(settings, clip_for(points), priority=tier)
            publish(settings, submission.event)
            job_id = submission.job_id
            jobs[job_id] = ",".join(points)
            wait_for(lambda: (lambda r: r and r["state"] in TERMINAL_STATES)(job_row(settings, job_id)), 120,
                     f"the job run with crash points {points} to end")
            wait_for(lambda: all((once / point).exists() for point in points), 30,
                     f"crash points {[p for p in points if not (once / p).exists()]} to fire")
            points_file.write_text("")
    finally:
        points_file.write_text("")
        pipeline.stop()
        posts = provider.posts()
        provider.stop()
        print(pipeline.log_text()[-3000:])

    fired = {path.name for path in once.iterdir()}
    assert set(PIPELINE_CRASH_POINTS) <= fired, f"not covered: {sorted(set(PIPELINE_CRASH_POINTS) - fired)}"
    result = audit(settings, jobs, posts)
    assert result.violations == []
    assert (result.duplicates, result.lost, result.jobs) == (0, 0, len(crash_point_rounds(PIPELINE_CRASH_POINTS)))
    assert result.dead_lettered == []
    # a job waits for a person only when its round had a point between the claim marker and the post
    assert all(set(label.split(",")) & NEEDS_A_PERSON for label in result.needs_review), result.needs_review
    assert result.completed == result.jobs - len(result.needs_review)
    print({"points": len(PIPELINE_CRASH_POINTS), "completed": result.completed,
           "needs_review": sorted(result.needs_review)})

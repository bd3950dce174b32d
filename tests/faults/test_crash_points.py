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

import pytest

from domain import pipeline
from domain.lifecycle import TERMINAL_STATES
from devstack.chaos import ProviderProcess, audit
from tapeline.crashpoints import PIPELINE_CRASH_POINTS, tier_for_point
from tapeline.samples import sample_video
from tests.conftest import Pipeline, wait_for
from tests.faults.conftest import FAULT_TIMING, job_row
from producers.submit import publish, upload

pytestmark = pytest.mark.integration
NEEDS_A_PERSON = {"publish.after_marker", "publish.Heartbeat.after_produce", "publish.Heartbeat.after_commit",
                  "publish.before_provider_call"}
"""A crash after the claim marker and before the provider call: the post may be in flight, the
provider does not dedupe, so the job waits for a person (never posted blindly)."""


def clip_for(point: str):
    """A media stage's heartbeats (transcode, thumbnails: `uses_media_tool` in the registry) need its
    ffmpeg to run longer than a heartbeat interval; the rest the smallest clip."""
    stage, _, rest = point.partition(".")
    media_heartbeat = rest.startswith("Heartbeat.") and stage in pipeline.BY_NAME and pipeline.spec(stage).uses_media_tool
    return sample_video("bigbuckbunny.mp4" if media_heartbeat else "carphone_pristine.mp4")


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
        for point in PIPELINE_CRASH_POINTS:
            points_file.write_text(point + "\n")
            submission = upload(settings, clip_for(point), priority=tier_for_point(point))
            publish(settings, submission.event)
            job_id = submission.job_id
            jobs[job_id] = point
            wait_for(lambda: (lambda r: r and r["state"] in TERMINAL_STATES)(job_row(settings, job_id)), 120,
                     f"the job run with crash point {point} to end")
            wait_for(lambda: (once / point).exists(), 30, f"crash point {point} to fire")
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
    assert (result.duplicates, result.lost, result.jobs) == (0, 0, len(PIPELINE_CRASH_POINTS))
    assert result.dead_lettered == []
    assert set(result.needs_review) <= NEEDS_A_PERSON, result.needs_review
    assert result.completed == len(PIPELINE_CRASH_POINTS) - len(result.needs_review)
    print({"points": len(PIPELINE_CRASH_POINTS), "completed": result.completed,
           "needs_review": sorted(result.needs_review)})

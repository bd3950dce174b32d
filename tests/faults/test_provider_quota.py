"""A provider quota counted across publish processes (issue 9, items 4 and 7): two publish workers
(`publish_workers`, started by `tapeline run --role all`) and four jobs against a quota of two posts
per 5-second window (the window is a setting; the defaults are a minute and a day). The provider
server's own receive times never show more than two posts inside any 5-second window, the jobs
that met the full window were deferred (without using an attempt) and every job completes with
exactly one post."""

from __future__ import annotations

from pathlib import Path

import pytest

from devstack.chaos import ProviderProcess
from tapeline.samples import sample_video
from tests.conftest import Pipeline
from tests.faults.conftest import job_row
from tests.faults.test_worker_faults import submit, wait_state
from tests.integration.helpers import committed_events, of_job

pytestmark = pytest.mark.integration

WINDOW_S = 5.0


def test_two_publish_workers_never_exceed_a_per_window_quota(fault_settings, tmp_path: Path):
    provider = ProviderProcess(tmp_path)
    settings = fault_settings.model_copy(update={
        "webhook_url": provider.url, "webhook_quota": 2, "webhook_quota_window_s": WINDOW_S,
        "publish_workers": 2, "transcode_workers": 2})
    pipeline = Pipeline(settings, tmp_path / "run.log").start()
    try:
        clips = ["carphone_distorted.mp4", "carphone_pristine.mp4", "carphone_distorted.mp4", "carphone_pristine.mp4"]
        jobs = [submit(settings, sample_video(name)) for name in clips]
        rows = [wait_state(settings, job_id, timeout_s=150) for job_id in jobs]
        publish_children = sorted(name for name in _child_roles(pipeline) if name == "publish")
    finally:
        pipeline.stop()
        posts = provider.posts()
        provider.stop()
    assert publish_children == ["publish", "publish"]  # two publish processes shared the quota
    assert {r["state"] for r in rows} == {"completed"}
    assert sorted(p["payload"]["job_id"] for p in posts) == sorted(jobs)  # exactly one post per job
    times = sorted(p["received_at"] for p in posts)
    # No window of WINDOW_S seconds holds more than two posts, as the provider clocked them.
    assert all(later - earlier >= WINDOW_S for earlier, later in zip(times, times[2:])), times
    events = committed_events(settings)
    deferred = [d for job_id in jobs for d in of_job(events, job_id, "PublishDeferred")]
    assert deferred, "four posts at two per window: some attempt must have met a full window"
    assert {(d.wait, d.window, d.limit, d.window_s) for d in deferred} == {("quota", "minute", 2, WINDOW_S)}
    assert all(d.used >= 2 for d in deferred)
    for job_id in jobs:  # a deferral is retried at the freed slot and does not use up an attempt
        assert job_row(settings, job_id)["yields"] == len(of_job(events, job_id, "PublishDeferred"))
        for failed in of_job(events, job_id, "AttemptFailed"):
            assert (failed.error_class, "quota reached" in failed.reason) == ("provider_throttled", True)


def _child_roles(pipeline: Pipeline) -> list[str]:
    """The `--role` of every live child of the supervisor (several per stage with `*_workers`)."""
    return [role for role, _ in pipeline.child_roles()]

"""The submitter's own quota at intake (issue 5, class quota_exceeded): terminal `JobRejected`, no
attempt, the reason in `tapeline submit --wait --json` and the timeline; other submitters unaffected."""

from __future__ import annotations

import json

import pytest

from tapeline.samples import sample_video
from tests.conftest import Pipeline, tapeline_cli
from tests.integration.helpers import committed_events, of_job

pytestmark = pytest.mark.integration


def submit_as(settings, submitter: str) -> dict:
    done = tapeline_cli(settings, "submit", str(sample_video("carphone_pristine.mp4")), "--wait", "--json",
                        "--submitter", submitter, "--timeout", "120")
    return json.loads(done.stdout)


def test_a_submitter_past_its_daily_quota_is_rejected_and_others_are_not(isolated, tmp_path):
    settings = isolated.model_copy(update={"submitter_daily_quota": 1})
    pipeline = Pipeline(settings, tmp_path / "run.log").start()
    try:
        first = submit_as(settings, "alice")
        second = submit_as(settings, "alice")
        other = submit_as(settings, "bob")
    finally:
        pipeline.stop()
    assert first["state"] == "completed" and other["state"] == "completed"
    assert (second["state"], second["error_class"], second["attempts"]) == ("rejected", "quota_exceeded", 0)
    assert "submitter 'alice' reached its quota of 1 jobs per 24 h (1 accepted since" in second["reason"]
    events = of_job(committed_events(settings), second["job_id"])
    assert [e.event_type for e in events] == ["JobRejected"]  # nothing downloaded, probed or attempted
    timeline = tapeline_cli(settings, "timeline", second["job_id"])
    assert "JobRejected" in timeline.stdout and "quota_exceeded" in timeline.stdout

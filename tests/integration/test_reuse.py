"""Reuse of valid results against real services (issue 9, items 5 and 7): the same file submitted
twice completes the second time from the first job's published outputs with no transcode attempt;
once one of those outputs is gone, or with another profile, a real transcode runs."""

from __future__ import annotations

import pytest

from projections import read
from tapeline.cli import _detail
from tapeline.objectstore import ObjectStore
from tests.conftest import Pipeline, tapeline_cli, wait_for
from tests.integration.helpers import committed_events, keys_under, of_job
from tests.integration.roles import submit_upload, tiny_clips

pytestmark = pytest.mark.integration


def submit(settings, path, profile: str = "default") -> dict:
    """Submit in-process (a CLI process per job costs seconds on a loaded machine) and wait for the
    job to end; returns its `job_summary` (what `tapeline submit --wait --json` prints)."""
    job_id = submit_upload(settings, path, profile=profile)
    with read.open_reader(settings) as conn:
        row = wait_for(lambda: (lambda r: r if r and r["state"] in ("completed", "failed", "rejected") else None)(
            read.job_row(conn, job_id)), 120, f"job {job_id} to end")
        return read.job_summary(row)


def lifecycle(settings, job_id: str) -> list[str]:
    return [e.event_type for e in of_job(committed_events(settings), job_id) if e.event_type != "CheckpointRecorded"]


def test_same_file_reuses_outputs_until_one_is_missing_and_a_new_profile_transcodes(isolated, tmp_path):
    settings = isolated.model_copy(update={"reuse_results": True, "x264_preset": "ultrafast"})
    clip = tiny_clips(tmp_path, 1)[0]
    pipeline = Pipeline(settings, tmp_path / "run.log").start()
    try:
        first = submit(settings, clip)
        second = submit(settings, clip)
        # Remove one published segment of the first job: its result is no longer valid.
        published = sorted(keys_under(settings, f"published/{first['job_id']}/"))
        segment = next(k for k in published if k.endswith(".ts"))
        ObjectStore(settings).delete(segment)
        third = submit(settings, clip)
        other_profile = submit(settings, clip, profile="small")
    finally:
        pipeline.stop()
    assert [r["state"] for r in (first, second, third, other_profile)] == ["completed"] * 4

    # The second job: no attempt at all, its completion names the first job and its outputs.
    assert lifecycle(settings, second["job_id"]) == ["JobAccepted", "ResultReused", "JobCompleted"]
    assert (second["attempts"], second["reused_from"], second["master_url"]) == (0, first["job_id"],
                                                                                 first["master_url"])
    assert second["outputs"] == first["outputs"]
    reused = of_job(committed_events(settings), second["job_id"], "ResultReused")[0]
    assert reused.reused_job_id == first["job_id"]
    assert {o.key for o in reused.outputs} == set(published)  # every published object was verified
    assert keys_under(settings, f"published/{second['job_id']}/") == set()  # no second output set
    status = tapeline_cli(settings, "status", second["job_id"])
    assert f"reused the published outputs of job {first['job_id']}" in status.stdout, status.stderr
    with read.open_reader(settings) as conn:
        details = {r["event_type"]: _detail(r) for r in read.timeline(conn, second["job_id"])}
    assert details["ResultReused"].startswith(f"reused_job_id={first['job_id']} objects={len(published)} verified=all")

    # The third: the first's result is incomplete, so a real transcode (of its own outputs).
    assert "AttemptStarted" in lifecycle(settings, third["job_id"])
    assert (third["attempts"], third["reused_from"]) == (1, None)
    assert third["master_url"] != first["master_url"]
    # Another profile (a different fingerprint) never reuses, even with a valid result present.
    assert "AttemptStarted" in lifecycle(settings, other_profile["job_id"])
    assert (other_profile["attempts"], other_profile["reused_from"]) == (1, None)
    accepted = {e.job_id: e for e in committed_events(settings) if e.event_type == "JobAccepted"}
    assert accepted[first["job_id"]].profile_fingerprint == accepted[third["job_id"]].profile_fingerprint
    assert accepted[other_profile["job_id"]].profile_fingerprint != accepted[first["job_id"]].profile_fingerprint

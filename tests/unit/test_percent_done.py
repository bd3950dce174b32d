"""`projections.presenter.percent_done`: only a completed job shows 100 % (issue 20 item 6: a cancelled job that
never ran showed "done 100 %")."""

from __future__ import annotations

import pytest

from projections.presenter import percent_done


def row(state: str, stage: str, **extra) -> dict:
    return {"state": state, "stage": stage, "source_duration_s": 10.0, "progress_out_time_s": None, **extra}


def test_only_a_completed_job_is_done():
    assert percent_done(row("completed", "publish")) == 100.0


@pytest.mark.parametrize("state", ["cancelled", "rejected", "failed", "dead_lettered", "needs_review"])
def test_a_job_that_ended_otherwise_shows_where_it_stopped(state):
    assert percent_done(row(state, "intake")) == 0.0
    assert percent_done(row(state, "transcode")) == 5.0
    assert percent_done(row(state, "publish")) == 90.0


def test_a_running_transcode_counts_media_seconds_encoded():
    assert percent_done(row("running", "transcode", progress_out_time_s=5.0)) == pytest.approx(47.5)


def test_segments_a_retry_reuses_count_as_done():
    """Issue 45: 12 % before a stall, 5.0 % after the retry although attempt 2 reused the finished
    segments. The checkpointed media (`checkpointed_s`, read_model.with_checkpoints) counts as done
    while the retry waits, is queued, and runs before its first heartbeat moves past it."""
    before = percent_done(row("running", "transcode", progress_out_time_s=4.0))
    for state in ("retry_scheduled", "queued", "running"):
        assert percent_done(row(state, "transcode", progress_out_time_s=0.0, checkpointed_s=4.0)) == before, state
    # the running attempt's own heartbeats win once they pass the checkpoints
    assert percent_done(row("running", "transcode", progress_out_time_s=6.0, checkpointed_s=4.0)) == \
        pytest.approx(5 + 85 * 0.6)
    # a queued job's stale heartbeat figure is not progress; nor are checkpoints once the job ended
    assert percent_done(row("queued", "transcode", progress_out_time_s=9.0)) == 5.0
    assert percent_done(row("dead_lettered", "transcode", checkpointed_s=9.0)) == 5.0


def test_one_wording_of_the_percent_for_every_view():
    """`job_summary` carries the number and its one printed form; the CLI list, `status`, the API and
    the dashboard's lists and job page print `percent_text` (11.6 %, never 12 in one and 11.6 in another)."""
    from projections.presenter import job_summary, percent_text

    assert percent_text(11.6) == "11.6 %" and percent_text(100.0) == "100.0 %"
    job = {**row("running", "transcode", progress_out_time_s=0.8, checkpointed_s=None), "job_id": "j", "attempt": 2,
           "attempts": 2, "error_class": None, "reason": None, "master_url": None, "renditions": [], "outputs": [],
           "leased_until": None, "progress_frames": 20, "updated_at": __import__("datetime").datetime(2026, 1, 1)}
    summary = job_summary(job)
    assert summary["percent_text"] == percent_text(summary["percent"]) == "11.8 %"
    assert (summary["stage"], summary["attempt"]) == ("transcode", 2)

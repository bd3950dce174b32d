"""`projections.read_model.percent_done`: only a completed job shows 100 % (issue 20 item 6: a cancelled job that
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

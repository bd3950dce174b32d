"""`tapeline status JOB`'s words (issue 45): no literal `None: None` line for a job that has no error,
no `frames 0` for a job not running, the stage's own attempt and the one percent wording."""

from __future__ import annotations

from datetime import datetime, timezone

from cli import job_commands
from cli.helpers import out
from projections.presenter import job_summary


def summary(state: str, **extra) -> dict:
    row = {"job_id": "j-1", "state": state, "stage": "publish", "attempt": 1, "attempts": 2,
           "source_duration_s": 10.0, "progress_out_time_s": None, "error_class": None, "reason": None,
           "master_url": None, "renditions": [], "outputs": [], "leased_until": None, "progress_frames": 0,
           "priority": "standard", "updated_at": datetime(2026, 12, 7, tzinfo=timezone.utc), **extra}
    return job_summary(row)


def printed(found: dict) -> str:
    with out.capture() as captured:
        job_commands._print_summary(found)
    return captured.get()


def test_a_job_without_an_error_prints_no_error_line():
    text = printed(summary("queued"))
    assert "None" not in text and text.splitlines()[0].startswith("job j-1: queued")
    failed = printed(summary("dead_lettered", error_class="output_conflict", reason="published/x exists"))
    assert "  output_conflict: published/x exists" in failed


def test_the_diagnosis_verdict_is_the_job_pages_word():
    found = {"summary": "s", "why": "output_conflict: a retry would meet the same object again until it is removed",
             "permanent": True, "verdict": "Permanent", "action": "a", "same_source": []}
    with out.capture() as captured:
        job_commands._print_diagnosis(found)
    assert "permanent: output_conflict: a retry would meet" in captured.get()


def test_the_progress_line_names_the_stages_own_attempt_and_no_frames_when_not_running():
    done = job_commands._progress_line(summary("completed", stage="publish", attempt=1, attempts=2))
    assert done == "  tier standard, publish attempt 1, 100.0 % done"  # not "publish / 2", no "frames 0"
    running = job_commands._progress_line(summary(
        "running", stage="transcode", attempt=2, progress_frames=392, progress_out_time_s=1.0,
        leased_until=datetime(2026, 12, 7, 12, tzinfo=timezone.utc)))
    assert running == "  tier standard, transcode attempt 2, 13.5 % done; lease until 2026-12-07T12:00:00+00:00; " \
                      "frames 392"

"""A job out of attempts is dead-lettered and an operator replay completes it (issue 5, items 4
and 5), against the real services. Its own module: its own topics, free of the poison records of
test_dead_letters.py."""

from __future__ import annotations

import pytest

from tapeline.samples import sample_video
from tests.conftest import Pipeline, tapeline_cli
from tests.faults.conftest import job_row
from tests.faults.test_worker_faults import assert_completed_once, submit, wait_state
from tests.integration.helpers import committed_events, of_job
from tests.integration.test_dead_letters import dlq_list

pytestmark = pytest.mark.integration


def test_a_job_out_of_attempts_is_dead_lettered_and_an_operator_replay_completes_it(isolated, tmp_path):
    settings = isolated.model_copy(update={"max_attempts": 2, "retry_backoff_s": (1.0,), "retry_jitter": 0.0})
    broken = Pipeline(settings, tmp_path / "broken.log",
                      extra_env={"TAPELINE_FAIL_POINTS": "transcode.download:storage_transient"}).start()
    try:
        job_id = submit(settings, sample_video("carphone_pristine.mp4"))
        row = wait_state(settings, job_id, "dead_lettered", timeout_s=120)
    finally:
        broken.stop()
    assert (row["attempt"], row["error_class"]) == (2, "storage_transient")
    events = of_job(committed_events(settings), job_id)
    assert [(e.attempt, e.error_class) for e in of_job(events, job_id, "AttemptFailed")] == \
        [(1, "storage_transient"), (2, "storage_transient")]
    dead = of_job(events, job_id, "JobDeadLettered")
    assert len(dead) == 1 and dead[0].attempts == 2
    on_dlq = of_job(committed_events(settings, settings.dlq_topic), job_id, "JobDeadLettered")
    assert [e.event_id for e in on_dlq] == [dead[0].event_id]

    letter_id = f"{job_id}/2"
    listed = dlq_list(settings, "--reason", "storage_transient")  # not the records of the test before
    assert [(r["id"], r["kind"], r["attempts"], r["replayed_at"]) for r in listed] == [(letter_id, "job", 2, None)]
    assert dlq_list(settings, "--reason", "timeout") == []
    shown = tapeline_cli(settings, "dlq", "show", letter_id)
    assert shown.returncode == 0 and "injected failure at transcode.download" in shown.stdout

    # The operator fixes storage (here: a pipeline without the injected fault) and replays.
    fixed = Pipeline(settings, tmp_path / "fixed.log").start()
    try:
        replayed = tapeline_cli(settings, "dlq", "replay", letter_id, "--why", "storage fixed", "--operator", "ops")
        assert replayed.returncode == 0, replayed.stderr
        assert "replayed, transcode attempt 3 queued" in replayed.stdout
        assert wait_state(settings, job_id, timeout_s=180)["state"] == "completed"
        again = tapeline_cli(settings, "dlq", "replay", letter_id, "--why", "again", "--operator", "ops2")
        assert again.returncode == 0 and "skipped, already replayed by ops" in again.stdout
        everything = tapeline_cli(settings, "dlq", "replay", "--all", "--why", "sweep")
        assert everything.returncode == 0 and "nothing to replay" in everything.stdout
        events = assert_completed_once(settings, job_id)
    finally:
        fixed.stop()
    replays = of_job(events, job_id, "JobReplayed")
    assert [(e.operator, e.reason, e.dead_letter_id) for e in replays] == [("ops", "storage fixed", letter_id)]
    assert [e.attempt for e in of_job(events, job_id, "AttemptStarted") if e.stage == "transcode"] == [1, 2, 3]
    final = job_row(settings, job_id)
    assert final["budget_base"] == 2 and final["state"] == "completed"
    [letter] = [r for r in dlq_list(settings) if r["kind"] == "job"]
    assert (letter["replayed_by"], letter["replay_reason"]) == ("ops", "storage fixed")
    timeline = tapeline_cli(settings, "timeline", job_id)
    assert "JobReplayed" in timeline.stdout and "JobDeadLettered" in timeline.stdout

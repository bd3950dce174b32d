"""The diagnosis of every incident kind, with its exact text (issue 26 item 1; domain/diagnosis.py)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from domain.diagnosis import diagnose

NOW = datetime(2026, 12, 4, 12, 0, 0, tzinfo=timezone.utc)
JOB = "j-1"


def row(state, stage="transcode", attempt=1, **fields):
    return {"job_id": JOB, "state": state, "stage": stage, "attempt": attempt, "attempts": attempt,
            "error_class": None, "reason": None, "worker": None, "retry_next_attempt": None, "retry_due_at": None,
            "queued_at": None, "reused_from": None, **fields}


def event(event_type, stage="transcode", attempt=1, **payload):
    return {"event_type": event_type, "stage": stage, "attempt": attempt, "payload": payload}


def stalled(kind, attempt=1, detail=""):
    return event("StallDetected", attempt=attempt, kind=kind, stalled_attempt=attempt, detail=detail)


@pytest.mark.parametrize("kind, words", [
    ("no_progress", "ffmpeg stopped advancing while its worker was alive"),
    ("lease_expired", "the worker stopped heartbeating"),
    ("worker_exited", "the worker process exited (worker process 41 killed by SIGKILL)"),
])
def test_each_stall_kind_retried_and_recovered(kind, words):
    found = diagnose(row("completed", "publish"), [stalled(kind, detail="worker process 41 killed by SIGKILL")], [], NOW)
    assert found.summary == f"Completed; it recovered by itself after transcode attempt 1 stalled: {words}."
    assert found.stall == words
    assert found.action == "Nothing to do. If this repeats on one worker host or one file, look there."
    assert found.permanent is None


def test_a_clean_completion_and_a_reused_result():
    assert diagnose(row("completed", "publish"), [], [], NOW).summary == "Completed without a failed or stalled attempt."
    reused = diagnose(row("completed", "publish", reused_from="j-0"), [], [], NOW)
    assert reused.summary == "Completed by reusing the outputs of job j-0 (same file and profile); no transcode ran."


def test_a_stall_waiting_for_its_retry_and_a_retry_waiting_for_a_worker():
    due = NOW + timedelta(seconds=30)
    waiting = diagnose(row("retry_scheduled", error_class="progress_stalled", retry_next_attempt=2, retry_due_at=due),
                       [stalled("no_progress")], [], NOW)
    assert waiting.summary == ("Transcode attempt 1 stalled: ffmpeg stopped advancing while its worker was alive; "
                               "attempt 2 is scheduled at 12:00:30 UTC.")
    assert (waiting.permanent, waiting.why, waiting.action) == (False, "progress_stalled: a retry may pass unless the source itself freezes ffmpeg",
                                                                "Nothing to do: it retries by itself.")
    queued = diagnose(row("queued", attempt=2, queued_at=NOW - timedelta(seconds=27)), [stalled("lease_expired")], [], NOW)
    assert queued.summary == ("Queued: transcode attempt 2 has waited for 27 s for a free worker. "
                              "Earlier: transcode attempt 1 stalled: the worker stopped heartbeating.")
    assert queued.action == ("Nothing to do unless it waits long; then check that transcode workers run "
                             "(tapeline status).")
    handoff = diagnose(row("queued", queued_at=NOW - timedelta(seconds=95)),
                       [event("StallDetected", kind="handoff", stalled_attempt=1)] * 2, [], NOW)
    assert handoff.summary == ("Queued: transcode attempt 1: no worker picked the work up; the watchdog sent it "
                               "again 2 time(s), the last 95 s ago.")
    assert handoff.stall == "no worker picked the work up"
    assert handoff.action == "Check that transcode workers run and are not all busy (tapeline status, /health/deep)."
    older = diagnose(row("queued", attempt=2), [event("StallDetected", kind="handoff", stalled_attempt=1)], [], NOW)
    assert (older.summary, older.stall) == ("Queued: transcode attempt 2 has waited for a free worker.", None)


def test_running():
    found = diagnose(row("running", worker="transcode@h:12"), [], [], NOW)
    assert (found.summary, found.action) == ("Running: transcode attempt 1 on transcode@h:12.",
                                             "Nothing to do while it progresses; the watchdog acts if it stops.")


def test_a_permanent_failure():
    found = diagnose(row("failed", error_class="unsupported_media", reason="rendition audio: 3.008 s long"), [], [], NOW)
    assert found.summary == "Failed for good at transcode: unsupported_media: rendition audio: 3.008 s long."
    assert (found.permanent, found.why, found.action) == (
        True, "unsupported_media: a retry would fail the same way: the same input fails the same way every time",
        "Do not replay: ask the submitter for a corrected file.")


def test_a_job_an_operator_failed_for_good_says_who_not_that_its_class_is_permanent():
    events = [event("JobDeadLettered", error_class="storage_transient"), event("JobReplayed", operator="ops"),
              event("JobFailed", error_class="storage_transient", operator="ops", refunded=True,
                    reason="failed for good by ops: corrupt (quota refunded)")]
    found = diagnose(row("failed", error_class="storage_transient",
                         reason="failed for good by ops: corrupt (quota refunded)"), events, [], NOW)
    assert found.summary == ("Dead-lettered at transcode (storage_transient), then failed for good by ops: corrupt "
                             "(quota refunded).")
    assert (found.permanent, found.why) == (True, "an operator ended it for good")
    assert "not retryable" not in found.summary + found.action


def test_dead_lettered_after_retries_is_replayable_once_the_cause_is_fixed():
    events = [event("AttemptFailed", attempt=n, error_class="storage_transient", reason="S3 answered 503")
              for n in (1, 2, 3)] + [event("JobDeadLettered", attempt=3, error_class="storage_transient")]
    found = diagnose(row("dead_lettered", attempt=3, error_class="storage_transient",
                         reason="out of attempts: S3 answered 503"), events, [], NOW)
    assert found.summary == ("Dead-lettered after 3 attempt(s) of transcode: storage_transient "
                             "(out of attempts: S3 answered 503).")
    assert (found.permanent, found.why) == (False, "storage_transient: a retry may pass once the object "
                                                   "store works again")
    assert found.action == 'Fix the object store, then replay: `tapeline dlq replay j-1/3 --why "..."`.'


def test_replayed_and_failed_the_same_way_again_is_permanent():
    first = [event("AttemptFailed", attempt=n, error_class="unknown", reason="audio ran long") for n in (1, 2, 3)]
    again = [event("AttemptFailed", attempt=n, error_class="unknown", reason="audio ran long") for n in (4, 5, 6)]
    events = first + [event("JobDeadLettered", attempt=3, error_class="unknown"),
                      event("JobReplayed", attempt=3, operator="ops", reason="retry")] + \
        again + [event("JobDeadLettered", attempt=6, error_class="unknown")]
    found = diagnose(row("dead_lettered", attempt=6, error_class="unknown", reason="audio ran long"), events,
                     [{"job_id": "j-2", "state": "completed", "error_class": None}], NOW)
    assert found.summary == ("Dead-lettered after 6 attempt(s) of transcode: unknown (audio ran long). It had been "
                             "replayed and failed the same way again. Other jobs of the same file: 1 completed.")
    assert (found.permanent, found.why) == (True, "the same error came back after a replay")
    assert found.action.startswith("Do not replay again until the cause is found")
    assert found.same_source == ({"job_id": "j-2", "state": "completed", "error_class": None},)


def test_the_same_file_dead_lettered_in_another_job_is_permanent():
    found = diagnose(row("dead_lettered", attempt=3, error_class="progress_stalled", reason="stalled"),
                     [event("JobDeadLettered", attempt=3, error_class="progress_stalled")],
                     [{"job_id": "j-0", "state": "dead_lettered", "error_class": "progress_stalled"}], NOW)
    assert (found.permanent, found.why) == (True, "job j-0 of the same file ended dead_lettered with progress_stalled")
    assert found.action == ("Do not replay: the same file failed the same way in another job; ask the submitter "
                            "for a new file.")


def test_needs_review_cancelled_and_rejected():
    review = diagnose(row("needs_review", "publish", reason="a claim marker of attempt 1 and no post found"), [], [], NOW)
    assert review.summary == "Waiting for a person: a claim marker of attempt 1 and no post found."
    assert review.action == ("Look the post up at the provider, then `tapeline review resolve j-1 --posted REF` "
                             "or `--not-posted`.")
    cancelled = diagnose(row("cancelled"), [event("JobCancelled", operator="alice", reason="wrong file")], [], NOW)
    assert (cancelled.summary, cancelled.permanent) == ("Cancelled by alice: wrong file.", None)
    rejected = diagnose(row("rejected", "intake", 0, error_class="invalid_input", reason="not a video"), [], [], NOW)
    assert (rejected.summary, rejected.action) == ("Rejected at intake: invalid_input: not a video.",
                                                   "Nothing to do: the submitter must send a valid file.")
    quota = diagnose(row("rejected", "intake", 0, error_class="quota_exceeded", reason="alice used 10 of 10 today"),
                     [], [], NOW)
    assert (quota.summary, quota.why) == ("Rejected at intake: alice used 10 of 10 today.",
                                          "quota_exceeded: a retry would be refused the same way until the "
                                          "submitter's quota allows it")


def test_the_infrastructure_failing_again_says_nothing_about_the_file():
    """storage_transient, broker_transient and provider_throttled are not the file's doing
    (`ErrorClass.from_the_file`): neither another job of the same file nor a replay that met the
    same outage makes the job permanent."""
    letter = event("JobDeadLettered", attempt=3, error_class="storage_transient")
    other = {"job_id": "j-0", "state": "dead_lettered", "error_class": "storage_transient"}
    found = diagnose(row("dead_lettered", attempt=3, error_class="storage_transient", reason="S3 answered 503"),
                     [letter], [other], NOW)
    assert (found.permanent, found.why) == (False, "storage_transient: a retry may pass once the object "
                                                   "store works again")
    assert found.action == 'Fix the object store, then replay: `tapeline dlq replay j-1/3 --why "..."`.'
    again = diagnose(row("dead_lettered", attempt=6, error_class="broker_transient", reason="no leader"),
                     [event("JobDeadLettered", attempt=3, error_class="broker_transient"),
                      event("JobReplayed", attempt=3, operator="ops", reason="retry"),
                      event("JobDeadLettered", attempt=6, error_class="broker_transient")], [], NOW)
    assert again.summary == ("Dead-lettered after 6 attempt(s) of transcode: broker_transient (no leader). It had "
                             "been replayed and failed the same way again.")
    assert again.permanent is False
    assert again.action == 'Fix Kafka (Kafka still failed after the replay), then replay: ' \
                           '`tapeline dlq replay j-1/6 --why "..."`.'


def test_which_classes_the_file_can_cause():
    from domain.policy.retry import ERROR_CLASSES

    assert {c.name for c in ERROR_CLASSES.values() if not c.from_the_file} == \
        {"storage_transient", "output_conflict", "broker_transient", "provider_throttled", "quota_exceeded",
         "region_lost"}


def test_an_output_conflict_names_the_object_in_the_way_and_both_ways_out():
    """An `output_conflict` (issue 45): permanent by the error table (a retry meets the same object
    until it is removed), its why in the table's words (never "a retry may pass"), its summary naming
    the object (key, size, sha256, when written, from the dead letter's `in_the_way`) and its action
    the two real commands, each said once."""
    from domain.diagnosis import diagnose

    key = "published/j-9/master.m3u8"
    job = {"job_id": "j-9", "state": "dead_lettered", "stage": "publish", "attempt": 1, "attempts": 1,
           "error_class": "output_conflict", "reason": f"{key} already exists with different content"}
    blocking = {"key": key, "sha256": "ab" * 32, "size_bytes": 41, "written_at": "2026-12-07T11:00:05.123000Z"}
    events = [{"event_type": "JobDeadLettered", "stage": "publish", "attempt": 1,
               "payload": {"error_class": "output_conflict", "in_the_way": blocking}}]
    found = diagnose(job, events, [], NOW)
    assert found.permanent is True and found.verdict == "Permanent"
    assert found.why == "output_conflict: a retry would meet the same object again until it is removed"
    assert found.summary.endswith(f"In the way: `{key}` (41 bytes, sha256 {'ab' * 32}, written 2026-12-07 11:00:05 "
                                  "UTC).")
    assert 'tapeline dlq replay j-9/1 --why "..."' in found.action
    assert 'tapeline dlq fail j-9/1 --refund --why "..."' in found.action
    assert f"aws s3 rm s3://BUCKET/{key}" in found.action
    assert found.action.count("replay j-9/1") == 1 and "may pass" not in found.why

    # replayed before the object was removed: the same words, and "again" agrees with permanent
    again = diagnose({**job, "attempt": 2}, events + [
        {"event_type": "JobReplayed", "stage": "publish", "attempt": 1, "payload": {"operator": "ops"}},
        {"event_type": "JobDeadLettered", "stage": "publish", "attempt": 2,
         "payload": {"error_class": "output_conflict", "in_the_way": blocking}}], [], NOW)
    assert again.permanent is True and "failed the same way again" in again.summary
    assert "dlq replay j-9/2" in again.action

    # an older dead letter (before `in_the_way` was recorded) still reads, without the object's facts
    old = diagnose(job, [{**events[0], "payload": {"error_class": "output_conflict"}}], [], NOW)
    assert old.permanent is True and "In the way" not in old.summary and "aws s3 rm" not in old.action

"""The pure parts of the rescue of a dead worker (processors/rescue.py, tapeline/holdings.py)."""

from __future__ import annotations

import os
import signal
import subprocess
from datetime import datetime, timedelta, timezone

from processors.rescue import exit_detail, worker_exited_row
from processors.watchdog import run_once
from tapeline import holdings
from tapeline.settings import Settings
from tests.fakeclock import FixedClock

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)
CLOCK = FixedClock(NOW)  # the writer's clock the events are stamped with
HOLDING = holdings.Holding(pid=4242, job_id="j1", stage="transcode", attempt=1, claim_token="tok",
                           transactional_id="app.transcode.j1")


def job(**changes):
    row = {"job_id": "j1", "upload_id": "u1", "state": "running", "stage": "transcode", "attempt": 1,
           "attempts": 1, "claim_token": "tok", "priority": "standard", "progress_at": NOW - timedelta(seconds=3),
           "last_heartbeat_at": NOW - timedelta(seconds=1), "leased_until": NOW + timedelta(seconds=50),
           "progress_frames": 120, "log_partition": 0, "yields": 0, "budget_base": 0, "ladder": [],
           "source_key": "k", "source_sha256": "0" * 64, "profile": "default"}
    row.update(changes)
    return row


def test_exit_detail_names_the_signal_or_the_code():
    assert exit_detail(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_detail(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert exit_detail(1) == "exited with code 1"
    assert exit_detail(None) == "exited"


def test_only_the_very_claim_still_running_is_rescued():
    row = worker_exited_row(job(), HOLDING, "killed by SIGKILL", NOW)
    assert (row["kind"], row["detail"], row["since_s"]) == ("worker_exited", "worker process 4242 killed by SIGKILL", 3.0)
    assert worker_exited_row(None, HOLDING, "x", NOW) is None
    assert worker_exited_row(job(state="queued"), HOLDING, "x", NOW) is None  # already retried
    assert worker_exited_row(job(attempt=2), HOLDING, "x", NOW) is None  # a newer attempt
    assert worker_exited_row(job(claim_token="other"), HOLDING, "x", NOW) is None  # another claim
    assert worker_exited_row(job(progress_at=None, last_heartbeat_at=None), HOLDING, "x", NOW)["since_s"] == 0.0


def test_the_watchdog_rule_retries_it_at_once_with_the_exit_in_the_stall():
    settings = Settings()
    row = worker_exited_row(job(), HOLDING, "killed by SIGKILL", NOW)
    result = run_once([row], [], [], {"j1": job()}, settings, "supervisor@test:1", clock=CLOCK)
    kinds = [type(event).__name__ for _, event in result.outgoing]
    assert kinds == ["StallDetected", "RetryScheduled", "StageQueued", "WorkItem"]
    stall = result.outgoing[0][1]
    assert (stall.kind, stall.detail, stall.attempt) == ("worker_exited", "worker process 4242 killed by SIGKILL", 1)
    assert result.outgoing[2][1].attempt == 2 and result.counts["retry"] == 1


def test_holdings_of_earlier_incarnations_are_those_of_dead_processes(tmp_path):
    settings = Settings(home=tmp_path, app_name="app")
    dead = subprocess.Popen(["true"])
    dead.wait()
    holdings.record(settings, "transcode#2", HOLDING.__class__(**{**HOLDING.__dict__, "pid": dead.pid}))
    holdings.record(settings, "transcode#2", HOLDING.__class__(**{**HOLDING.__dict__, "pid": os.getppid()}))  # alive
    holdings.record(settings, "transcode#2", HOLDING.__class__(**{**HOLDING.__dict__, "pid": os.getpid()}))  # own
    holdings.record(settings, "transcode", HOLDING.__class__(**{**HOLDING.__dict__, "pid": dead.pid}))  # other name
    found = holdings.left_by_earlier_incarnations(settings, "transcode#2", os.getpid())
    assert [h.pid for h in found] == [dead.pid]
    assert holdings.read(settings, "transcode#2", dead.pid) == found[0]
    holdings.release(settings, "transcode#2", dead.pid)
    assert holdings.read(settings, "transcode#2", dead.pid) is None
    assert holdings.left_by_earlier_incarnations(settings, "transcode#2", os.getpid()) == []


def test_a_stopped_process_is_alive_and_a_zombie_is_not():
    child = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        assert holdings.process_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = datetime.now() + timedelta(seconds=5)
        while holdings.process_alive(child.pid) and datetime.now() < deadline:
            pass  # a zombie until reaped below
        assert not holdings.process_alive(child.pid)
    finally:
        child.wait()
    assert not holdings.process_alive(child.pid)

"""Why a tool stopped advancing, in words (`domain/policy/tool_state.py`, issue 45 item 2): the
stopped, starving (no CPU, waiting), I/O-bound and looping (full CPU) cases, and the diagnosis that
quotes them. Real processes in these states: tests/integration/test_tool_watch.py."""

from __future__ import annotations

from datetime import datetime, timezone

from domain.diagnosis import diagnose
from domain.policy.tool_state import explain_tool_state, tool_evidence


def state(letter: str | None, cpu_s: float | None = 0.0, window_s: float | None = 60.0, **more):
    return {"tool": "ffmpeg", "process_state": letter, "cpu_s": cpu_s, "window_s": window_s,
            "last_progress": None, "stderr_tail": None, **more}


def test_a_stopped_process_was_stopped_by_a_signal():
    assert explain_tool_state(state("T", cpu_s=3.0)).startswith("ffmpeg was stopped by a signal (process state T)")
    assert "stopped by a signal" in explain_tool_state(state("t"))


def test_waiting_on_io_with_no_cpu():
    assert explain_tool_state(state("D", cpu_s=0.01, window_s=120)) == (
        "ffmpeg used no CPU for 120 s while waiting on I/O (process state D: a disk or network file system)")
    assert explain_tool_state(state("D", cpu_s=4.0, window_s=60)).startswith("ffmpeg used 4.0 s of CPU for 60 s")


def test_starving_asleep_with_no_cpu():
    assert explain_tool_state(state("S", cpu_s=0.0, window_s=45)) == (
        "ffmpeg used no CPU for 45 s while sleeping (waiting on input, a pipe or a lock)")


def test_looping_at_full_cpu_without_output():
    assert explain_tool_state(state("R", cpu_s=59.0, window_s=60)) == (
        "ffmpeg ran at full CPU without output (59 s of CPU in 60 s): a loop, or a decode that makes no frames")
    # several threads busy count as full CPU too (CPU seconds above the wall time)
    assert explain_tool_state(state("S", cpu_s=150.0, window_s=60)).startswith("ffmpeg ran at full CPU")


def test_between_idle_and_busy_the_figures_are_given():
    assert explain_tool_state(state("S", cpu_s=12.0, window_s=60)) == (
        "ffmpeg was sleeping and used 12 s of CPU in 60 s without output")
    assert explain_tool_state(state("R", cpu_s=None, window_s=None)) == "ffmpeg was running (CPU time not measured)"


def test_an_exited_process_and_no_state():
    assert "had exited" in explain_tool_state(state("Z"))
    assert explain_tool_state(None) is None and tool_evidence(None) == []


def test_the_evidence_lines_quote_the_last_progress_and_stderr():
    lines = tool_evidence(state("T", last_progress="frame=392 out_time=00:00:15.68 progress=continue",
                                stderr_tail="first error\nsecond error"))
    assert lines[0].startswith("ffmpeg was stopped by a signal")
    assert lines[1:] == ["last progress: frame=392 out_time=00:00:15.68 progress=continue",
                         "last stderr: first error | second error"]


def test_the_diagnosis_of_a_stall_says_why_ffmpeg_stopped():
    now = datetime(2026, 12, 7, 12, 0, tzinfo=timezone.utc)
    job = {"job_id": "j", "state": "completed", "stage": "publish", "attempt": 1, "error_class": None,
           "reason": None}
    events = [{"event_type": "AttemptStarted", "stage": "transcode", "attempt": 1, "payload": {}},
              {"event_type": "StallDetected", "stage": "transcode", "attempt": 1,
               "payload": {"kind": "no_progress", "detail": "frames stuck at 392", "tool_state": state("T")}},
              {"event_type": "AttemptStarted", "stage": "transcode", "attempt": 2, "payload": {}},
              {"event_type": "JobCompleted", "stage": "publish", "attempt": 1, "payload": {}}]
    found = diagnose(job, events, [], now)
    assert found.stall == ("ffmpeg stopped advancing while its worker was alive: ffmpeg was stopped by a signal "
                           "(process state T): it ran no code until it was continued")


def test_a_loop_on_a_busy_host_wanted_the_whole_cpu():
    """It got 0.45 s of CPU in 3 s but waited 2.5 s more for one (schedstat): a loop, not a wait."""
    assert explain_tool_state(state("R", cpu_s=0.45, window_s=3.0, cpu_wait_s=2.5)) == (
        "ffmpeg ran at full CPU without output (0.5 s of CPU in 3.0 s; it waited 2.5 s more for a CPU: the host "
        "is busy): a loop, or a decode that makes no frames")
    # waiting for a CPU is not "no CPU": a starving process wants none
    assert not explain_tool_state(state("S", cpu_s=0.0, window_s=3.0, cpu_wait_s=1.0)).startswith("ffmpeg used no CPU")

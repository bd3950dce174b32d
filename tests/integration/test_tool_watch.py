"""What a worker sees of its tool, with real processes (issue 45 item 2): `media.run_ffmpeg`'s
`on_sample` (`processors/media.py` `ToolWatch`) reads `/proc/<pid>/stat` of a process that is
stopped by a signal, one that starves (blocked on a pipe that never delivers) and one that loops at
full CPU, none of them making progress; `explain_tool_state` says which. (The same with a real
ffmpeg in a real pipeline: tests/faults/test_worker_faults.py, the SIGSTOP test.)"""

from __future__ import annotations

import sys
import time

import pytest

from domain.policy.tool_state import explain_tool_state
from processors import media

pytestmark = pytest.mark.integration


def watched(script: str, run_s: float) -> list:
    """The tool states `run_ffmpeg` reports while `script` (Python) runs for `run_s` seconds."""
    seen: list = []
    started = time.monotonic()
    media.run_ffmpeg([sys.executable, "-c", script], on_sample=seen.append, tick_s=0.25,
                     should_stop=lambda: time.monotonic() - started > run_s)
    assert seen, "no tool state was reported"
    return seen


def test_a_process_stopped_by_a_signal_is_seen_stopped_with_its_last_progress_and_stderr():
    script = ("import os, signal, sys\n"
              "print('frame=392\\nfps=25.0\\nout_time=00:00:15.680000\\nout_time_us=15680000\\nspeed=1.02x\\n"
              "progress=continue', flush=True)\n"
              "print('decode_slice: concealing errors', file=sys.stderr, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGSTOP)\n")
    last = watched(script, 3.0)[-1]
    assert last.process_state == "T"
    assert last.last_progress == "frame=392 fps=25.0 out_time=00:00:15.680000 speed=1.02x progress=continue"
    assert last.stderr_tail == "decode_slice: concealing errors"
    assert explain_tool_state(last.model_dump()).endswith("was stopped by a signal (process state T): it ran no "
                                                           "code until it was continued")


def test_a_starving_process_uses_no_cpu_while_it_waits():
    script = "import os\nr, w = os.pipe()\nos.read(r, 1)\n"  # waits for a byte that never comes
    last = watched(script, 3.5)[-1]
    assert last.process_state == "S"
    assert last.window_s >= 1.5 and last.cpu_s <= 0.05 and last.cpu_wait_s <= 0.05
    assert "used no CPU for" in explain_tool_state(last.model_dump())
    assert "while sleeping (waiting on input, a pipe or a lock)" in explain_tool_state(last.model_dump())


def test_a_looping_process_runs_at_full_cpu_without_output():
    last = watched("while True:\n    pass\n", 4.0)[-1]
    assert last.process_state == "R"
    # It wanted the whole window: the CPU it got plus the time it waited for one (a shared host
    # gives it a share only; schedstat counts the rest).
    assert last.window_s >= 2.0 and last.cpu_s > 0 and last.cpu_s + last.cpu_wait_s >= 0.8 * last.window_s, last
    assert "ran at full CPU without output" in explain_tool_state(last.model_dump())

"""Why a tool stopped advancing, in words: what its process state and CPU time say (issue 45 item 2).

The worker samples its ffmpeg's `/proc/<pid>/stat` while heartbeating (`processors/media.py`
`ToolWatch`) and puts a compact `ToolState` in every heartbeat; the watchdog's `StallDetected`
carries the last one seen. This module reads such a state (a mapping with the `ToolState` fields:
`tool`, `process_state`, `cpu_s`, `window_s`, `last_progress`, `stderr_tail`, `cpu_wait_s`; the
event's model dumped, or its JSON payload) and says what it means. Pure.

"Wanted CPU" is the CPU it used plus the time its threads waited for one while runnable
(`cpu_wait_s`): a loop on a busy host gets a small share of a core yet wants all of it, so the CPU
it wanted tells a loop from a wait where the CPU it got cannot.

The rules, first match wins:
- state `T` or `t` (stopped, or stopped by a tracer): the tool was stopped by a signal (SIGSTOP,
  SIGTSTP, a debugger); it runs no code until SIGCONT;
- state `Z` or `X`: it had exited and its worker had not reaped it yet;
- state `D` (uninterruptible wait: disk or network file system): waiting on I/O;
- CPU wanted over the window at least `FULL_CPU` of the wall time (one core or more) without
  output: it ran at full CPU without output (a loop, or a pathological decode), with the share the
  host gave it when that was less than it wanted;
- CPU wanted at most `NO_CPU` of the wall time: it used no CPU, asleep (waiting on input, a pipe, a
  lock: starving);
- else: how much CPU it used, in its state.
"""

from __future__ import annotations

from typing import Any, Mapping

FULL_CPU = 0.8
"""CPU seconds per wall second at or above which a tool counts as running at full CPU (one core)."""

NO_CPU = 0.02
"""CPU seconds per wall second at or below which a tool counts as using no CPU."""

STATE_WORDS: dict[str, str] = {
    "R": "running", "S": "sleeping", "D": "waiting on I/O", "T": "stopped", "t": "stopped by a tracer",
    "Z": "exited (not reaped)", "X": "dead", "I": "idle",
}
"""The kernel's process state letters (`proc(5)`, field 3 of `/proc/<pid>/stat`) in words."""


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"


def explain_tool_state(state: Mapping[str, Any] | None) -> str | None:
    """One sentence on why the tool in `state` (a `ToolState` as a mapping) made no progress, by the
    module's rules; None without a state. E.g. "ffmpeg was stopped by a signal (process state T)",
    "ffmpeg used no CPU for 60 s while waiting on I/O (process state D)", "ffmpeg ran at full CPU
    without output (59 s of CPU in 60 s)"."""
    if not state:
        return None
    tool = state.get("tool") or "the tool"
    letter = (state.get("process_state") or "")[:1]
    cpu, window, waited = state.get("cpu_s"), state.get("window_s"), state.get("cpu_wait_s")
    busy = cpu / window if cpu is not None and window else None
    wanted = (cpu + (waited or 0.0)) / window if cpu is not None and window else None
    if letter in ("T", "t"):
        return f"{tool} was stopped by a signal (process state {letter}): it ran no code until it was continued"
    if letter in ("Z", "X"):
        return f"{tool} had exited and its worker had not reaped it yet (process state {letter})"
    if letter == "D":
        used = "no CPU" if busy is None or busy <= NO_CPU else f"{_seconds(cpu)} of CPU"
        during = f" for {_seconds(window)}" if window else ""
        return f"{tool} used {used}{during} while waiting on I/O (process state D: a disk or network file system)"
    if wanted is not None and wanted >= FULL_CPU:
        share = (f"; it waited {_seconds(waited)} more for a CPU: the host is busy"
                 if waited and waited >= NO_CPU * window * 10 else "")
        return (f"{tool} ran at full CPU without output ({_seconds(cpu)} of CPU in {_seconds(window)}{share}): "
                "a loop, or a decode that makes no frames")
    if wanted is not None and wanted <= NO_CPU:
        return (f"{tool} used no CPU for {_seconds(window)} while "
                f"{STATE_WORDS.get(letter, 'in state ' + letter) if letter else 'in an unknown state'} "
                "(waiting on input, a pipe or a lock)")
    words = STATE_WORDS.get(letter, f"in state {letter}") if letter else "in an unknown state"
    if busy is None:
        return f"{tool} was {words} (CPU time not measured)"
    return f"{tool} was {words} and used {_seconds(cpu)} of CPU in {_seconds(window)} without output"


def tool_evidence(state: Mapping[str, Any] | None) -> list[str]:
    """The lines an operator reads about a tool's state: the sentence of `explain_tool_state`, its
    last progress line and its last stderr lines (each only when known); empty without a state."""
    if not state:
        return []
    lines = [explain_tool_state(state) or ""]
    if state.get("last_progress"):
        lines.append(f"last progress: {state['last_progress']}")
    if state.get("stderr_tail"):
        lines.append("last stderr: " + " | ".join(line for line in str(state["stderr_tail"]).splitlines() if line))
    return lines

"""Named crash and failure points at side-effect boundaries, for fault-injection tests only.

`crash_point("intake.after_send_offsets")` kills the process with SIGKILL when that name is listed
in `TAPELINE_CRASH_POINTS` (comma-separated). With `TAPELINE_CRASH_ONCE_DIR` set, each point fires
once: a marker file `<dir>/<name>` is created just before the kill, so a supervised restart passes
the point. Without the variable nothing happens (one dictionary lookup).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tapeline.errors import TapelineError


def crash_point(name: str) -> None:
    """SIGKILL this process if `name` is an enabled crash point (see module docstring)."""
    enabled = os.environ.get("TAPELINE_CRASH_POINTS")
    if not enabled or name not in enabled.split(","):
        return
    once_dir = os.environ.get("TAPELINE_CRASH_ONCE_DIR")
    if once_dir:
        marker = Path(once_dir) / name
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


class InjectedFault(TapelineError):
    """A failure injected by `TAPELINE_FAIL_POINTS` (tests only)."""


def fail_point(name: str) -> None:
    """Raise `InjectedFault` classified as the class named in `TAPELINE_FAIL_POINTS`.

    The variable lists `name:error_class` pairs, comma-separated (for example
    `transcode.download:storage_transient`); with `TAPELINE_CRASH_ONCE_DIR` each fires once.
    """
    enabled = os.environ.get("TAPELINE_FAIL_POINTS")
    if not enabled:
        return
    classes = dict(item.split(":", 1) for item in enabled.split(",") if ":" in item)
    if name not in classes:
        return
    once_dir = os.environ.get("TAPELINE_CRASH_ONCE_DIR")
    if once_dir:
        marker = Path(once_dir) / f"fail-{name}"
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(os.getpid()))
    fault = InjectedFault(f"injected failure at {name}")
    fault.error_class = classes[name]
    raise fault

"""Named crash points at side-effect boundaries, for fault-injection tests only.

`crash_point("intake.after_send_offsets")` kills the process with SIGKILL when that name is listed
in `TAPELINE_CRASH_POINTS` (comma-separated). With `TAPELINE_CRASH_ONCE_DIR` set, each point fires
once: a marker file `<dir>/<name>` is created just before the kill, so a supervised restart passes
the point. Without the variable nothing happens (one dictionary lookup).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


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

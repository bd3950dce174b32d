"""The media replicator as a process of region B's stack: `tapeline region replicate` in the
background, started by `tapeline stack up --region b` beside the log mirror and stopped by `stack down
--region b` (docs/regions.md "Media replication"). Its log is `<region B home>/replicator/replicator.log`,
its pid `replicator/replicator.pid`; what it does is `regions/replicator.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from tapeline.settings import Settings

from tapeline.home import StackError, HomePaths, now_iso, owned_pid, say, spawn, update_state, wait_ready, stop_owned

REPLICATOR_READY_TIMEOUT_S = 90.0
"""How long `up` waits for the replicator to hold its lock and read region B's log, seconds."""
READY_LINE = '"event": "replicating"'
"""The log line the replicator writes once it follows every partition (regions/replicator.py `run`)."""


def _dir(paths: HomePaths) -> Path:
    return paths.home / "replicator"


def _markers(paths: HomePaths) -> tuple[str, ...]:
    return ("cli.main", "replicate", str(_dir(paths)))


def _started_run(log: Path) -> str:
    """What the current run (since the last start marker) wrote to the log."""
    try:
        return log.read_text(errors="replace").rpartition("\n===== ")[2]
    except FileNotFoundError:
        return ""


def up_replicator(target: Settings, paths: HomePaths, console: Console | None) -> None:
    """Start `tapeline region replicate --to <target.region>` in the background (unless this stack's runs
    already), its files under `paths` (the target's home), with this process's environment (region
    A's settings: the command derives both regions from them), and wait until it follows the target's
    log.

    Raises:
        StackError: it exits, or is not following the log within REPLICATOR_READY_TIMEOUT_S (the
            message shows its log's tail).
    """
    workdir = _dir(paths)
    log, pid_file = workdir / "replicator.log", workdir / "replicator.pid"
    pid = owned_pid(pid_file, _markers(paths))
    if pid is not None:
        say(console, f"[bold]replicator[/]: already running (pid {pid})")
        return
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "cli.main", "region", "replicate", "--to", target.region,
            "--workdir", str(workdir)]
    proc = spawn(argv, log, pid_file, cwd=workdir)
    update_state(paths, "replicator", {"pid": proc.pid, "started_at": now_iso(), "log": str(log)})
    source = "b" if target.region == "a" else "a"
    say(console, f"[bold]replicator[/]: started pid {proc.pid} (media {target.s3_endpoint} <- region {source}), "
                  f"log {log}")
    wait_ready("replicator", lambda: (READY_LINE in _started_run(log), f"not following region {target.region}'s "
                                       "log yet"), proc, log, REPLICATOR_READY_TIMEOUT_S)
    say(console, f"[bold]replicator[/]: following region {target.region}'s log")


def down_replicator(paths: HomePaths, console: Console | None) -> None:
    """Stop this stack's replicator (SIGTERM, by its pid file, only if that process is still it)."""
    stop_owned(_dir(paths) / "replicator.pid", _markers(paths), "replicator", console, quiet_when_absent=True)
    update_state(paths, "replicator", None)


def replicator_status(paths: HomePaths, target_region: str = "b") -> dict[str, Any]:
    """`{"up", "pid", "log", "started_by_stack", "address"}` of the replicator into `target_region`
    whose files are under `paths` (that region's home)."""
    pid = owned_pid(_dir(paths) / "replicator.pid", _markers(paths))
    source = "b" if target_region == "a" else "a"
    return {"up": pid is not None, "pid": pid, "started_by_stack": pid is not None,
            "address": f"media {source} -> {target_region}",
            "log": str(_dir(paths) / "replicator.log") if pid else None}


__all__ = ["up_replicator", "down_replicator", "replicator_status", "StackError"]

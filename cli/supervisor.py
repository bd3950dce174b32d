"""`tapeline run --role all`: each role as its own child process, restarted with backoff if it dies.

`--detach` starts the supervisor in the background with its output in `<home>/logs/run.log` and its
pid in `<home>/run/supervisor.pid`; `tapeline run --stop` sends it SIGTERM, which it passes to its
children before exiting.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import structlog

from domain import pipeline
from tapeline.settings import Settings

log = structlog.get_logger("tapeline.supervisor")
CORE_ROLES = ("projector", "intake", "transcode", "publish", "watchdog", "notify")
ROLES = CORE_ROLES + tuple(s for s in pipeline.STAGE_NAMES if s not in CORE_ROLES)
"""The children of `run --role all`: the core roles in their old order (their health ports never
move), then every other stage of the registry (`domain/pipeline.py`) in registry order."""
BACKOFF_S = (1, 2, 5, 10, 30)
"""Restart delays after consecutive crashes, seconds; a child that ran 60 s resets the count."""


SUPERVISED_ENV = "TAPELINE_SUPERVISED"
"""Set to 1 in a supervisor's children: the supervisor runs the region guard for all of them."""


def child_command(role: str, extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "cli.main", "run", "--role", role, *(extra or [])]


def child_env(role: str, health_port_base: int = 0, extra_index: int | None = None,
              name: str | None = None) -> dict[str, str]:
    """The child's environment: TAPELINE_WORKER_NAME = its child name (`name`, default the role;
    see `instances`), and with a health port base, TAPELINE_HEALTH_PORT = base + the role's index
    in ROLES (projector 0, intake 1, transcode 2, publish 3, ...), and for the n-th extra worker of a
    stage (`extra_index` n, 0-based) base + len(ROLES) + n; without a base, no child inherits a port."""
    env = dict(os.environ)
    env.pop("TAPELINE_HEALTH_PORT", None)  # one port shared by every child would make all but one crash-loop
    env["TAPELINE_WORKER_NAME"] = name or role  # the child's stable name: its holdings survive its death
    env[SUPERVISED_ENV] = "1"  # its supervisor watches the region's fence (regions/authority.py)
    if health_port_base:
        offset = ROLES.index(role) if extra_index is None else len(ROLES) + extra_index
        env["TAPELINE_HEALTH_PORT"] = str(health_port_base + offset)
    return env


def instances(roles: tuple[str, ...], workers: dict[str, int] | None = None) -> list[tuple[str, str, int | None]]:
    """`(name, role, extra_index)` of every child: one per role, and `workers[role]` processes of a
    stage (the first named after its role, then `publish#2`, `publish#3`, ...; extra ones numbered
    0, 1, ... across stages for their health ports). Pure."""
    found, extra = [], 0
    for role in roles:
        found.append((role, role, None))
        for n in range(2, (workers or {}).get(role, 1) + 1):
            found.append((f"{role}#{n}", role, extra))
            extra += 1
    return found


def supervise(roles: tuple[str, ...], stop_signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
              grace_s: float = 30.0, health_port_base: int = 0, backoff_s: tuple[float, ...] = BACKOFF_S,
              workers: dict[str, int] | None = None,
              on_exit: Callable[[str, str, int, int], None] | None = None) -> int:
    """Run `roles` as children until a stop signal; restart any that exits, after `backoff_s[n-1]`
    seconds for its n-th consecutive crash (the last entry repeats). `workers`: processes per stage
    (`{"publish": 2}`; default one per role, see `instances`). `on_exit(name, role, pid, returncode)`
    runs in its own thread as soon as a child is seen to exit (within 0.2 s) while not stopping: the
    rescue of what it held (`cli/wiring.py`); a negative returncode is the killing signal. Returns 0."""
    plan = {name: (role, extra) for name, role, extra in instances(roles, workers)}
    roles = tuple(plan)  # child names from here on
    stopping = False

    def on_signal(signum, _frame) -> None:
        nonlocal stopping
        stopping = True

    for signum in stop_signals:
        signal.signal(signum, on_signal)
    children: dict[str, subprocess.Popen] = {}
    crashes: dict[str, int] = {role: 0 for role in roles}
    started_at: dict[str, float] = {}
    restart_at: dict[str, float] = {role: 0.0 for role in roles}
    while not stopping:
        now = time.monotonic()
        for role in roles:
            child = children.get(role)
            if child is not None and child.poll() is not None:
                ran = now - started_at[role]
                crashes[role] = 0 if ran > 60 else crashes[role] + 1
                delay = backoff_s[min(crashes[role], len(backoff_s)) - 1] if crashes[role] else 0
                log.warning("child exited; restarting", role=role, returncode=child.returncode, ran_s=round(ran, 1),
                            restart_in_s=delay)
                if on_exit is not None:
                    threading.Thread(target=on_exit, args=(role, plan[role][0], child.pid, child.returncode),
                                     name=f"on-exit-{role}", daemon=True).start()
                restart_at[role] = now + delay
                del children[role]
            if role not in children and now >= restart_at[role]:
                kind, extra = plan[role]
                children[role] = subprocess.Popen(child_command(kind), env=child_env(kind, health_port_base, extra, role))
                started_at[role] = now
                log.info("child started", role=role, pid=children[role].pid)
        time.sleep(0.2)
    log.info("stopping children", roles=list(children))
    for child in children.values():
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children.values():
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return 0


def pid_file(settings: Settings) -> Path:
    return settings.home / "run" / "supervisor.pid"


def running_pid(settings: Settings) -> int | None:
    """Pid of a detached supervisor that is still alive, else None."""
    path = pid_file(settings)
    try:
        pid = int(path.read_text().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def detach(settings: Settings, role: str, env: dict[str, str] | None = None) -> int:
    """Start `tapeline run --role ROLE` in the background (environment `env`, default this process's);
    returns its pid (an existing one is reused). Its pid file and log are under `settings.home`."""
    existing = running_pid(settings)
    if existing:
        return existing
    (settings.home / "logs").mkdir(parents=True, exist_ok=True)
    pid_file(settings).parent.mkdir(parents=True, exist_ok=True)
    with open(settings.home / "logs" / "run.log", "ab") as out:
        process = subprocess.Popen(child_command(role), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                   start_new_session=True, env=env)
    pid_file(settings).write_text(str(process.pid))
    return process.pid


def stop_detached(settings: Settings, timeout_s: float = 40.0) -> bool:
    """SIGTERM the detached supervisor and wait for it to exit; returns whether one was running."""
    pid = running_pid(settings)
    if pid is None:
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except OSError:
            break
        time.sleep(0.2)
    else:
        os.kill(pid, signal.SIGKILL)
    pid_file(settings).unlink(missing_ok=True)
    return True

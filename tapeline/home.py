"""The local home (`settings.home`, `.tapeline/` by default): its paths, the state file `stack.json`
under a lock, and the child processes Tapeline starts there (detached, pid files checked against the
command line before any signal). Used by the dev stack (devstack/) and by the region operations that
start and stop the mirror and the media replicator (regions/)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.console import Console

from tapeline.settings import Settings


STOP_TIMEOUT_S = 30.0
"""How long `down` waits after SIGTERM before it sends SIGKILL, seconds."""
LOG_ROTATE_BYTES = 50 * 1024**2
"""A service log larger than this (bytes) is moved to `<name>.1` when the service starts again."""

KAFKA_JVM_FLAGS = (
    # What kafka-server-start.sh uses; without it a 2-core JVM picks the serial collector.
    "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
    # slf4j-simple writes to stderr (the log file); give each line a timestamp.
    "-Dorg.slf4j.simpleLogger.showDateTime=true",
    "-Dorg.slf4j.simpleLogger.dateTimeFormat=yyyy-MM-dd'T'HH:mm:ss.SSSXXX",
)


def java() -> str:
    """The `java` on PATH (Kafka's broker and MirrorMaker 2 run on it). Raises `StackError` naming the
    package to install when there is none."""
    java = shutil.which("java")
    if java is None:
        raise StackError("Java 17+ is needed for Kafka. Install it with `apt-get install -y openjdk-17-jre-headless`.")
    return java


class StackError(RuntimeError):
    """A local service could not be brought up or checked; the message says what to do."""


# --------------------------------------------------------------------------------------------
# Paths, state and small helpers


@dataclass(frozen=True)
class HomePaths:
    """Every file the stack owns, all under one home directory (the Kafka jars under `libs` when given:
    region B runs region A's jars)."""

    home: Path
    libs: Path | None = None

    @property
    def state(self) -> Path:
        return self.home / "stack.json"

    @property
    def lock(self) -> Path:
        return self.home / "stack.lock"

    @property
    def kafka(self) -> Path:
        return self.home / "kafka"

    @property
    def kafka_libs(self) -> Path:
        return self.libs if self.libs is not None else self.kafka / "libs"

    @property
    def postgres(self) -> Path:
        """A region's own PostgreSQL server (region B): `data/` (owned by the `postgres` user), its log
        and socket (devstack/pgserver.py)."""
        return self.home / "postgres"

    @property
    def mirror(self) -> Path:
        """MirrorMaker 2 (region B): `mm2.properties`, `mirror.log`, `mirror.pid` (regions/mirror.py)."""
        return self.home / "mirror"

    @property
    def s3(self) -> Path:
        return self.home / "s3"

    @property
    def s3_log(self) -> Path:
        return self.s3 / "moto.log"

    @property
    def s3_pid(self) -> Path:
        return self.s3 / "moto.pid"


def home_paths(settings: Settings) -> HomePaths:
    return HomePaths(Path(settings.home).resolve(),
                      Path(settings.kafka_jars).resolve() if settings.kafka_jars is not None else None)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def read_state(paths: HomePaths) -> dict[str, Any]:
    """`stack.json` as a dict (empty if missing or unreadable)."""
    try:
        return json.loads(paths.state.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def write_state(paths: HomePaths, state: dict[str, Any]) -> None:
    """Replace `stack.json` atomically."""
    paths.home.mkdir(parents=True, exist_ok=True)
    tmp = paths.state.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    tmp.replace(paths.state)


def update_state(paths: HomePaths, service: str, record: dict[str, Any] | None) -> None:
    """Set (or, with None, remove) one service's record in `stack.json`."""
    state = read_state(paths)
    if record is None:
        state.pop(service, None)
    else:
        state[service] = record
    write_state(paths, state)


@contextlib.contextmanager
def locked(paths: HomePaths) -> Iterator[None]:
    """Hold an exclusive lock on `<home>/stack.lock` so two `up`s never start two brokers."""
    paths.home.mkdir(parents=True, exist_ok=True)
    with open(paths.lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def host_port(address: str, default_port: int) -> tuple[str, int]:
    """Split `host:port` (or a URL's netloc) into its parts."""
    host, _, port = address.rpartition(":")
    if not host:
        return address, default_port
    return host.strip("[]"), int(port)


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True if something accepts TCP connections at host:port within timeout_s seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def tail(path: Path, lines: int = 25) -> str:
    """The last lines of a log file, for error messages."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log yet)"


def wait_ready(name: str, answers: Callable[[], tuple[bool, str]], proc: "subprocess.Popen | None", log: Path,
                timeout_s: float) -> None:
    """Poll `answers()` (ready, why not) every 0.2 s until it says ready. Raises `StackError` with the
    log's tail when `proc` (the process this call started, None when it was already running) exits
    first, or when `timeout_s` seconds pass."""
    deadline = time.monotonic() + timeout_s
    while not (answer := answers())[0]:
        if proc is not None and proc.poll() is not None:
            raise StackError(f"{name} exited with code {proc.returncode}. See {log}:\n{tail(log)}")
        if time.monotonic() > deadline:
            raise StackError(f"{name} was not ready within {timeout_s:.0f} s ({answer[1]}). See {log}:\n{tail(log)}")
        time.sleep(0.2)


def log_errors(path: Path, limit: int = 5) -> str:
    """The first ERROR/FATAL lines the current run (since the last start marker) wrote to a log."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    run = text.rpartition("\n===== ")[2].splitlines()
    hits = [line for line in run if " ERROR " in line or " FATAL " in line][:limit]
    return ("First errors:\n" + "\n".join(hits) + "\n") if hits else ""


def say(console: Console | None, message: str) -> None:
    if console is not None:
        console.print(message)


# --------------------------------------------------------------------------------------------
# Processes the stack starts: pid files checked against the command line


def cmdline(pid: int) -> list[str] | None:
    """The argv of a live, non-zombie process, or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rpartition(")")[2].split()[0] == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # reap our own child so it really goes away
            return None
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def owned_pid(pid_file: Path, markers: tuple[str, ...]) -> int | None:
    """The pid in pid_file if that process is alive and its argv contains every marker.

    A pid file whose process is gone, or whose pid now belongs to another program, is stale and
    yields None; such a pid is never signalled.
    """
    try:
        pid = int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    argv = cmdline(pid)
    if argv is None or not all(any(marker in arg for arg in argv) for marker in markers):
        return None
    return pid


def spawn(argv: list[str], log: Path, pid_file: Path, cwd: Path,
           env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start argv detached (own session), output appended to log, pid written to pid_file; `env`
    (default: this process's environment)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    if log.exists() and log.stat().st_size > LOG_ROTATE_BYTES:
        log.replace(log.with_name(log.name + ".1"))
    with open(log, "ab") as out:
        out.write(f"\n===== {now_iso()} starting: {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)
    pid_file.write_text(f"{proc.pid}\n")
    return proc


def stop_owned(pid_file: Path, markers: tuple[str, ...], name: str, console: Console | None,
               quiet_when_absent: bool = False) -> bool:
    """Stop the process named by `pid_file` if it is still the one the stack launched (`markers` in its
    command line: a recycled pid is never signalled), then remove the pid file. Says what it did; a
    pid file left by a process that is gone (or not ours) is removed without signalling anything;
    with no pid file, says the service was not started by the stack unless `quiet_when_absent`.
    Returns whether there was a pid file (stale or not)."""
    pid = owned_pid(pid_file, markers)
    if pid is not None:
        stop_pid(pid, name, console)
    elif pid_file.exists():
        say(console, f"[bold]{name}[/]: stale pid file {pid_file} (process gone or not ours); removing it")
    else:
        if not quiet_when_absent:
            say(console, f"[bold]{name}[/]: not started by the stack; leaving it alone")
        return False
    pid_file.unlink(missing_ok=True)
    return True


def stop_pid(pid: int, name: str, console: Console | None, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM pid, wait up to timeout_s seconds, then SIGKILL it."""
    say(console, f"[bold]{name}[/]: stopping pid {pid} (SIGTERM)")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cmdline(pid) is None:
            return
        time.sleep(0.2)
    say(console, f"[yellow]{name}[/]: still alive after {timeout_s:.0f} s, sending SIGKILL")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and cmdline(pid) is not None:
        time.sleep(0.1)



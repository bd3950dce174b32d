"""Which attempt each worker process holds, on its host's disk: how a dead worker is rescued at once.

A worker with a stable name (`Settings.worker_name`) writes one small JSON file per process while
it holds an attempt: `<home>/run/holdings/<app_name>.<worker_name>.<pid>.json`, written after its
`AttemptStarted` committed and removed when the attempt ended. When that process dies, its file stays:

- the supervisor of `tapeline run --role all` sees the child exit (`cli/supervisor.py`) and reads
  the file of that pid;
- a worker restarted by an external supervisor (systemd, Kubernetes) under the same name finds the
  files of earlier incarnations whose process no longer exists.

Either hands the holding to the rescuer (`processors/rescue.py`), which fences the dead process's
producer and retries the attempt without waiting for its lease. The file is only a hint: the
rescuer acts only when the projection still shows that very claim running. A stopped (not dead)
process keeps its file and is never rescued from here; its lease still covers it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from tapeline.settings import Settings


@dataclass(frozen=True)
class Holding:
    """One attempt one process holds: whose (`pid`), which (`job_id`, `stage`, `attempt`,
    `claim_token`), and the transactional id of its producer (`{app}.{stage}.{job_id}`)."""

    pid: int
    job_id: str
    stage: str
    attempt: int
    claim_token: str
    transactional_id: str


def holdings_dir(settings: Settings) -> Path:
    return settings.home / "run" / "holdings"


def holding_path(settings: Settings, worker_name: str, pid: int) -> Path:
    return holdings_dir(settings) / f"{settings.app_name}.{worker_name}.{pid}.json"


def record(settings: Settings, worker_name: str, holding: Holding) -> None:
    """Write `holding` for this process (atomically: a reader never sees half a file)."""
    path = holding_path(settings, worker_name, holding.pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(asdict(holding)))
    os.replace(partial, path)


def release(settings: Settings, worker_name: str, pid: int) -> None:
    """Remove the holding of process `pid` (its attempt ended, or it was rescued)."""
    holding_path(settings, worker_name, pid).unlink(missing_ok=True)


def read(settings: Settings, worker_name: str, pid: int) -> Holding | None:
    """The holding process `pid` left, or None (it held nothing, or the file is unreadable)."""
    try:
        return Holding(**json.loads(holding_path(settings, worker_name, pid).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def process_alive(pid: int) -> bool:
    """Whether process `pid` is alive on this host: a stopped one is, a zombie (dead, not yet reaped
    by its parent) is not (Linux `/proc/<pid>/stat` state `Z`)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def left_by_earlier_incarnations(settings: Settings, worker_name: str, own_pid: int) -> list[Holding]:
    """Holdings of `worker_name` whose process is gone (not `own_pid`, not a live process)."""
    found = []
    for path in sorted(holdings_dir(settings).glob(f"{settings.app_name}.{worker_name}.*.json")):
        try:
            pid = int(path.name[len(f"{settings.app_name}.{worker_name}."):-len(".json")])
        except ValueError:
            continue
        if pid != own_pid and not process_alive(pid):
            holding = read(settings, worker_name, pid)
            if holding is not None:
                found.append(holding)
    return found

"""What region operations need from the roof, as a port: the in-process projector and runtime a
failover runs, and control of a region's background processors (`tapeline run --role all
--detach`). `cli/wiring.py` `RegionProcesses` implements it and the roof hands it in, so region
operations never import the command line, its wiring or its supervisor."""

from __future__ import annotations

import threading
from typing import Any, Mapping, Protocol

from tapeline.settings import Settings


class Processes(Protocol):
    """The roof's side of a failover and a rejoin."""

    def build_projector(self, settings: Settings) -> Any:
        """A projector of `settings` (an object with `run(stop: threading.Event)`), measuring no lag."""

    def build_runtime(self, settings: Settings, name: str) -> Any:
        """A processor runtime named `name` (`processors.runtime.Runtime`); the caller closes it."""

    def running_pid(self, settings: Settings) -> int | None:
        """The pid of the region's detached `run --role all`, or None when none runs."""

    def start_all(self, settings: Settings, env: Mapping[str, str]) -> int:
        """Start the region's `run --role all` in the background with `env`; its pid (a running one is
        reused)."""

    def stop_all(self, settings: Settings) -> bool:
        """Stop the region's detached processors; whether they were running."""

    def health_port(self, settings: Settings, role: str) -> int:
        """The port on which `role`'s child of `run --role all` serves /health (TCP port number)."""


class ProjectorThread:
    """A projector built by `processes` for `settings`, run in a thread of this process for the `with`
    block and stopped (joined at most 30 s) at its end."""

    def __init__(self, processes: Processes, settings: Settings, name: str = "failover-projector") -> None:
        self.projector = processes.build_projector(settings)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.projector.run, args=(self.stop,), name=name, daemon=True)

    def __enter__(self) -> "ProjectorThread":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(30)

"""The writer's clock and event ids: the `Clock` port and the system clock behind it.

The domain never reads a clock or draws an id (`domain.events.Event.new` takes a `Stamp`); the
processes that write events take both from here. Leases and stalls never use this clock: they are
judged on broker time (LogAppendTime, docs/design.md "One lease clock").
"""

from __future__ import annotations

import os
import uuid
from datetime import datetime, timedelta, timezone
from typing import Protocol, runtime_checkable

from domain.events import Stamp


@runtime_checkable
class Clock(Protocol):
    """Where a writer's time and event ids come from (a port: `tapeline/ports.py`)."""

    def now(self) -> datetime:
        """The writer's time, aware UTC, microsecond precision."""
        ...

    def stamp(self) -> Stamp:
        """`Stamp(now(), a fresh event id)` for the next event."""
        ...


class SystemClock:
    """The machine's clock, shifted by `TAPELINE_CLOCK_OFFSET_S` seconds when that is set (fault
    tests run workers with skewed clocks that way: libfaketime breaks librdkafka's timed waits,
    checked), and uuid4 event ids."""

    def now(self) -> datetime:
        offset = os.environ.get("TAPELINE_CLOCK_OFFSET_S")
        now = datetime.now(timezone.utc)
        return now + timedelta(seconds=float(offset)) if offset else now

    def stamp(self) -> Stamp:
        return Stamp(self.now(), str(uuid.uuid4()))


system_clock = SystemClock()
"""The clock every Tapeline process writes events with."""


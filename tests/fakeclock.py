"""A `Clock` (tapeline/ports.py) for unit tests: a fixed time, and event ids counted up."""

from __future__ import annotations

import itertools
from datetime import datetime, timezone

from domain.events import Stamp


class FixedClock:
    """Always `at`; event ids `<prefix>-1`, `<prefix>-2`, ... in the order stamps are drawn."""

    def __init__(self, at: datetime = datetime(2026, 12, 4, 12, 0, tzinfo=timezone.utc), prefix: str = "e") -> None:
        self.at, self.prefix = at, prefix
        self._ids = itertools.count(1)

    def now(self) -> datetime:
        return self.at

    def stamp(self) -> Stamp:
        return Stamp(self.at, f"{self.prefix}-{next(self._ids)}")

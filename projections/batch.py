"""`BatchResult`: the counts of one applied batch, in a module of its own so that a replay worker
(`projections/partitioned.py`) can count without importing the projector, psycopg or the models."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BatchResult:
    """Counts of one applied batch (records, events applied, duplicates by dedup key, superseded by
    claim token, dead letters made) and the position after the last record read per (topic,
    partition)."""

    records: int = 0
    applied: int = 0
    duplicates: int = 0
    superseded: int = 0
    dead_letters: int = 0
    positions: dict[tuple[str, int], int] = field(default_factory=dict)

"""Golden files of old events (see make_golden.py); `load()` reads them for the tests."""

from __future__ import annotations

import json
from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parent


def load(name: str = "lifecycle-v1") -> list[tuple[dict, bytes, dict]]:
    """[(record line, exact Kafka value bytes, expected decoded event as JSON)], in log order."""
    records = [json.loads(line) for line in (GOLDEN_DIR / f"{name}.records.jsonl").read_text().splitlines()]
    expected = [json.loads(line) for line in (GOLDEN_DIR / f"{name}.expected.jsonl").read_text().splitlines()]
    assert len(records) == len(expected), f"{name}: records and expected differ in length"
    return [(record, bytes.fromhex(record["value_hex"]), want) for record, want in zip(records, expected)]

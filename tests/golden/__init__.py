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


def assert_decodes_as_expected(record: dict, value: bytes, expected: dict):
    """Decode one golden record with the current codec and check it: the expected fields equal, every
    field added after the golden file at its default. Returns the decoded event."""
    from domain import events as ev
    from domain.codec import default_codec

    event = ev.Event.from_record(default_codec().decode(value, topic="golden", partition=0, offset=record["n"]))
    got = json.loads(event.model_dump_json())
    for k, want in expected.items():  # a nested record (JobAccepted.media) may have gained fields too
        sub = getattr(event, k, None)
        if isinstance(want, dict) and isinstance(got.get(k), dict) and hasattr(type(sub), "model_fields"):
            later = set(got[k]) - set(want)
            defaults = {f: type(sub).model_fields[f].get_default(call_default_factory=True) for f in later}
            assert {f: got[k][f] for f in later} == json.loads(json.dumps(defaults)), k
            got[k] = {f: got[k][f] for f in want if f in got[k]}
    assert {k: got[k] for k in expected} == expected
    added_later = set(got) - set(expected)
    defaults = {f: type(event).model_fields[f].get_default(call_default_factory=True) for f in added_later}
    assert {f: got[f] for f in added_later} == json.loads(json.dumps(defaults))
    return event

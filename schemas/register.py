"""Register the current schema versions: `python -m schemas.register`.

Every schema version that has ever written events to a log is kept in `registered/` as
`<EventType>-<fingerprint hex>.avsc`, so the codec can read old events forever. Before a new
version is registered, every older registered version of that type must resolve to it (Avro schema
resolution, checked by writing a generated record with the old schema and reading it with the new);
`tests/unit/test_schemas.py` fails while a changed schema is unregistered.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import fastavro
from fastavro.schema import parse_schema
from fastavro.utils import generate_many

from domain.codec import REGISTERED_DIR, Codec, schema_fingerprint


def registered_versions(registered_dir: Path = REGISTERED_DIR) -> dict[str, list[dict]]:
    """`{event_type: [schema, ...]}` of every registered version."""
    versions: dict[str, list[dict]] = {}
    for path in sorted(registered_dir.glob("*.avsc")):
        schema = json.loads(path.read_text())
        versions.setdefault(schema["name"].rsplit(".", 1)[-1], []).append(schema)
    return versions


def incompatibilities(old: dict, new: dict, samples: int = 20) -> list[str]:
    """Reasons why events written with `old` cannot be read with `new` (empty when compatible)."""
    problems = []
    old_parsed, new_parsed = parse_schema(old), parse_schema(new)
    for record in generate_many(old_parsed, samples):
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, old_parsed, record)
        buf.seek(0)
        try:
            fastavro.schemaless_reader(buf, old_parsed, new_parsed)
        except Exception as exc:  # any resolution failure is a reason to refuse
            problems.append(f"{type(exc).__name__}: {exc}")
            break
    return problems


def main() -> int:
    codec = Codec(registered_dir=None)
    versions = registered_versions()
    REGISTERED_DIR.mkdir(exist_ok=True)
    failed = False
    for event_type, schema in sorted(codec.schemas.items()):
        fp = schema_fingerprint(schema).hex()
        path = REGISTERED_DIR / f"{event_type}-{fp}.avsc"
        if path.exists():
            continue
        problems = [p for old in versions.get(event_type, []) for p in incompatibilities(old, schema)]
        if problems:
            print(f"REFUSED {event_type}: old events would not be readable: {problems[0]}")
            failed = True
            continue
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        print(f"registered {path.name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Avro single-object encoding of Tapeline events, with a registry of every writer schema.

Record layout (Avro 1.11 spec, "Single object encoding"): the two marker bytes `C3 01`, the
8-byte little-endian CRC-64-AVRO fingerprint of the writer schema's parsing canonical form, then
the Avro binary body. Reading looks the fingerprint up among the current schemas and every
registered older version (`registered/*.avsc`) and resolves the body to the current schema, so old
events stay readable after a compatible change.

Schema files (in `schemas/`, see `CONTRACT_DIR`): `avro/Envelope.avsc` holds the envelope fields, `avro/types.avsc` the shared named
records, and `avro/<EventType>.avsc` one event's own fields. The full writer schema of an event is
its record with the envelope fields first, then its own.
"""

from __future__ import annotations

import io
import json
from functools import lru_cache
from importlib.resources import files
from pathlib import Path
from typing import Any

import cavro
import fastavro
from fastavro.schema import fingerprint, parse_schema, to_parsing_canonical_form

from domain.errors import DecodeError, SchemaError

CONTRACT_DIR = Path(str(files("schemas")))
"""The language-neutral contract folder `schemas/` (Avro files; the Rust engine reads them too)."""
SCHEMA_DIR = CONTRACT_DIR / "avro"
REGISTERED_DIR = CONTRACT_DIR / "registered"
MAGIC = b"\xc3\x01"
HEADER_BYTES = 10  # 2 marker bytes + 8 fingerprint bytes
_FAST_OPTIONS = cavro.DEFAULT_OPTIONS.replace(record_decodes_to_dict=True)
_END = b"\x00end-of-record\xff"  # no proper prefix of it is also a suffix
_END_READER = cavro.Schema('{"type": "fixed", "name": "EndMark", "size": %d}' % len(_END))
"""cavro has no public read position: the fast path decodes `body + _END` and then reads
len(_END) bytes, which are `_END` exactly when the body ended where its record did (a truncated
body reads into the mark and fails or misses it; a body with trailing bytes yields those first,
and since no proper prefix of `_END` is also a suffix of it, they can only read as `_END` when
they start with it)."""


def compose_schemas(schema_dir: Path = SCHEMA_DIR) -> dict[str, dict]:
    """Build the full (envelope-first, named types expanded) schema of every event type.

    Returns `{event_type: schema dict}`. Raises `SchemaError` when a file is not valid Avro.
    """
    try:
        envelope = json.loads((schema_dir / "Envelope.avsc").read_text())
        types = json.loads((schema_dir / "types.avsc").read_text())
        named: dict[str, Any] = {}
        for t in types:
            parse_schema(t, named_schemas=named)
        composed = {}
        for path in sorted(schema_dir.glob("*.avsc")):
            if path.stem in ("Envelope", "types"):
                continue
            own = json.loads(path.read_text())
            full = dict(own, fields=envelope["fields"] + own["fields"])
            composed[own["name"]] = _expand(full, named)
        return composed
    except (OSError, ValueError, fastavro.schema.SchemaParseException) as exc:
        raise SchemaError(f"cannot load schemas from {schema_dir}: {exc}") from exc


def _expand(full: dict, named: dict[str, Any]) -> dict:
    """Expand named type references in `full` so the schema stands alone (defaults and docs kept)."""
    return fastavro.schema.expand_schema(parse_schema(full, named_schemas=dict(named)))


def schema_fingerprint(schema: dict) -> bytes:
    """8-byte CRC-64-AVRO fingerprint of a schema's parsing canonical form (little-endian)."""
    return bytes.fromhex(fingerprint(to_parsing_canonical_form(parse_schema(schema)), "CRC-64-AVRO"))


class Codec:
    """Encodes and decodes events; knows the current and every registered writer schema.

    `encode(record)` takes a dict whose `event_type` names the schema. `decode(data)` returns the
    dict resolved to the current schema of its type. Both raise our own errors: `SchemaError` for a
    record that does not fit, `DecodeError` (with topic, partition, offset when given) for bytes
    that are not one of our events.
    """

    def __init__(self, schema_dir: Path = SCHEMA_DIR, registered_dir: Path | None = REGISTERED_DIR) -> None:
        self.schemas = compose_schemas(schema_dir)
        self.parsed = {name: parse_schema(s) for name, s in self.schemas.items()}
        self.fingerprints = {name: schema_fingerprint(s) for name, s in self.schemas.items()}
        # fingerprint -> (event_type, parsed writer schema)
        self.writers: dict[bytes, tuple[str, Any]] = {
            fp: (name, self.parsed[name]) for name, fp in self.fingerprints.items()}
        # Writers that are the current schema of their type need no schema resolution; cavro (Cython)
        # decodes those in about 60 % of fastavro's time (9 vs 14.5 µs per record for the replay
        # benchmark's mix, measured). fastavro encodes and resolves older writer versions.
        self.fast_readers: dict[bytes, cavro.Schema] = {
            self.fingerprints[name]: cavro.Schema(json.dumps(schema), options=_FAST_OPTIONS)
            for name, schema in self.schemas.items()}
        if registered_dir is not None and registered_dir.is_dir():
            for path in sorted(registered_dir.glob("*.avsc")):
                old = json.loads(path.read_text())
                fp = schema_fingerprint(old)
                self.writers.setdefault(fp, (old["name"].rsplit(".", 1)[-1], parse_schema(old)))

    def encode(self, record: dict) -> bytes:
        """Single-object encode `record` with the current schema of `record["event_type"]`."""
        event_type = record.get("event_type")
        if event_type not in self.parsed:
            raise SchemaError(f"unknown event_type {event_type!r}")
        buf = io.BytesIO()
        buf.write(MAGIC)
        buf.write(self.fingerprints[event_type])
        try:
            fastavro.schemaless_writer(buf, self.parsed[event_type], record, strict_allow_default=True)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise SchemaError(f"{event_type} does not match its schema: {exc}") from exc
        return buf.getvalue()

    def event_type_of(self, data: bytes | None) -> str | None:
        """The event type named by `data`'s writer-schema fingerprint, without decoding the body
        (for metrics); None when `data` is not a record this codec knows."""
        if not data or len(data) < HEADER_BYTES or data[:2] != MAGIC:
            return None
        writer = self.writers.get(bytes(data[2:HEADER_BYTES]))
        return writer[0] if writer else None

    def decode(self, data: bytes | None, *, topic: str | None = None, partition: int | None = None,
               offset: int | None = None) -> dict:
        """Decode single-object-encoded `data` into a dict of the current schema of its type.

        Raises `DecodeError` naming topic, partition and offset for anything that is not an event
        this codec knows (no marker, unknown fingerprint, truncated or corrupt body, a body whose
        `event_type` is not its writer schema's).
        """
        where = {"topic": topic, "partition": partition, "offset": offset}
        if not data or len(data) < HEADER_BYTES or data[:2] != MAGIC:
            raise DecodeError("not an Avro single-object record (missing C3 01 marker)", **where)
        fp = bytes(data[2:HEADER_BYTES])
        writer = self.writers.get(fp)
        if writer is None:
            raise DecodeError(f"unknown writer schema fingerprint {bytes(data[2:10]).hex()}", **where)
        event_type, writer_schema = writer
        reader_schema = self.parsed.get(event_type)
        if reader_schema is None:
            raise DecodeError(f"event type {event_type} is no longer readable", **where)
        fast = self.fast_readers.get(fp)
        try:
            # Written with the current schema: nothing to resolve. (Bytes that contain the end mark go
            # the slow way: trailing bytes starting with it are the one case the mark cannot see.)
            if fast is not None and _END not in data:
                reader = cavro.MemoryReader(data[HEADER_BYTES:] + _END)
                record = fast.binary_read(reader)
                trailing = _END_READER.binary_read(reader) != _END
            else:
                body = io.BytesIO(data[HEADER_BYTES:])
                record = fastavro.schemaless_reader(body, writer_schema, reader_schema)
                trailing = bool(body.read(1))
        except Exception as exc:  # both readers raise many types on corrupt bytes; all mean "undecodable"
            raise DecodeError(f"corrupt {event_type} body: {type(exc).__name__}: {exc}", **where) from exc
        if trailing:
            raise DecodeError(f"{event_type} body does not end where its record does (trailing bytes)", **where)
        if record.get("event_type") != event_type:
            raise DecodeError(f"{event_type} body names event_type {str(record.get('event_type'))[:40]!r}", **where)
        return record


@lru_cache(maxsize=1)
def default_codec() -> Codec:
    """The codec over the schemas shipped with this package (parsed once per process)."""
    return Codec()


def encode(record: dict) -> bytes:
    """Encode with the default codec."""
    return default_codec().encode(record)


def decode(data: bytes | None, **where: Any) -> dict:
    """Decode with the default codec; `where` is topic, partition, offset for error messages."""
    return default_codec().decode(data, **where)

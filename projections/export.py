"""`tapeline export`: the raw committed event history of the lifecycle log, for analysts.

Reads `<prefix>.jobs` read_committed, from the first offset at or after `--since`
(`offsets_for_times`) up to the first offset at or after `--until` (or the last stable offset when
the export starts), and streams each event with its log position:

- `jsonl`: one JSON object per line, `{"partition", "offset", "broker_ts", "event": {...}}`, the
  event as its pydantic model dumps it (UTC timestamps with `Z`).
- `avro`: one Avro object container file (deflate) whose schema is the record
  `tapeline.export.LogRecord {partition: int, offset: long, broker_ts: timestamp-millis,
  event: union of every event schema}`. One file rather than one per event type, so a single
  `--output` path is the whole history in log order; readers see each event's type from its union
  branch and its `event_type` field. Events written with an older schema version are resolved to
  the current one by the codec, so the file has one (current) schema.

`--job JOB` reads only the job's partition (`partition_for`) and keeps only its events; the other
jobs' records there are skipped and counted apart (`skipped_other_jobs`). Records that cannot be
decoded are skipped and counted (the projector keeps them in `dead_letters`); under `--job`, only
those keyed by the job (records are keyed by job id) count as undecodable, the rest as other jobs'.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from typing import IO, Any, Callable

import fastavro
from fastavro.write import Writer

from tapeline import kafka_scan
from domain import events as ev
from domain.codec import default_codec
from tapeline import kafka
from domain.errors import DecodeError, SchemaError
from tapeline.settings import Settings

FORMATS = ("avro", "jsonl")
LIFECYCLE_EXCLUDED = frozenset({"UploadCompleted", "WorkItem", "DeadLetter"})  # not lifecycle-log event types


@dataclass
class ExportResult:
    events: int = 0
    skipped_undecodable: int = 0
    skipped_other_jobs: int = 0
    """With `job`: records of the job's partition that belong to other jobs (by event, or by key when undecodable)."""
    offsets_total: int = 0


def _dedupe_named(schema: Any, defined: set[str], namespace: str | None = None) -> Any:
    """Copy of `schema` where a named type already in `defined` becomes a reference by full name."""
    if isinstance(schema, list):
        return [_dedupe_named(s, defined, namespace) for s in schema]
    if not isinstance(schema, dict):
        return schema
    kind = schema.get("type")
    if kind in ("record", "enum", "fixed"):
        space = schema.get("namespace", namespace)
        full = schema["name"] if "." in schema["name"] or not space else f"{space}.{schema['name']}"
        if full in defined:
            return full
        defined.add(full)
        out = dict(schema)
        if kind == "record":
            out["fields"] = [dict(f, type=_dedupe_named(f["type"], defined, space)) for f in schema["fields"]]
        return out
    if kind == "array":
        return dict(schema, items=_dedupe_named(schema["items"], defined, namespace))
    if kind == "map":
        return dict(schema, values=_dedupe_named(schema["values"], defined, namespace))
    return schema


@lru_cache(maxsize=1)
def export_schema() -> dict:
    """The parsed schema of an exported Avro file (see the module docstring)."""
    composed = default_codec().schemas
    defined: set[str] = set()
    union = [_dedupe_named(copy.deepcopy(composed[name]), defined) for name in sorted(composed)
             if name not in LIFECYCLE_EXCLUDED]
    return fastavro.parse_schema({
        "type": "record", "name": "LogRecord", "namespace": "tapeline.export",
        "doc": "One committed record of the lifecycle log with its position and broker time.",
        "fields": [
            {"name": "partition", "type": "int"},
            {"name": "offset", "type": "long"},
            {"name": "broker_ts", "type": {"type": "long", "logicalType": "timestamp-millis"},
             "doc": "LogAppendTime, UTC"},
            {"name": "event", "type": union},
        ]})


def _event_branch(record: dict) -> str:
    return f"tapeline.events.{record['event_type']}"


def export(settings: Settings, output: IO[bytes], fmt: str, *, since: datetime | None = None,
           until: datetime | None = None, job: str | None = None,
           on_start: Callable[[int], None] | None = None,
           on_progress: Callable[[int], None] | None = None) -> ExportResult:
    """Stream the lifecycle log's committed events in [since, until) to `output` (a binary stream)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}")
    codec = default_codec()
    topic = settings.jobs_topic
    result = ExportResult()
    consumer = kafka_scan.reader(settings, "export")
    writer = None
    try:
        partitions = None
        if job is not None:
            partitions = {topic: [kafka.partition_for(job, kafka.partition_count(consumer, topic))]}
        span = kafka_scan.bounds(consumer, [topic], since=since, until=until, partitions=partitions)
        result.offsets_total = span.total
        if on_start is not None:
            on_start(span.total)
        if fmt == "avro":
            writer = Writer(output, export_schema(), codec="deflate")
        for piece in kafka_scan.read(consumer, span, on_progress=on_progress):
            lines = []
            for message in piece.records:
                try:
                    record = codec.decode(message.value(), topic=message.topic(), partition=message.partition(),
                                          offset=message.offset())
                except (DecodeError, SchemaError):
                    if job is not None and message.key() != job.encode():
                        result.skipped_other_jobs += 1
                    else:
                        result.skipped_undecodable += 1
                    continue
                if job is not None and record.get("job_id") != job:
                    result.skipped_other_jobs += 1
                    continue
                if record["event_type"] in LIFECYCLE_EXCLUDED:
                    result.skipped_undecodable += 1
                    continue
                millis = message.timestamp()[1]
                if writer is not None:
                    writer.write({"partition": message.partition(), "offset": message.offset(),
                                  "broker_ts": datetime.fromtimestamp(millis / 1000, tz=timezone.utc),
                                  "event": (_event_branch(record), record)})
                else:
                    event = ev.Event.from_record(record)
                    broker_ts = datetime.fromtimestamp(millis / 1000, tz=timezone.utc).isoformat(timespec="milliseconds")
                    lines.append('{"partition":%d,"offset":%d,"broker_ts":%s,"event":%s}\n' % (
                        message.partition(), message.offset(), json.dumps(broker_ts.replace("+00:00", "Z")),
                        event.model_dump_json()))
                result.events += 1
            if lines:
                output.write("".join(lines).encode())
        if writer is not None:
            writer.flush()
        output.flush()
    finally:
        consumer.close()
    return result

"""The projections' fold, pure: decoded records in, rows and parameters out; no client, no SQL.

Steps 1 and 3 of the projector's commit protocol (`projections/projector.py`), shared with the bulk
replay (`projections/bulk.py`), its worker processes and the native engine's odd records
(`projections/native.py`):
  Step 1. `decode_batch`: decode each record; an undecodable one keeps its error;
  Step 3. `fold_batch`: fold each event onto its job in log order (`lifecycle.evolve`), a repeated
          dedup key only as evidence; build the evidence rows, uploads, dead letters (`dead_letter`,
          also for an event PostgreSQL could not store: `unstorable`) and the log clock.
Records are `tapeline.ports.LogRecord`s, whichever reader they came from.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb

from domain import events as ev
from domain import lifecycle
from domain.codec import default_codec
from domain.errors import DecodeError, SchemaError
from projections.batch import BatchResult
from tapeline.ports import LogRecord, broker_time

PAYLOAD_OMITS = lifecycle.PAYLOAD_OMITS


KeySetLike = Any  # `in` and `add` over dedup keys, e.g. `projections.bulk.KeySet`
Decoded = tuple[LogRecord, "ev.Event | None", "str | None"]
"""A message with its event, or None and why it could not be decoded."""


def decode_batch(messages: list[LogRecord], result: BatchResult,
                 end_positions: dict[tuple[str, int], int] | None = None) -> list[Decoded]:
    """Step 1: decode each message (an undecodable one keeps its error) and record in `result` the
    position after each message and the partition ends reached (`end_positions`)."""
    codec = default_codec()
    decoded: list[Decoded] = []
    positions = result.positions
    for message in messages:
        topic, partition, offset = message.topic(), message.partition(), message.offset()
        try:
            record = codec.decode(message.value(), topic=topic, partition=partition, offset=offset)
            decoded.append((message, ev.Event.from_decoded(record), None))
        except (DecodeError, SchemaError) as exc:
            decoded.append((message, None, str(exc)))
        positions[(topic, partition)] = offset + 1
    for position, offset in (end_positions or {}).items():
        if offset > 0:  # an empty partition needs no row: a missing row means offset 0 (and a replay stores none)
            positions[position] = max(positions.get(position, 0), offset)
    return decoded


@dataclass
class Folded:
    """What step 3 produced for one batch, for step 4 to write.

    `evidence`: rows in `lifecycle.EVIDENCE_COLUMNS` order; `uploads`, `dead`: parameters of
    `upsert_upload` and `upsert_dead_letter`, in log order; `replays`: the marks of dead letters
    (`writes.mark_dead_letters`: a `JobReplayed`'s, and a `DeadLetterDismissed`'s with `mark`
    "dismissed"), in log order; `new_keys`:
    dedup keys applied by this batch; `changed`: job ids whose row in `rows` changed; `clock`: the
    latest broker time seen per partition of the clock topic.
    """

    evidence: list[tuple] = field(default_factory=list)
    uploads: list[dict[str, Any]] = field(default_factory=list)
    dead: list[dict[str, Any]] = field(default_factory=list)
    replays: list[dict[str, Any]] = field(default_factory=list)
    new_keys: list[str] = field(default_factory=list)
    changed: set[str] = field(default_factory=set)
    clock: dict[int, datetime] = field(default_factory=dict)


def fold_batch(decoded: list[Decoded], rows: dict[str, dict[str, Any]], seen: "set[str] | KeySetLike",
               result: BatchResult, clock_topic: str | None = None, dlq_topic: str | None = None,
               binary_payload: bool = False) -> Folded:
    """Step 3, shared by the projector and the bulk replay (`projections/bulk.py`): fold each
    decoded record onto `rows` (job id -> `job_state` row, updated in place) in log order, a dedup
    key already in `seen` (updated in place) only as evidence. Counts go to `result`.

    An evidence row's `payload` is the JSON text of the event's fields that have no evidence column
    of their own (`PAYLOAD_OMITS` left out), or with `binary_payload` the same JSON as UTF-8 bytes
    (json's binary COPY format is its text) for a binary COPY.
    """
    out = Folded()
    evidence, clock = out.evidence, out.clock
    last_millis, ts = None, None
    for message, event, error in decoded:
        topic, partition, offset = message.topic(), message.partition(), message.offset()
        millis = message.timestamp()[1]
        if millis != last_millis:  # records of one producer batch share their LogAppendTime
            last_millis, ts = millis, broker_time(message)
        if topic == clock_topic:
            now = clock.get(partition)
            if now is None or ts > now:
                clock[partition] = ts
        if isinstance(event, ev.WatchdogTick):
            continue
        payload = None
        if event is not None and topic != dlq_topic:  # (a DeadLetter's raw bytes become bytea, not JSON)
            # JSON text (what model_dump_json returns), stored as written (a json column)
            payload = event.__pydantic_serializer__.to_json(event, exclude=PAYLOAD_OMITS)
            error = unstorable(event, payload)
            if error is not None:
                event = None  # a dead letter, like an undecodable record: PostgreSQL cannot hold it
        if event is None:
            out.dead.append(dead_letter(
                f"{topic}/{partition}/{offset}", "projection", topic, partition, offset, ts, error, "projector",
                key=message.key(), value=message.value(), headers=message.headers(), error_class="invalid_input",
                evidence=f"{topic}/{partition}/{offset}"))
            result.dead_letters += 1
            continue
        if topic == dlq_topic:
            if isinstance(event, ev.DeadLetter):
                out.dead.append(dead_letter(
                    f"{event.source_topic}/{event.source_partition}/{event.source_offset}", "record",
                    event.source_topic, event.source_partition, event.source_offset, ts, event.error,
                    event.processor, key=event.key, value=event.value, headers=list(event.headers.items()),
                    error_class=event.error_class, stage=event.stage, evidence=f"{topic}/{partition}/{offset}"))
                result.dead_letters += 1
            elif isinstance(event, ev.DeadLetterDismissed):
                out.replays.append({"id": event.dead_letter_id, "broker_ts": ts, "operator": event.operator,
                                    "reason": event.reason, "mark": "dismissed"})
            continue
        if isinstance(event, ev.UploadCompleted):
            out.uploads.append({"upload_id": event.upload_id, "job_id": event.job_id, "filename": event.filename,
                                "size_bytes": event.size_bytes, "sha256": event.sha256, "priority": event.priority,
                                "broker_ts": ts, "submitter": event.submitter})
            continue
        duplicate = event.dedup_key in seen
        applied = superseded = False
        if not duplicate:
            try:
                row, applied, superseded = lifecycle.evolve(rows.get(event.job_id), event, ts)
            except (ArithmeticError, ValueError, TypeError) as exc:  # e.g. a lease of NaN or 1e12 seconds
                out.dead.append(dead_letter(
                    f"{topic}/{partition}/{offset}", "projection", topic, partition, offset, ts,
                    f"{event.event_type} cannot be applied to its job: {type(exc).__name__}: {exc}", "projector",
                    key=message.key(), value=message.value(), headers=message.headers(),
                    error_class="invalid_input", job_id=event.job_id, stage=event.stage, attempt=event.attempt,
                    evidence=f"{topic}/{partition}/{offset}"))
                result.dead_letters += 1
                row = None  # kept as evidence, not applied
                applied = superseded = False
            if applied and row is not None:
                row["log_partition"] = partition  # a new dict of evolve's own (lifecycle.Outcome)
                rows[event.job_id] = row
                out.changed.add(event.job_id)
                seen.add(event.dedup_key)
                out.new_keys.append(event.dedup_key)
                if isinstance(event, ev.JobDeadLettered):
                    out.dead.append(dead_letter(
                        f"{event.job_id}/{event.attempt}", "job", topic, partition, offset, ts, event.reason,
                        event.recorded_by.split("@", 1)[0], error_class=event.error_class, job_id=event.job_id,
                        stage=event.stage, attempt=event.attempt, attempts=event.attempts, evidence=event.evidence))
                elif isinstance(event, ev.JobReplayed) and event.dead_letter_id:
                    out.replays.append({"id": event.dead_letter_id, "broker_ts": ts, "operator": event.operator,
                                        "reason": event.reason})
        result.applied += applied
        result.duplicates += duplicate
        result.superseded += superseded
        evidence.append((  # lifecycle.EVIDENCE_COLUMNS order
            topic, partition, offset, ts, event.event_id, event.event_type, event.job_id, event.stage, event.attempt,
            event.claim_token, event.dedup_key, event.occurred_at, event.recorded_by, event.causation_id, applied,
            superseded, duplicate, payload if binary_payload else payload.decode()))
    return out


def _holds_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(key) or _holds_nul(item) for key, item in value.items())
    if isinstance(value, list):
        return any(_holds_nul(item) for item in value)
    return False


_ENVELOPE_TEXT = ("event_id", "event_type", "job_id", "stage", "claim_token", "dedup_key", "recorded_by",
                  "correlation_id", "causation_id")


def unstorable(event: ev.Event, payload: bytes) -> str | None:
    """Why PostgreSQL cannot store `event` (its envelope's text columns and `payload`, its other
    fields as JSON text), or None. The one such value Avro allows: a NUL character in a string,
    which `text` cannot hold (nor jsonb, the payload's type before migration 018; json stores the
    escape `\\u0000` but every `->>` read of that field fails)."""
    if b"\\u0000" in payload and _holds_nul(json.loads(payload)):  # (not a literal backslash-u0000)
        return f"{event.event_type} holds a NUL character in a string field; PostgreSQL text cannot store it"
    values = event.__dict__
    for name in _ENVELOPE_TEXT:
        value = values.get(name)
        if value is not None and "\x00" in value:
            return f"{event.event_type} holds a NUL character in {name}; PostgreSQL text cannot store it"
    return None



def dead_letter(id: str, kind: str, topic: str | None, partition: int | None, offset: int | None,
                broker_ts: datetime, error: str, seen_by: str, *, key: bytes | None = None,
                value: bytes | None = None, headers: list[tuple[str, bytes | None]] | None = None,
                error_class: str | None = None, job_id: str | None = None, stage: str | None = None,
                attempt: int | None = None, attempts: int | None = None, evidence: str | None = None
                ) -> dict[str, Any]:
    """Parameters of `upsert_dead_letter` (migration 005 documents each column)."""
    encoded = {name: base64.b64encode(raw or b"").decode() for name, raw in headers} if headers else None
    return {"id": id, "kind": kind, "topic": topic, "partition": partition, "offset": offset, "broker_ts": broker_ts,
            "key": key, "value": value, "headers": Jsonb(encoded) if encoded is not None else None, "error": error,
            "job_id": job_id, "stage": stage, "attempt": attempt, "error_class": error_class, "attempts": attempts,
            "evidence": evidence, "seen_by": [seen_by]}

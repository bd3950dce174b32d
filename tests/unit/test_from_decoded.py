"""`Event.from_decoded` (the projector's and the bulk replay's way from a decoded record to a model)
builds exactly the model `from_record` validates, for every event type, and skips validation only
where the Avro schema already guarantees each field's Python type."""

from __future__ import annotations

import random
import types
import typing
from datetime import datetime

import pytest

from bench import lifecycles
from domain import events as ev
from domain.codec import default_codec
from tests.golden import load

codec = default_codec()
AVRO_SCALARS = {"string": str, "int": int, "long": int, "double": float, "float": float, "boolean": bool,
                "null": type(None)}


def avro_python_types(avro_type) -> set[type]:
    """The Python types fastavro returns for one Avro field type (scalars only; else `object`)."""
    if isinstance(avro_type, list):
        return set().union(*(avro_python_types(member) for member in avro_type))
    if isinstance(avro_type, dict):
        if avro_type.get("logicalType") in ("timestamp-micros", "timestamp-millis"):
            return {datetime}
        if avro_type.get("logicalType"):
            return {object}
        return avro_python_types(avro_type["type"]) if isinstance(avro_type.get("type"), str) else {object}
    return {AVRO_SCALARS.get(avro_type, object)}


def annotation_types(annotation) -> set[type]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return set(typing.get_args(annotation))
    return {annotation}


def check_fields(model, avro_fields: list[dict], where: str) -> None:
    """Each field of `model` has exactly the Python types fastavro and cavro return for its Avro type,
    or is a nested record (or array of records) whose fields do, recursively."""
    avro = {f["name"]: f["type"] for f in avro_fields}
    assert list(avro) == list(model.model_fields), f"{where}: schema and model list the same fields in order"
    for field, info in model.model_fields.items():
        avro_type = avro[field]
        members = annotation_types(info.annotation)
        if typing.get_origin(info.annotation) is list:
            assert isinstance(avro_type, dict) and avro_type["type"] == "array", f"{where}.{field}"
            item = typing.get_args(info.annotation)[0]
            if isinstance(item, type) and issubclass(item, ev.BaseModel):
                check_fields(item, avro_type["items"]["fields"], f"{where}.{field}[]")
            else:
                assert avro_python_types(avro_type["items"]) == {item}, f"{where}.{field}[]"
            continue
        nested = [m for m in members if isinstance(m, type) and issubclass(m, ev.BaseModel)]
        if nested:
            records = [t for t in (avro_type if isinstance(avro_type, list) else [avro_type]) if isinstance(t, dict)]
            assert len(nested) == 1 and len(records) == 1 and records[0]["type"] == "record", f"{where}.{field}"
            assert (type(None) in members) == ("null" in (avro_type if isinstance(avro_type, list) else [])), \
                f"{where}.{field}: optional in both or neither"
            check_fields(nested[0], records[0]["fields"], f"{where}.{field}")
            continue
        assert members == avro_python_types(avro_type), f"{where}.{field}"


@pytest.mark.parametrize("name", sorted(ev.Event.registry))
def test_unvalidated_types_have_exactly_their_avro_types(name):
    cls = ev.Event.registry[name]
    fast = ev._plan(cls) is not None
    schema = codec.schemas.get(name)
    if schema is None:
        assert not fast or name not in codec.schemas
        return
    if fast:
        check_fields(cls, schema["fields"], name)
    if name in ("Heartbeat", "CheckpointRecorded", "AttemptStarted", "StageQueued", "JobAccepted",
                "AttemptSucceeded", "Published"):  # most of a log, and its nested records and lists
        assert fast
    if name == "DeadLetter":  # bytes and a map: validated
        assert not fast


def sample_records() -> list[dict]:
    values = [value for _, value, _ in load()]
    rng = random.Random(5)
    for job in (lifecycles.job(rng, heartbeats=3, checkpoints=2, failed_attempts=1, zombie=True),
                lifecycles.job(rng, heartbeats=2, checkpoints=1, terminal_failure=True)):
        values += [codec.encode(event.to_record()) for event in job]
        values.append(codec.encode(lifecycles.upload(job[0].upload_id).to_record()))
    return [codec.decode(value) for value in values]


def test_from_decoded_equals_the_validated_model_field_for_field_and_in_json():
    records = sample_records()
    kinds = {record["event_type"] for record in records}
    assert {"Heartbeat", "CheckpointRecorded", "JobAccepted", "AttemptSucceeded", "JobFailed", "RetryScheduled",
            "UploadCompleted", "JobCompleted"} <= kinds
    for record in records:
        validated = ev.Event.from_record(dict(record))
        built = ev.Event.from_decoded(dict(record))
        assert type(built) is type(validated)
        assert built.model_dump() == validated.model_dump()
        assert built.model_dump_json() == validated.model_dump_json()
        assert built.__pydantic_serializer__.to_json(built) == validated.model_dump_json().encode()


def test_from_decoded_refuses_what_from_record_refuses():
    with pytest.raises(ev.SchemaError):
        ev.Event.from_decoded({"event_type": "NoSuchEvent"})
    record = sample_records()[0]
    del record["dedup_key"]  # a field count that is not the model's goes through validation
    with pytest.raises(ev.SchemaError):
        ev.Event.from_decoded(record)

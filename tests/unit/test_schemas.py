"""The contract: every event round-trips, old versions stay readable, garbage is our own error."""

from __future__ import annotations

import copy
import json

import pytest
from fastavro.utils import generate_many

from domain import events as ev
from domain import codec as codec_module
from domain.codec import MAGIC, Codec, default_codec, schema_fingerprint
from schemas.register import incompatibilities, registered_versions
from domain.errors import DecodeError, SchemaError
from tapeline.clock import system_clock

codec = default_codec()
EVENT_TYPES = sorted(codec.schemas)


def test_every_design_event_has_a_schema_and_a_model():
    design = {"UploadCompleted", "JobAccepted", "JobRejected", "StageQueued", "AttemptStarted", "Heartbeat",
              "CheckpointRecorded", "AttemptSucceeded", "AttemptFailed", "AttemptYielded", "StallDetected",
              "RetryScheduled", "JobFailed", "JobDeadLettered", "JobReplayed", "PublishIntended", "Published",
              "NeedsReview", "JobCompleted", "JobCancelled", "WatchdogTick"}
    assert design <= set(EVENT_TYPES)
    assert set(EVENT_TYPES) == set(ev.Event.registry)


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_round_trip_of_generated_records(event_type):
    for record in generate_many(codec.parsed[event_type], 5):
        record["event_type"] = event_type
        data = codec.encode(record)
        assert data[:2] == MAGIC and data[2:10] == codec.fingerprints[event_type]
        decoded = codec.decode(data)
        assert decoded["event_type"] == event_type and decoded["job_id"] == record["job_id"]
        assert codec.encode(decoded) == data  # logical types (timestamps) come back as datetimes: compare bytes


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_model_fields_equal_schema_fields(event_type):
    schema_fields = [f["name"] for f in codec.schemas[event_type]["fields"]]
    assert schema_fields[:11] == ["event_id", "event_type", "job_id", "stage", "attempt", "claim_token", "occurred_at",
                                  "recorded_by", "correlation_id", "causation_id", "dedup_key"]
    assert set(ev.Event.registry[event_type].model_fields) == set(schema_fields)


def test_model_round_trip_through_the_codec():
    event = ev.JobAccepted.new(system_clock.stamp(), 
        job_id=ev.job_id_for("u1"), stage="intake", attempt=0, recorded_by="t", correlation_id="u1",
        upload_id="u1", source_key="uploads/u1/a.mp4", source_sha256="ab" * 32, source_size_bytes=10,
        priority="standard", profile="default",
        media=ev.SourceMedia(format_name="mov", duration_s=5.28, width=1280, height=720, display_width=1280,
                             display_height=720, rotation=0, fps=25.0, frames=132, video_codec="h264"),
        ladder=[ev.Rendition(name="720p", width=1280, height=720, video_bitrate_kbps=2800)])
    assert ev.Event.from_record(codec.decode(codec.encode(event.to_record()))) == event
    assert event.dedup_key == f"{event.job_id}:intake:0:JobAccepted"


def test_job_id_is_uuid5_of_the_upload_id():
    assert ev.job_id_for("upload-1") == ev.job_id_for("upload-1") != ev.job_id_for("upload-2")


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_current_schema_is_registered(event_type):
    """A changed schema must be registered (`python -m schemas.register`), which checks compatibility."""
    fingerprints = {schema_fingerprint(s) for s in registered_versions().get(event_type, [])}
    assert codec.fingerprints[event_type] in fingerprints, \
        f"{event_type} changed: run `python -m schemas.register` (it refuses incompatible changes)"


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_every_registered_version_is_readable_by_the_current_schema(event_type):
    for old in registered_versions()[event_type]:
        assert incompatibilities(old, codec.schemas[event_type]) == []


def test_incompatible_change_is_detected():
    old = codec.schemas["JobFailed"]
    new = copy.deepcopy(old)
    new["fields"].append({"name": "operator_note", "type": "string"})  # no default: old events lack it
    assert incompatibilities(old, new)
    compatible = copy.deepcopy(old)
    compatible["fields"].append({"name": "operator_note", "type": ["null", "string"], "default": None})
    assert incompatibilities(old, compatible) == []


def test_old_version_with_fewer_fields_is_read_with_defaults(tmp_path):
    """A record written by an older schema (without an optional field) decodes with the default."""
    old = copy.deepcopy(codec.schemas["JobCompleted"])
    old["fields"] = [f for f in old["fields"] if f["name"] != "media_duration_s"]
    (tmp_path / "JobCompleted-old.avsc").write_text(json.dumps(old))
    reader = Codec(registered_dir=tmp_path)
    writer = Codec(registered_dir=None)
    writer.parsed["JobCompleted"] = __import__("fastavro").parse_schema(old)
    writer.fingerprints["JobCompleted"] = schema_fingerprint(old)
    record = ev.JobCompleted.new(system_clock.stamp(), job_id="j", stage="publish", attempt=1, recorded_by="t", correlation_id="u",
                                 master_url="http://x/m.m3u8").to_record()
    record.pop("media_duration_s")
    decoded = reader.decode(writer.encode(record))
    assert decoded["media_duration_s"] is None and decoded["master_url"] == "http://x/m.m3u8"


@pytest.mark.parametrize("garbage", [b"", b"hello world", b"\xc3\x01" + b"\x00" * 8 + b"body",
                                     b"\xc3\x01" + bytes.fromhex("5deb2622e72d7f74")])
def test_garbage_raises_our_decode_error_with_position(garbage):
    with pytest.raises(DecodeError) as info:
        codec.decode(garbage, topic="tapeline.jobs", partition=3, offset=42)
    assert info.value.topic == "tapeline.jobs" and info.value.partition == 3 and info.value.offset == 42
    assert "tapeline.jobs[3]@42" in str(info.value)


def test_truncated_valid_record_is_a_decode_error():
    event = ev.JobFailed.new(system_clock.stamp(), job_id="j", stage="transcode", attempt=1, recorded_by="t", correlation_id="u",
                             error_class="invalid_input", reason="bad")
    data = codec.encode(event.to_record())
    with pytest.raises(DecodeError):
        codec.decode(data[:-5], topic="t", partition=0, offset=1)


def test_encoding_a_record_that_does_not_fit_is_a_schema_error():
    with pytest.raises(SchemaError):
        codec.encode({"event_type": "JobFailed", "job_id": 5})
    with pytest.raises(SchemaError):
        codec.encode({"event_type": "NoSuchEvent"})


@pytest.mark.parametrize("trailing", [b"x", b"\x00", codec_module._END[:-1], codec_module._END,
                                      codec_module._END + b"more"])
def test_trailing_bytes_after_a_valid_body_are_a_decode_error(trailing):
    event = ev.JobFailed.new(system_clock.stamp(), job_id="j", stage="transcode", attempt=1, recorded_by="t", correlation_id="u",
                             error_class="invalid_input", reason="bad")
    with pytest.raises(DecodeError, match="trailing bytes"):
        codec.decode(codec.encode(event.to_record()) + trailing, topic="t", partition=0, offset=1)


def test_a_bytes_field_holding_the_fast_readers_end_mark_still_decodes():
    value = b"raw " + codec_module._END + b" tail"  # the slow path reads it (no string can hold the mark: \xff)
    event = ev.DeadLetter.new(system_clock.stamp(), job_id="j", stage="intake", attempt=0, recorded_by="t", correlation_id="u",
                              source_topic="t.uploads", source_partition=0, source_offset=3, value=value,
                              error_class="invalid_input", error="undecodable", processor="intake")
    assert codec.decode(codec.encode(event.to_record()))["value"] == value

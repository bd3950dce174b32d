"""Property-based tests of the decoders (issue 5, item 9): random bytes and mutated valid records fed
to the event codec, the upload intake's decode/decision path and the ffprobe interpretation. Every
case ends in our own error type or a dead-letter record, never an unhandled exception.

No services: the codec, `processors.intake.triage`/`preflight`/`decide` and `media.interpret_probe`
are pure.
"""

from __future__ import annotations

import random
import string

import pytest
from fastavro.utils import generate_many
from hypothesis import HealthCheck, given, settings as hyp_settings, strategies as st

from processors import media
from domain.policy.intake_decision import preflight
from processors.intake import decide, triage
from domain import events as ev
from domain.codec import HEADER_BYTES, MAGIC, default_codec
from domain.errors import DecodeError, InvalidInput, MediaError, SchemaError, UnsupportedMedia
from tapeline.settings import Settings
from tapeline.clock import system_clock
from tests.fakeclock import FixedClock

codec = default_codec()
SETTINGS = Settings(topic_prefix="fuzz")
CLOCK = FixedClock()  # the writer's clock of the decided events
FUZZ = hyp_settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WHERE = dict(topic="fuzz.uploads", partition=1, offset=7)


def _valid_records() -> list[bytes]:
    """Two encoded random-but-valid records of every event type (seeded, so runs are repeatable)."""
    state = random.getstate()
    random.seed(20240505)
    try:
        return [codec.encode({**record, "event_type": name}) for name in sorted(codec.parsed)
                for record in generate_many(codec.parsed[name], 2)]
    finally:
        random.setstate(state)


VALID = _valid_records()


def _upload(upload_id: str = "u-1", **fields) -> ev.UploadCompleted:
    base = dict(job_id=ev.job_id_for(upload_id), stage="intake", attempt=0, recorded_by="fuzz",
                correlation_id=upload_id, upload_id=upload_id, bucket="b", object_key=f"uploads/{upload_id}/a.mp4",
                size_bytes=1000, sha256="0" * 64, filename="a.mp4", priority="standard")
    return ev.UploadCompleted.new(system_clock.stamp(), **{**base, **fields})


VALID_UPLOAD = codec.encode(_upload().to_record())


@st.composite
def mutated(draw, originals: list[bytes] = VALID) -> bytes:
    """A valid record with one to three mutations: flipped, inserted, deleted or replaced bytes,
    truncation, or a random body after a real header."""
    data = bytearray(draw(st.sampled_from(originals)))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "body", "set"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete" and data:
            del data[at:at + draw(st.integers(1, 8))]
        elif kind == "truncate":
            data = data[:at]
        elif kind == "body":
            data = data[:HEADER_BYTES] + draw(st.binary(max_size=200))
        elif kind == "set" and data:
            data[at] = draw(st.sampled_from([0x00, 0x01, 0x02, 0x7F, 0x80, 0xFE, 0xFF]))
    return bytes(data)


any_record = st.one_of(
    st.binary(max_size=300),
    st.binary(max_size=200).map(lambda body: MAGIC + body),
    st.sampled_from(sorted(codec.writers)).flatmap(lambda fp: st.binary(max_size=200).map(lambda b: MAGIC + fp + b)),
    mutated(),
    mutated([VALID_UPLOAD]),
)


# --- the event codec -----------------------------------------------------------------------------

@FUZZ
@given(data=any_record)
def test_codec_decodes_or_raises_decode_error_and_models_validate_or_raise_schema_error(data):
    try:
        record = codec.decode(data, **WHERE)
    except DecodeError as exc:
        assert (exc.topic, exc.partition, exc.offset) == ("fuzz.uploads", 1, 7)
        return
    assert isinstance(record, dict) and record["event_type"] in codec.schemas
    try:
        event = ev.Event.from_record(record)
    except SchemaError:
        return
    # whatever decodes and validates encodes again (the processors re-emit parts of it)
    assert codec.decode(codec.encode(event.to_record()))["event_id"] == event.event_id


def test_the_fuzzer_reaches_valid_records_and_both_error_paths():
    """The strategies are not vacuous: unmutated records decode, mutated ones do fail both ways."""
    assert all(codec.decode(data)["event_type"] for data in VALID)
    with pytest.raises(DecodeError, match="corrupt UploadCompleted body"):
        codec.decode(VALID_UPLOAD[:HEADER_BYTES] + b"\xff" * 20)
    bad_priority = codec.decode(VALID_UPLOAD)
    with pytest.raises(SchemaError, match="UploadCompleted"):
        ev.Event.from_record({**bad_priority, "attempt": "not a number"})


# --- the upload intake ---------------------------------------------------------------------------

headers = st.lists(st.tuples(st.text(max_size=10), st.one_of(st.none(), st.binary(max_size=20))), max_size=3)


def _triage(value, key=b"k", hdrs=None):
    return triage(codec, SETTINGS, "fuzz@test", key=key, value=value, headers=hdrs, **WHERE, clock=CLOCK)


def _assert_dead_letter(outgoing, value, key) -> None:
    topic, letter = outgoing
    assert topic == "fuzz.dlq" and isinstance(letter, ev.DeadLetter)
    assert (letter.source_topic, letter.source_partition, letter.source_offset) == ("fuzz.uploads", 1, 7)
    assert letter.error_class == "invalid_input" and letter.error
    # the dead letter itself must be producible: it encodes, and keeps the raw bytes
    back = ev.Event.from_record(codec.decode(codec.encode(letter.to_record())))
    assert back.value == value and back.key == key


@FUZZ
@given(value=st.one_of(st.none(), any_record), key=st.one_of(st.none(), st.binary(max_size=40)), hdrs=headers)
def test_intake_triage_yields_an_upload_or_a_dead_letter(value, key, hdrs):
    result = _triage(value, key, hdrs)
    if isinstance(result, ev.UploadCompleted):
        assert result.job_id == ev.job_id_for(result.upload_id)
    else:
        _assert_dead_letter(result, value, key)


def test_triage_dead_letters_each_kind_of_bad_record():
    job_failed = ev.JobFailed.new(system_clock.stamp(), job_id="j", stage="transcode", attempt=1, recorded_by="t", correlation_id="u",
                                  error_class="invalid_input", reason="bad")
    wrong_job = _upload().model_copy(update={"job_id": ev.job_id_for("another upload")})
    for value, message in [(None, "missing C3 01 marker"), (b"garbage", "missing C3 01 marker"),
                           (codec.encode(job_failed.to_record()), "JobFailed on the uploads topic"),
                           (codec.encode(wrong_job.to_record()), "job_id is not uuid5(upload_id)")]:
        result = _triage(value, hdrs=[("h", None)])
        _assert_dead_letter(result, value, b"k")
        assert message in result[1].error and result[1].headers == {"h": b""}
    assert _triage(VALID_UPLOAD) == ev.Event.from_record(codec.decode(VALID_UPLOAD))


PROBED = ev.SourceMedia(format_name="mov", duration_s=5.3, width=1280, height=720, display_width=1280,
                        display_height=720, rotation=0, fps=25.0, frames=132, video_codec="h264", audio_codec="aac")
int64 = st.integers(-(2**63), 2**63 - 1)


@FUZZ
@given(upload_id=st.text(max_size=40), object_key=st.text(max_size=60), size=int64,
       sha=st.text(alphabet=string.hexdigits, max_size=70), priority=st.one_of(st.sampled_from(["archive", "standard",
       "index"]), st.text(max_size=12)), filename=st.text(max_size=30), profile=st.text(max_size=12))
def test_any_decodable_upload_gets_a_decision_that_encodes(upload_id, object_key, size, sha, priority, filename,
                                                            profile):
    upload = _upload(upload_id, object_key=object_key, size_bytes=size, sha256=sha, priority=priority,
                     filename=filename, profile=profile)
    result = _triage(codec.encode(upload.to_record()))
    assert result == upload
    problem = preflight(result, SETTINGS)
    if problem is not None:
        assert isinstance(problem, MediaError) and problem.error_class in ("invalid_input", "limits_exceeded")
    outgoing = decide(None, result, problem or PROBED, SETTINGS, "fuzz@test", clock=CLOCK)
    expected = ["JobRejected"] if problem is not None else ["JobAccepted", "StageQueued", "WorkItem"]
    assert [event.event_type for _, event in outgoing] == expected
    for _, event in outgoing:
        codec.decode(codec.encode(event.to_record()))


# --- the ffprobe interpretation ------------------------------------------------------------------

json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
json_value = st.recursive(json_scalar, lambda inner: st.lists(inner, max_size=3) |
                          st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def plausible(*values):
    """A key's value: usually one that ffprobe prints, sometimes anything."""
    return st.one_of(st.sampled_from(values), json_value)


stream = st.fixed_dictionaries({}, optional={
    "index": plausible(0, 1, 2, "1", -1),
    "codec_type": plausible("video", "audio", "subtitle", "data"),
    "codec_name": plausible("h264", "aac", None),
    "width": plausible(1280, 176, 0, "720", 70000, -4),
    "height": plausible(720, 144, 1, "N/A"),
    "sample_aspect_ratio": plausible("1:1", "128:117", "0:1", "1:0", "N/A", "1e308:1e-308"),
    "avg_frame_rate": plausible("25/1", "0/0", "30000/1001", "1e400/1"),
    "r_frame_rate": plausible("25/1", "x"),
    "duration": plausible("5.28", "N/A", "-1", "inf", "1e300"),
    "nb_frames": plausible("132", "N/A", "99999999999999999999"),
    "nb_read_packets": plausible("132", "76", "0"),
    "disposition": plausible({"attached_pic": 1}, {"attached_pic": 0}, [1]),
    "tags": plausible({"rotate": "90"}, {"rotate": "abc"}, {"rotate": "1e999"}, "tags"),
    "side_data_list": plausible([{"rotation": -90}], [{"rotation": "x"}], [5], {"rotation": 90}),
})
probe_json = st.fixed_dictionaries({}, optional={
    "streams": st.one_of(st.lists(stream, max_size=3), json_value),
    "format": st.one_of(st.fixed_dictionaries({}, optional={
        "format_name": plausible("mov,mp4,m4a,3gp,3g2,mj2", 5),
        "duration": plausible("5.312", "N/A", "nan"),
        "bit_rate": plausible("1589963", "N/A", 12, "-3")}), json_value),
})


@FUZZ
@given(info=probe_json)
def test_any_ffprobe_output_becomes_a_probe_or_a_media_error(info):
    try:
        probe = media.interpret_probe(info)
    except (InvalidInput, UnsupportedMedia):
        return
    source = probe.media
    assert source.width > 0 and source.height > 0 and source.duration_s > 0
    assert source.rotation in (0, 90, 180, 270) and probe.video_stream >= 0
    # ... and everything downstream of a probe accepts it: limits, the ladder, the accepted event
    try:
        media.check_limits(source, SETTINGS)
    except MediaError as exc:
        assert exc.error_class == "limits_exceeded"
    ladder = media.plan_ladder(source, SETTINGS.ladder)
    assert all(r.width % 2 == 0 and r.height % 2 == 0 for r in ladder)
    outgoing = decide(None, _upload(), source, SETTINGS, "fuzz@test", clock=CLOCK)
    for _, event in outgoing:
        codec.decode(codec.encode(event.to_record()))

"""Golden old events (tests/golden, written by schema version 1 of Heartbeat and JobCompleted, before
an optional field was added to each) are read by the current codec and models, field for field."""

from __future__ import annotations


from domain import events as ev
from domain.codec import default_codec, schema_fingerprint
from schemas.register import registered_versions
from tests.golden import assert_decodes_as_expected, load
from tests.golden.make_golden import FIELDS_ADDED_AFTER_V1

codec = default_codec()
GOLDEN = load()


def registered_fingerprints(event_type: str) -> dict[bytes, dict]:
    return {schema_fingerprint(s): s for s in registered_versions()[event_type]}


def test_golden_records_are_old_versions_where_the_schema_evolved():
    kinds = [record["event_type"] for record, _, _ in GOLDEN]
    assert kinds.count("Heartbeat") == 3 and kinds.count("JobCompleted") == 1 and len(kinds) == 13
    for record, value, _ in GOLDEN:
        fingerprint = value[2:10]
        assert fingerprint.hex() == record["writer_fingerprint"]
        old = registered_fingerprints(record["event_type"])
        assert fingerprint in old, f"{record['event_type']} writer schema is not registered"
        if record["event_type"] in FIELDS_ADDED_AFTER_V1:
            assert fingerprint != codec.fingerprints[record["event_type"]]
            writer_fields = [f["name"] for f in old[fingerprint]["fields"]]
            current_fields = [f["name"] for f in codec.schemas[record["event_type"]]["fields"]]
            assert [f for f in current_fields if f not in writer_fields] == list(FIELDS_ADDED_AFTER_V1[record["event_type"]])


def test_golden_records_decode_to_the_expected_events():
    for record, value, expected in GOLDEN:
        assert_decodes_as_expected(record, value, expected)


def test_fields_missing_from_old_writers_read_as_their_defaults():
    events = [ev.Event.from_record(codec.decode(value)) for _, value, _ in GOLDEN]
    heartbeats = [e for e in events if isinstance(e, ev.Heartbeat)]
    assert [(h.sequence, h.frames_done, h.out_time_s, h.speed) for h in heartbeats] == \
        [(1, 40, 1.6, None), (2, 90, 3.6, None), (3, 132, 5.28, None)]
    completed = [e for e in events if isinstance(e, ev.JobCompleted)]
    assert [(c.media_duration_s, c.master_url.endswith("/master.m3u8")) for c in completed] == [(None, True)]


def test_reencoding_gives_the_same_bytes_exactly_when_the_writer_schema_is_current():
    for record, value, _ in GOLDEN:
        current = codec.encode(codec.decode(value))
        assert current[2:10] == codec.fingerprints[record["event_type"]]
        assert (current == value) == (value[2:10] == codec.fingerprints[record["event_type"]])
    assert sum(value[2:10] != codec.fingerprints[r["event_type"]] for r, value, _ in GOLDEN) >= 4

"""`domain/policy/disclosure.py`: what a read shows a caller without the admin token (issue 44 item 5),
and `dismiss_events`, the pure core of dismissing an undecodable record's dead letter (item 6)."""

from __future__ import annotations

from datetime import datetime, timezone

from domain import events as ev
from domain.policy.disclosure import public_dead_letter, public_view
from processors.operator_events import dismiss_events
from tapeline.settings import Settings
from tests.fakeclock import FixedClock

DIGEST = "a" * 64


def test_fencing_tokens_are_withheld_at_any_depth():
    answer = [{"claim_token": "c1", "payload": {"notifier_token": "n1", "items": [{"claim_token": "c2", "x": 1}]}}]
    assert public_view(answer) == [{"claim_token": None, "payload": {"notifier_token": None,
                                                                     "items": [{"claim_token": None, "x": 1}]}}]


def test_an_objects_digest_and_size_are_shown_only_when_the_object_is_public_or_the_jobs_own_source():
    def facts(key_field: str, key: str) -> tuple:
        shown = public_view({key_field: key, "sha256": DIGEST, "size_bytes": 10, "content_type": "video/mp2t"})
        return shown[key_field], shown["sha256"], shown["size_bytes"], shown["content_type"]

    for key_field in ("key", "object_key"):
        assert facts(key_field, "work/j/transcode/1/720p/seg_00000.ts") == (
            "work/j/transcode/1/720p/seg_00000.ts", None, None, "video/mp2t")
        assert facts(key_field, "markers/j/webhook.json")[1:3] == (None, None)
        assert facts(key_field, "published/j/master.m3u8")[1:3] == (DIGEST, 10)
        assert facts(key_field, "uploads/u1/source.mp4")[1:3] == (DIGEST, 10)
    # A digest that names no object (the job's own source, `source_sha256`) and one with no key stay.
    assert public_view({"source_sha256": DIGEST, "source_size_bytes": 5}) == {"source_sha256": DIGEST,
                                                                             "source_size_bytes": 5}
    assert public_view({"sha256": DIGEST})["sha256"] == DIGEST


def test_the_view_is_new_and_leaves_the_answer_alone():
    answer = {"outputs": [{"key": "work/x", "sha256": DIGEST}], "claim_token": "c"}
    shown = public_view(answer)
    assert answer == {"outputs": [{"key": "work/x", "sha256": DIGEST}], "claim_token": "c"}
    assert shown == {"outputs": [{"key": "work/x", "sha256": None}], "claim_token": None}


def test_a_dead_letters_raw_record_is_withheld_and_the_rest_is_shown():
    letter = {"id": "t/0/5", "kind": "record", "key": "a2V5", "value": "dmFsdWU=", "headers": {"h": "dg=="},
              "error": "not Avro", "topic": "t", "partition": 0, "offset": 5}
    assert public_dead_letter(letter) == {**letter, "key": None, "value": None, "headers": None}


SETTINGS = Settings(app_name="t")
CLOCK = FixedClock(datetime(2026, 12, 7, tzinfo=timezone.utc))


def test_dismissing_writes_one_event_on_the_dead_letter_topic_keyed_by_the_dead_letter():
    letter = {"id": "t.uploads/2/17", "kind": "record", "dismissed_at": None}
    [(topic, event)] = dismiss_events(letter, "alice", "producer fixed", SETTINGS, "operator@h", clock=CLOCK)
    assert topic == SETTINGS.dlq_topic and isinstance(event, ev.DeadLetterDismissed)
    assert (event.job_id, event.dead_letter_id, event.operator, event.reason, event.stage, event.attempt) == (
        "t.uploads/2/17", "t.uploads/2/17", "alice", "producer fixed", "operator", 0)
    again = dismiss_events(letter, "bob", "again", SETTINGS, "operator@h", clock=CLOCK)[0][1]
    assert again.dedup_key == event.dedup_key  # one per dead letter, whoever writes it


def test_a_jobs_dead_letter_a_dismissed_one_and_none_are_not_dismissed():
    assert dismiss_events({"id": "j/3", "kind": "job"}, "a", "b", SETTINGS, "o", clock=CLOCK) == []
    assert dismiss_events({"id": "t/0/1", "kind": "projection", "dismissed_at": datetime(2026, 1, 1)}, "a", "b",
                          SETTINGS, "o", clock=CLOCK) == []
    assert dismiss_events(None, "a", "b", SETTINGS, "o", clock=CLOCK) == []
    assert len(dismiss_events({"id": "t/0/1", "kind": "projection"}, "a", "b", SETTINGS, "o", clock=CLOCK)) == 1

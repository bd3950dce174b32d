"""Media replication's pure part (`domain/replication.py`): which objects each event names, what the
replicator does after a failed copy, and the totals `region status` prints."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from domain import events as ev
from domain.replication import (CopyFailure, NamedObject, RecordedObject, Verdict, after_failure, merge_named,
                                object_totals, objects_named, pending_age_s, retry_delay_s)
from tests.fakeclock import FixedClock

CLOCK = FixedClock()
JOB = ev.job_id_for("u-1")
COMMON = dict(job_id=JOB, recorded_by="test", correlation_id="u-1")
SHA = {name: name * 64 for name in "abcdef"}
MEDIA = ev.SourceMedia(format_name="mov", duration_s=5.28, width=1280, height=720, display_width=1280,
                       display_height=720, rotation=0, fps=25.0, frames=132, video_codec="h264")


def _output(key: str, sha: str, size: int = 10) -> ev.OutputFile:
    return ev.OutputFile(key=key, sha256=sha, size_bytes=size, content_type="video/mp2t")


def _published_rendition(name: str) -> ev.Rendition:
    return ev.Rendition(name=name, width=1280, height=720, video_bitrate_kbps=2800,
                        playlist_key=f"published/{JOB}/{name}/index.m3u8", url="http://x")


NAMING = {
    "UploadCompleted": (
        ev.UploadCompleted.new(CLOCK.stamp(), stage="intake", attempt=0, upload_id="u-1", bucket="b",
                               object_key="uploads/u-1/a.mp4", size_bytes=123, sha256=SHA["a"], filename="a.mp4",
                               priority="standard", **COMMON),
        [NamedObject("uploads/u-1/a.mp4", SHA["a"], 123)]),
    "JobAccepted": (
        ev.JobAccepted.new(CLOCK.stamp(), stage="intake", attempt=0, upload_id="u-1", source_key="uploads/u-1/a.mp4",
                           source_sha256=SHA["a"], source_size_bytes=123, priority="standard", profile="default",
                           media=MEDIA, ladder=[ev.Rendition(name="720p", width=1280, height=720,
                                                             video_bitrate_kbps=2800)], **COMMON),
        [NamedObject("uploads/u-1/a.mp4", SHA["a"], 123)]),
    "CheckpointRecorded": (
        ev.CheckpointRecorded.new(CLOCK.stamp(), stage="transcode", attempt=1, claim_token="t", sequence=3,
                                  segment_index=2, rendition="720p", object_key=f"work/{JOB}/transcode/1/720p/s2.ts",
                                  sha256=SHA["b"], frames=50, media_start_s=4.0, media_duration_s=2.0, **COMMON),
        [NamedObject(f"work/{JOB}/transcode/1/720p/s2.ts", SHA["b"])]),
    "AttemptSucceeded": (
        ev.AttemptSucceeded.new(CLOCK.stamp(), stage="transcode", attempt=1, claim_token="t",
                                outputs=[_output(f"work/{JOB}/transcode/1/720p/index.m3u8", SHA["c"], 300),
                                         _output(f"work/{JOB}/transcode/1/720p/s0.ts", SHA["d"], 9000)],
                                renditions=[], elapsed_s=3.0, **COMMON),
        [NamedObject(f"work/{JOB}/transcode/1/720p/index.m3u8", SHA["c"], 300),
         NamedObject(f"work/{JOB}/transcode/1/720p/s0.ts", SHA["d"], 9000)]),
    "ResultReused": (
        ev.ResultReused.new(CLOCK.stamp(), stage="intake", attempt=0, reused_job_id="other", profile_fingerprint="f",
                            master_key=f"published/{JOB}/master.m3u8", master_url="http://x",
                            renditions=[_published_rendition("720p")],
                            outputs=[_output(f"published/{JOB}/720p/index.m3u8", SHA["e"], 200),
                                     _output(f"published/{JOB}/master.m3u8", SHA["f"], 100)], **COMMON),
        [NamedObject(f"published/{JOB}/720p/index.m3u8", SHA["e"], 200),
         NamedObject(f"published/{JOB}/master.m3u8", SHA["f"], 100)]),
    "Published": (
        ev.Published.new(CLOCK.stamp(), stage="publish", attempt=1, claim_token="t", provider="origin",
                         provider_ref=f"published/{JOB}/master.m3u8", master_key=f"published/{JOB}/master.m3u8",
                         master_url="http://x", renditions=[_published_rendition("720p"), _published_rendition("360p")],
                         **COMMON),
        [NamedObject(f"published/{JOB}/master.m3u8", None), NamedObject(f"published/{JOB}/720p/index.m3u8", None),
         NamedObject(f"published/{JOB}/360p/index.m3u8", None)]),
}


@pytest.mark.parametrize("event_type", sorted(NAMING))
def test_an_event_that_names_objects_names_each_with_the_sha256_the_log_recorded(event_type: str) -> None:
    event, expected = NAMING[event_type]
    assert objects_named(event) == expected


@pytest.mark.parametrize("event_type", sorted(set(ev.Event.registry) - set(NAMING)))
def test_every_other_event_type_names_no_object(event_type: str) -> None:
    cls = ev.Event.registry[event_type]
    event = cls.model_construct(event_id="e", event_type=event_type, job_id=JOB, stage="transcode", attempt=1,
                                occurred_at=CLOCK.now(), recorded_by="t", correlation_id="c", dedup_key="k")
    assert objects_named(event) == []


def test_the_event_types_that_carry_object_keys_are_the_naming_ones_or_known_non_objects() -> None:
    """A new event type with an object key or outputs must be added to `objects_named` (or here, with why)."""
    not_objects = {("PublishIntended", "idempotency_key"),  # a provider's idempotency key, not a key of the bucket
                   ("NotificationIntended", "source_dedup_key"),  # an event's dedup key
                   ("JobAccepted", "ladder"),  # the planned ladder: no playlist exists yet
                   ("AttemptSucceeded", "renditions"), ("AttemptSucceeded", "audio_playlist_key")}  # among its outputs
    carrying = {(name, field) for name, cls in ev.Event.registry.items() for field, info in cls.model_fields.items()
                if field != "dedup_key" and (field.endswith("_key") or "OutputFile" in str(info.annotation)
                                             or "Rendition" in str(info.annotation))}
    work_items = {pair for pair in carrying if pair[0] == "WorkItem"}  # work topics: not followed, they repeat the log
    assert {name for name, _ in carrying - not_objects - work_items} == set(NAMING)


def test_a_published_master_named_twice_keeps_the_mention_with_a_sha256() -> None:
    key = f"published/{JOB}/master.m3u8"
    assert merge_named([NamedObject(key, None), NamedObject("x", "1" * 64), NamedObject(key, SHA["f"], 5),
                        NamedObject(key, None), NamedObject("", None)]) == [NamedObject(key, SHA["f"], 5),
                                                                            NamedObject("x", "1" * 64)]


def test_a_store_that_does_not_answer_holds_the_record_and_a_bad_object_is_parked() -> None:
    now = datetime(2026, 12, 5, 18, 0, tzinfo=timezone.utc)
    wait = after_failure(CopyFailure.STORE_UNAVAILABLE, 1, now)
    assert (wait.verdict, wait.retry_at) == (Verdict.WAIT, now + timedelta(seconds=0.5))
    for kind in (CopyFailure.MISSING_IN_A, CopyFailure.SHA256_MISMATCH, CopyFailure.CONFLICT_IN_B):
        parked = after_failure(kind, 3, now)
        assert (parked.verdict, parked.delay_s) == (Verdict.PARK, 2.0)
    assert [retry_delay_s(n) for n in (1, 2, 3, 7, 8, 100)] == [0.5, 1.0, 2.0, 30.0, 30.0, 30.0]
    assert retry_delay_s(3, first_s=0.1, max_s=0.3) == 0.3


def test_totals_count_each_key_once_and_age_the_oldest_pending_from_its_first_naming() -> None:
    t0 = datetime(2026, 12, 5, 18, 0, tzinfo=timezone.utc)
    recorded = [RecordedObject("a", "replicated", 100, t0), RecordedObject("b", "replicated", 50, t0),
                RecordedObject("c", "pending", 7, t0 + timedelta(seconds=5), "sha256_mismatch"),
                RecordedObject("d", "pending", None, t0 + timedelta(seconds=9), "missing_in_a")]
    unread = [(NamedObject("a", "1" * 64, 100), t0 + timedelta(seconds=1)),  # recorded: counted once, as recorded
              (NamedObject("e", "2" * 64, 30), t0 + timedelta(seconds=2)),
              (NamedObject("e", "2" * 64, 30), t0 + timedelta(seconds=3))]  # named twice: one object
    totals = object_totals(recorded, unread)
    assert (totals.named, totals.replicated, totals.replicated_bytes, totals.pending) == (5, 2, 150, 3)
    assert (totals.pending_bytes, totals.pending_bytes_known) == (37, False)
    assert totals.oldest_pending_named_at == t0 + timedelta(seconds=2)
    report = totals.as_dict(t0 + timedelta(seconds=12.04))
    assert report["oldest_pending_age_s"] == 10.0
    assert report["pending_by_reason"] == {"missing_in_a": 1, "sha256_mismatch": 1, "unread": 1}
    done = object_totals([RecordedObject("a", "replicated", 100, t0)], [])
    assert done.as_dict(t0)["pending"] == 0 and done.as_dict(t0)["oldest_pending_age_s"] is None
    assert pending_age_s(t0 + timedelta(seconds=3), t0) == 0.0

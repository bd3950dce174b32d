"""The intake decision as a pure policy (domain/policy/intake_decision.py): the clock comes in, the events go out."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from domain import events as ev
from domain.errors import QuotaExceeded
from domain.policy.intake_decision import decide
from processors import media
from processors.reuse import Reusable, full_profile
from tapeline.settings import Settings

SETTINGS = Settings(topic_prefix="unit")
MEDIA = ev.SourceMedia(format_name="mov", duration_s=5.28, width=1280, height=720, display_width=1280,
                       display_height=720, rotation=0, fps=25.0, frames=132, video_codec="h264", audio_codec="aac")
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
PROFILE = full_profile("default", media.plan_ladder(MEDIA, SETTINGS.ladder), SETTINGS)


def stamps():
    """A fixed clock: one millisecond and one numbered id per event."""
    n = iter(range(1000))

    def stamp() -> ev.Stamp:
        i = next(n)
        return ev.Stamp(T0 + timedelta(milliseconds=i), f"event-{i}")
    return stamp


def upload(priority="standard"):
    return ev.UploadCompleted.new(ev.Stamp(T0, "upload-event"), job_id=ev.job_id_for("u1"), stage="intake",
                                  attempt=0, recorded_by="t", correlation_id="u1", upload_id="u1", bucket="b",
                                  object_key="uploads/u1/a.mp4", size_bytes=10, sha256="00" * 32,
                                  filename="a.mp4", priority=priority)


def test_the_events_take_their_times_and_ids_from_the_given_clock_in_order():
    out = decide(None, upload("index"), MEDIA, PROFILE, None, SETTINGS, "intake@t", stamps())
    assert [(topic, e.event_type, e.event_id, e.occurred_at) for topic, e in out] == [
        ("unit.jobs", "JobAccepted", "event-0", T0),
        ("unit.jobs", "StageQueued", "event-1", T0 + timedelta(milliseconds=1)),
        ("unit.work.transcode.index", "WorkItem", "event-2", T0 + timedelta(milliseconds=2))]
    assert out == decide(None, upload("index"), MEDIA, PROFILE, None, SETTINGS, "intake@t", stamps())  # same inputs


def test_a_refusal_needs_no_profile_and_draws_one_stamp():
    out = decide(None, upload(), QuotaExceeded("over quota"), None, None, SETTINGS, "intake@t", stamps())
    assert [(e.event_type, e.event_id, e.error_class, e.reason) for _, e in out] == [
        ("JobRejected", "event-0", "quota_exceeded", "over quota")]


def test_an_existing_job_draws_no_stamp():
    def never() -> ev.Stamp:
        raise AssertionError("no event, no stamp")
    assert decide({"job_id": "x"}, upload(), MEDIA, None, None, SETTINGS, "intake@t", never) == []


def test_an_accepted_upload_without_a_profile_is_a_programming_error():
    with pytest.raises(ValueError):
        decide(None, upload(), MEDIA, None, None, SETTINGS, "intake@t", stamps())


def test_a_reused_result_without_its_duration_takes_the_probes():
    reusable = Reusable(origin_job_id="o", fingerprint=PROFILE.fingerprint, master_key="published/o/master.m3u8",
                        master_url="http://s3/published/o/master.m3u8", renditions=list(PROFILE.ladder), outputs=[],
                        media_duration_s=None)
    out = decide(None, upload(), MEDIA, PROFILE, reusable, SETTINGS, "intake@t", stamps())
    assert [e.media_duration_s for _, e in out[1:]] == [5.28, 5.28]

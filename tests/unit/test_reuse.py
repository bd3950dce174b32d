"""Output profiles, the degradation ladder and the intake decision with a reusable result (issue 9,
items 5 and 6). Pure: no services."""

from __future__ import annotations

from processors import media
from processors.intake import decide
from processors.reuse import Reusable, degraded_ladder, full_profile, plan_profile, profile_fingerprint
from domain import events as ev
from tapeline.settings import Settings
from tapeline.clock import system_clock
from tests.fakeclock import FixedClock

SETTINGS = Settings(topic_prefix="unit", degrade_backlog_threshold=2)
CLOCK = FixedClock()  # the writer's clock of the decided events
MEDIA = ev.SourceMedia(format_name="mov", duration_s=5.28, width=1280, height=720, display_width=1280,
                       display_height=720, rotation=0, fps=25.0, frames=132, video_codec="h264", audio_codec="aac")
LADDER = media.plan_ladder(MEDIA, SETTINGS.ladder)


def upload(priority="standard", profile="default"):
    return ev.UploadCompleted.new(system_clock.stamp(), job_id=ev.job_id_for("u1"), stage="intake", attempt=0, recorded_by="t",
                                  correlation_id="u1", upload_id="u1", bucket="b", object_key="uploads/u1/a.mp4",
                                  size_bytes=10, sha256="ab" * 32, filename="a.mp4", priority=priority,
                                  profile=profile)


def test_fingerprint_is_stable_and_changes_with_every_input_that_shapes_the_outputs():
    base = profile_fingerprint("default", LADDER, "veryfast", SETTINGS)
    assert base == profile_fingerprint("default", list(LADDER), "veryfast", Settings(topic_prefix="other"))
    assert len(base) == 64 and int(base, 16) >= 0
    # URLs and playlist keys of published renditions are not part of the profile
    published = [r.model_copy(update={"url": "http://x", "playlist_key": "k"}) for r in LADDER]
    assert profile_fingerprint("default", published, "veryfast", SETTINGS) == base
    changed = {
        profile_fingerprint("other", LADDER, "veryfast", SETTINGS),
        profile_fingerprint("default", LADDER[1:], "veryfast", SETTINGS),
        profile_fingerprint("default", LADDER, "superfast", SETTINGS),
        profile_fingerprint("default", LADDER, "veryfast", SETTINGS.model_copy(update={"segment_s": 2.0})),
        profile_fingerprint("default", [LADDER[0].model_copy(update={"video_bitrate_kbps": 1})] + LADDER[1:],
                            "veryfast", SETTINGS),
    }
    assert len(changed) == 5 and base not in changed


def test_degraded_ladder_drops_the_top_rung_but_never_the_last():
    assert [r.name for r in degraded_ladder(LADDER)] == ["480p", "360p", "240p"]
    assert [r.name for r in degraded_ladder(LADDER[-1:])] == ["240p"]


def test_profile_is_degraded_only_above_the_threshold_and_only_in_degradable_tiers():
    full = plan_profile("default", "standard", LADDER, 2, SETTINGS)
    assert (full.degraded, full.reason, full.x264_preset, [r.name for r in full.ladder]) == \
        (False, None, "veryfast", ["720p", "480p", "360p", "240p"])
    assert full == full_profile("default", LADDER, SETTINGS)
    cheap = plan_profile("default", "index", LADDER, 3, SETTINGS)
    assert (cheap.degraded, cheap.x264_preset, [r.name for r in cheap.ladder]) == \
        (True, "superfast", ["480p", "360p", "240p"])
    assert cheap.reason == "index backlog 3 > threshold 2: 480p, 360p, 240p at preset superfast"
    assert cheap.fingerprint == profile_fingerprint("default", LADDER[1:], "superfast", SETTINGS)
    assert not plan_profile("default", "archive", LADDER, 50, SETTINGS).degraded  # archive keeps full quality
    assert not plan_profile("default", "index", LADDER, None, SETTINGS).degraded  # backlog unknown
    off = SETTINGS.model_copy(update={"degrade_backlog_threshold": None})
    assert not plan_profile("default", "index", LADDER, 10_000, off).degraded


def test_intake_records_a_degraded_profile_in_the_acceptance_and_the_work_item():
    cheap = plan_profile("default", "index", LADDER, 3, SETTINGS)
    out = decide(None, upload("index"), MEDIA, SETTINGS, "intake@t", cheap, clock=CLOCK)
    accepted, work = out[0][1], out[2][1]
    assert (accepted.degraded, accepted.degraded_reason, accepted.x264_preset) == (True, cheap.reason, "superfast")
    assert accepted.profile_fingerprint == cheap.fingerprint
    assert [r.name for r in accepted.ladder] == [r.name for r in work.renditions] == ["480p", "360p", "240p"]
    assert (work.degraded, work.x264_preset, out[2][0]) == (True, "superfast", "unit.work.transcode.index")


def test_intake_without_a_profile_plans_the_full_one():
    accepted = decide(None, upload(), MEDIA, SETTINGS, "intake@t", clock=CLOCK)[0][1]
    assert accepted.profile_fingerprint == full_profile("default", LADDER, SETTINGS).fingerprint
    assert (accepted.degraded, accepted.degraded_reason) == (False, None)


def test_intake_with_a_reusable_result_completes_without_any_work_item():
    origin = "11111111-1111-5111-8111-111111111111"
    profile = full_profile("default", LADDER, SETTINGS)
    published = [ev.OutputFile(key=f"published/{origin}/master.m3u8", sha256="cd" * 32, size_bytes=300,
                               content_type="application/vnd.apple.mpegurl")]
    renditions = [r.model_copy(update={"url": f"http://s3/published/{origin}/{r.name}/index.m3u8"}) for r in LADDER]
    reusable = Reusable(origin_job_id=origin, fingerprint=profile.fingerprint, master_key=published[0].key,
                        master_url=f"http://s3/{published[0].key}", renditions=renditions, outputs=published,
                        media_duration_s=5.28)
    out = decide(None, upload(), MEDIA, SETTINGS, "intake@t", profile, reusable, clock=CLOCK)
    assert [(topic, e.event_type) for topic, e in out] == [
        ("unit.jobs", "JobAccepted"), ("unit.jobs", "ResultReused"), ("unit.jobs", "JobCompleted")]
    reused, completed = out[1][1], out[2][1]
    assert (reused.reused_job_id, reused.profile_fingerprint, reused.outputs) == (origin, profile.fingerprint,
                                                                                 published)
    assert completed.master_url == reusable.master_url and completed.media_duration_s == 5.28
    assert {e.dedup_key for _, e in out} == {f"{ev.job_id_for('u1')}:intake:0:{t}"
                                             for t in ("JobAccepted", "ResultReused", "JobCompleted")}


def test_fold_records_the_profile_the_degradation_and_the_reused_job():
    from datetime import datetime, timezone

    from domain.lifecycle import evolve

    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    cheap = plan_profile("default", "index", LADDER, 3, SETTINGS)
    accepted = decide(None, upload("index"), MEDIA, SETTINGS, "intake@t", cheap, clock=CLOCK)[0][1]
    row = evolve(None, accepted, now).row
    assert (row["degraded"], row["degraded_reason"], row["x264_preset"], row["profile_fingerprint"]) == \
        (True, cheap.reason, "superfast", cheap.fingerprint)
    origin = "11111111-1111-5111-8111-111111111111"
    reused = ev.ResultReused.new(system_clock.stamp(), job_id=accepted.job_id, stage="intake", attempt=0, recorded_by="t",
                                 correlation_id="u1", reused_job_id=origin, profile_fingerprint=cheap.fingerprint,
                                 master_key="m", master_url="http://m", renditions=list(cheap.ladder), outputs=[])
    row = evolve(row, reused, now).row
    assert (row["reused_from"], row["master_url"], row["state"]) == (origin, "http://m", "accepted")
    assert [r["name"] for r in row["renditions"]] == ["480p", "360p", "240p"]

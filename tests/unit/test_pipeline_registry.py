"""The stage registry and pipeline profiles (domain/pipeline.py): what the framework derives from them."""

from __future__ import annotations

from domain import pipeline
from domain.lifecycle_data import LIFECYCLE
from tapeline.crashpoints import PIPELINE_CRASH_POINTS, crash_point_rounds, tier_for_point
from tapeline.settings import Settings


def test_profiles_name_registered_stages_in_registry_order():
    for name, stages in pipeline.PROFILES.items():
        assert stages and all(s in pipeline.BY_NAME for s in stages), name
        positions = [pipeline.STAGE_NAMES.index(s) for s in stages]
        assert positions == sorted(positions), name
        assert pipeline.spec(stages[-1]).final and not any(pipeline.spec(s).final for s in stages[:-1])


def test_old_jobs_order_their_stages_as_the_fixed_order_did():
    assert pipeline.LEGACY_STAGES == ("transcode", "publish")
    for stage, position in LIFECYCLE.stage_order.items():
        assert pipeline.stage_position(stage, None) == pipeline.stage_position(stage, []) == position
    assert pipeline.stage_position("thumbnails", None) == 0  # unknown to an old job: as STAGE_ORDER.get(s, 0)


def test_a_recorded_pipeline_orders_by_position():
    stages = ["transcode", "thumbnails", "publish"]
    assert [pipeline.stage_position(s, stages) for s in ("intake", "transcode", "thumbnails", "publish")] == [0, 1, 2, 3]


def test_the_next_stage_comes_from_the_profile_and_degraded_jobs_skip_optional_ones():
    stages = pipeline.profile_stages("default")
    assert pipeline.next_stage(stages, "intake") == "transcode"
    assert pipeline.following_stage(stages, "transcode", degraded=False) == ("thumbnails", [])
    assert pipeline.following_stage(stages, "transcode", degraded=True) == ("publish", ["thumbnails"])
    assert pipeline.following_stage(stages, "publish", degraded=False) == (None, [])
    assert pipeline.following_stage(pipeline.LEGACY_STAGES, "transcode", degraded=False) == ("publish", [])


def test_every_stage_gets_work_topics_and_crash_points_without_a_hand_written_list():
    topics = Settings().all_topics()
    for stage in pipeline.STAGE_NAMES:
        assert all(Settings().work_topic(stage, tier) in topics for tier in ("archive", "standard", "index"))
    for stage in pipeline.profile_stages(pipeline.DEFAULT_PROFILE):
        points = pipeline.stage_crash_points(stage)
        assert set(points) <= set(PIPELINE_CRASH_POINTS)
        assert points[:3] == tuple(f"{stage}.claim.{p}" for p in ("after_produce", "after_send_offsets", "after_commit"))
        assert points[-1] == f"{stage}.AttemptSucceeded.after_commit"
    assert "thumbnails.before_upload" in PIPELINE_CRASH_POINTS and "thumbnails.Heartbeat.after_commit" in PIPELINE_CRASH_POINTS
    assert len(PIPELINE_CRASH_POINTS) == len(set(PIPELINE_CRASH_POINTS))


def test_the_tier_picks_its_profile():
    assert pipeline.profile_for_tier("standard") == "default"
    assert pipeline.profile_for_tier("nonsense") == "default"


def test_crash_point_jobs_cover_every_profiled_stage():
    """The harness below reaches every stage's points: each stage's job runs a profile that has it."""
    assert {tier_for_point(p) for p in PIPELINE_CRASH_POINTS if p.startswith("archive.")} == {"archive"}
    assert tier_for_point("transcode.claim.after_commit") == "standard"
    assert pipeline.profile_for_tier(tier_for_point("archive.before_put")) == "archive"
    assert {s for p in PIPELINE_CRASH_POINTS for s in [p.partition(".")[0]] if s in pipeline.BY_NAME} == \
        set(pipeline.profiled_stages())


def test_crash_point_rounds_take_every_point_once_and_kill_each_process_once_per_round():
    rounds = crash_point_rounds(PIPELINE_CRASH_POINTS)
    flat = [point for points, _ in rounds for point in points]
    assert sorted(flat) == sorted(PIPELINE_CRASH_POINTS)
    for points, tier in rounds:
        processes = [point.partition(".")[0] for point in points]
        assert len(processes) == len(set(processes)), points
        stages = {p for p in processes if p in pipeline.BY_NAME}
        assert stages <= set(pipeline.profile_stages(pipeline.profile_for_tier(tier))), (points, tier)
    # a process's points keep their order: claim before heartbeats before completion
    assert [p for p in flat if p.startswith("publish.")] == [p for p in PIPELINE_CRASH_POINTS if p.startswith("publish.")]
    assert len(rounds) == max(sum(p.startswith(s + ".") for p in PIPELINE_CRASH_POINTS) for s in ("publish", "transcode"))


def test_crash_point_rounds_refuse_points_no_one_job_passes(monkeypatch):
    import pytest

    monkeypatch.setattr(pipeline, "profile_stages", lambda profile: ("transcode",) if profile == "default" else ("archive",))
    with pytest.raises(ValueError, match="passes"):
        crash_point_rounds(("archive.before_put", "publish.before_marker"))

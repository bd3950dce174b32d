"""Priority tiers against real services (issue 9, items 3 and 7): with ONE transcode worker and a
pile of index jobs queued before it starts, archive jobs queued after them are claimed first, and
every index job still completes; with a small starvation limit, the worker interleaves the lowest
tier exactly as `processors.tiers.choose_tier` says."""

from __future__ import annotations

import pytest

from processors.tiers import after_claim, choose_tier
from tests.conftest import wait_for
from tests.integration.roles import Roles, all_in_state, rows, submit_upload, tiny_clips

pytestmark = pytest.mark.integration
SUPPORT = ("projector", "intake", "publish", "watchdog")


def transcode_claims(settings, job_ids: list[str]) -> list[str]:
    """Job ids in the order their transcode attempt was claimed (broker time of `AttemptStarted`)."""
    found = rows(settings, "SELECT job_id FROM lifecycle_evidence WHERE event_type = 'AttemptStarted' AND "
                           "stage = 'transcode' AND applied AND job_id = ANY(%s) ORDER BY broker_ts, partition, \"offset\"",
                 job_ids)
    return [r["job_id"] for r in found]


def pile_up(settings, clips, tiers: list[str]) -> list[str]:
    """Submit one clip per tier in `tiers` (in that order) and wait until every job is queued for transcode."""
    jobs = [submit_upload(settings, clip, priority=tier) for clip, tier in zip(clips, tiers)]
    wait_for(lambda: all_in_state(settings, jobs, {"queued"}), 90, "every job to be queued for transcode")
    return jobs


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return tiny_clips(tmp_path_factory.mktemp("clips"), 13)


@pytest.fixture(scope="module")
def support(isolated, tmp_path_factory):
    """Every role but transcode, for the whole module; each test starts its own transcode worker."""
    settings = isolated.model_copy(update={"x264_preset": "ultrafast", "degrade_backlog_threshold": None})
    roles = Roles(settings, tmp_path_factory.mktemp("support")).start(*SUPPORT)
    yield settings
    roles.stop()


def test_archive_jobs_queued_after_a_pile_of_index_jobs_are_transcoded_first(support, clips, tmp_path):
    settings = support
    index = pile_up(settings, clips[:5], ["index"] * 5)
    archive = pile_up(settings, clips[5:7], ["archive"] * 2)
    worker = Roles(settings, tmp_path).start("transcode")  # ONE transcode worker
    try:
        wait_for(lambda: all_in_state(settings, index + archive, {"completed"}), 120, "every job to complete")
    finally:
        worker.stop()
    order = transcode_claims(settings, index + archive)
    assert sorted(order) == sorted(index + archive)  # one transcode attempt each
    assert set(order[:2]) == set(archive), f"archive jobs claimed at {[order.index(a) for a in archive]}"
    completed = {r["job_id"]: r["completed_at"] for r in rows(
        settings, "SELECT job_id, completed_at FROM job_state WHERE job_id = ANY(%s)", index + archive)}
    last_archive = max(completed[a] for a in archive)
    assert sum(completed[i] < last_archive for i in index) <= 1  # a publish may overtake, a transcode may not
    assert '"tier claimed"' in worker.log_text("transcode")


def test_with_a_starvation_limit_of_two_index_gets_every_third_claim_under_an_archive_flood(support, clips,
                                                                                              tmp_path):
    settings = support.model_copy(update={"tier_starvation_limit": 2})
    tiers = ["index", "index", "archive", "archive", "archive", "archive"]
    jobs = pile_up(settings, clips[7:13], tiers)
    worker = Roles(settings, tmp_path).start("transcode")
    try:
        wait_for(lambda: all_in_state(settings, jobs, {"completed"}), 120, "every job to complete")
    finally:
        worker.stop()
    tier_of_job = dict(zip(jobs, tiers))
    claimed = [tier_of_job[j] for j in transcode_claims(settings, jobs)]
    # What the pure rule predicts for this pile, claim by claim.
    left, passed, expected = {"archive": 4, "index": 2}, {}, []
    while any(left.values()):
        waiting = {t for t, n in left.items() if n}
        tier = choose_tier(waiting, passed, 2)
        expected.append(tier)
        passed = after_claim(waiting, passed, tier)
        left[tier] -= 1
    assert expected == ["archive", "archive", "index", "archive", "archive", "index"]
    assert claimed == expected

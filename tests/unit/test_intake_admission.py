"""The HTTP intake's pure admission rules (domain/policy/admission.py) and the storage-pressure
retention of cleanup (issue 9)."""

from __future__ import annotations

from domain.policy.cleanup import retention_under_pressure
from domain.policy.admission import admission, retry_after
from producers.http_intake import refusal_response, upload_id_for_key
from projections.read_model import TierBacklog
from domain import events as ev
from tapeline.settings import Settings

SETTINGS = Settings(intake_tier_capacity={"archive": 100, "standard": 100, "index": 100}, intake_total_capacity=10,
                    intake_tier_reserve=2, intake_max_in_flight_per_submitter=4, intake_retry_after_min_s=2,
                    intake_retry_after_max_s=60, storage_limit_bytes=1000)


def backlog(waiting: dict[str, int], done: dict[str, int] | None = None, window_s: float = 300.0):
    done = done or {}
    return {t: TierBacklog(t, waiting.get(t, 0), 0, done.get(t, 0), window_s) for t in ("archive", "standard", "index")}


def test_the_reserve_refuses_index_first_and_archive_last():
    load = backlog({"standard": 6})  # 6 of the total 10
    verdicts = {t: admission(t, load, {}, 0, 0, "a", SETTINGS) for t in ("archive", "standard", "index")}
    assert verdicts["archive"] is None and verdicts["standard"] is None  # ceilings 10 and 8
    assert (verdicts["index"].status, verdicts["index"].error) == (503, "overloaded")  # ceiling 10 - 2 x 2 = 6
    assert "at or past the 6 that tier 'index' may use" in verdicts["index"].reason
    load = backlog({"standard": 7}, done={"standard": 30})
    assert admission("standard", load, {"archive": 1}, 0, 0, "a", SETTINGS).status == 503  # 8 >= 8
    assert admission("archive", load, {"archive": 1}, 0, 0, "a", SETTINGS) is None  # 8 < 10
    assert admission("archive", load, {"archive": 3}, 0, 0, "a", SETTINGS).status == 503  # pending counts


def test_a_tiers_own_capacity_and_retry_after_from_recent_throughput():
    settings = SETTINGS.model_copy(update={"intake_tier_capacity": {"index": 3}, "intake_total_capacity": 100})
    refusal = admission("index", backlog({"index": 2}, done={"index": 30}), {"index": 2}, 0, None, "a", settings)
    # 4 against a capacity of 3: 2 jobs must end; 30 per 300 s -> 10 s per job
    assert (refusal.status, refusal.retry_after_s) == (503, 20)
    assert "tier 'index' has 4 jobs waiting or running, at or past its capacity 3; retry in 20 s" == refusal.reason
    assert admission("standard", backlog({"index": 2}), {"index": 2}, 0, None, "a", settings) is None


def test_retry_after_is_clamped_and_the_maximum_without_throughput():
    assert retry_after(1, 0, 300, SETTINGS) == 60  # nothing completed: the ceiling
    assert retry_after(1, 3000, 300, SETTINGS) == 2  # 0.1 s -> the floor
    assert retry_after(100, 30, 300, SETTINGS) == 60  # 1000 s -> the ceiling
    assert retry_after(3, 40, 300, SETTINGS) == 23  # 22.5 s rounded up


def test_the_submitter_cap_answers_429_and_storage_507_first():
    refusal = admission("standard", backlog({}), {}, 4, 0, "alice", SETTINGS)
    assert (refusal.status, refusal.error, refusal.retry_after_s) == (429, "in_flight_cap", 60)
    assert "submitter 'alice' has 4 jobs in flight, at or past its cap 4" in refusal.reason
    assert admission("standard", backlog({}), {}, 3, 0, "alice", SETTINGS) is None
    full = admission("standard", backlog({"standard": 50}), {}, 9, 1000, "alice", SETTINGS)
    assert (full.status, full.error, full.retry_after_s) == (507, "storage_full", None)
    assert admission("standard", backlog({}), {}, 0, 999, "a", SETTINGS) is None
    response = refusal_response(full)
    assert response.status_code == 507 and "retry-after" not in response.headers


def test_an_idempotency_key_names_one_upload_and_so_one_job():
    first = upload_id_for_key("alice", "k1")
    assert first == upload_id_for_key("alice", "k1") != upload_id_for_key("bob", "k1") != upload_id_for_key("alice", "k2")
    assert ev.job_id_for(first) == ev.job_id_for(upload_id_for_key("alice", "k1"))


def test_storage_pressure_shortens_cleanup_retention_only_while_over_the_limit():
    settings = Settings(cleanup_retention_s=3600, storage_pressure_retention_s=120)
    assert retention_under_pressure(settings, False).cleanup_retention_s == 3600
    assert retention_under_pressure(settings, True).cleanup_retention_s == 120
    longer = settings.model_copy(update={"storage_pressure_retention_s": 7200})
    assert retention_under_pressure(longer, True).cleanup_retention_s == 3600


# -- One submitter's share of a tier (issue 44 item 3) ------------------------------------------------

def test_one_submitter_cannot_hold_a_whole_tier():
    settings = SETTINGS.model_copy(update={"intake_tier_capacity": {"archive": 100, "standard": 100, "index": 50},
                                           "intake_total_capacity": 1000, "intake_max_in_flight_per_submitter": None,
                                           "intake_submitter_tier_share": 0.5})
    load = backlog({"index": 10})
    assert admission("index", load, {"index": 14}, 0, None, "alice", settings, held_in_tier=24) is None
    refused = admission("index", load, {"index": 15}, 0, None, "alice", settings, held_in_tier=25)
    assert (refused.status, refused.error) == (429, "tier_share")
    assert "holds 25 of tier 'index'" in refused.reason and "share 25" in refused.reason
    assert refused.retry_after_s == 60  # nothing completed recently: the maximum
    # Another submitter still gets a slot of the same tier.
    assert admission("index", load, {"index": 15}, 0, None, "bob", settings, held_in_tier=0) is None


def test_the_share_is_rounded_up_and_at_least_one():
    from domain.policy.admission import tier_share_cap
    settings = SETTINGS.model_copy(update={"intake_tier_capacity": {"archive": 3, "standard": 1},
                                           "intake_total_capacity": 10, "intake_tier_reserve": 2,
                                           "intake_submitter_tier_share": 0.5})
    assert tier_share_cap("archive", settings) == 2  # 1.5 up
    assert tier_share_cap("standard", settings) == 1
    assert tier_share_cap("index", settings) == 3  # no tier capacity: total 10 - 2 x 2 = 6, half of it
    whole = settings.model_copy(update={"intake_submitter_tier_share": 1.0})
    assert tier_share_cap("archive", whole) == 3


def test_a_submitter_has_at_most_its_cap_of_bodies_not_moving_yet():
    from domain.policy.admission import starting_refusal
    settings = SETTINGS.model_copy(update={"intake_max_starting_per_submitter": 3})
    assert starting_refusal("alice", 2, settings) is None
    refused = starting_refusal("alice", 3, settings)
    assert (refused.status, refused.error, refused.retry_after_s) == (429, "too_many_starting", 2)
    assert "alice" in refused.reason and "intake_max_starting_per_submitter = 3" in refused.reason

"""The stall rule (`domain/policy/stall.py`): pure functions of times, thresholds and `now`."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone

from domain.diagnosis import STALL_WORDS
from domain.policy.stall import (STALL_KINDS, WAKE_MARGIN_S, StallThresholds, attempt_deadline, attempt_stall,
                                 handoff_redrive_due, next_wake_s, work_missing)
from tapeline.settings import Settings

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=timezone.utc)
T = StallThresholds(no_progress_timeout_s=30.0, handoff_timeout_s=20.0, intake_timeout_s=40.0)


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def judge(heartbeat_s: float | None, lease_s: float, progress_s: float | None, grace_s: float | None = None):
    return attempt_stall(leased_until=None if heartbeat_s is None else ago(heartbeat_s - lease_s),
                         last_heartbeat_at=None if heartbeat_s is None else ago(heartbeat_s),
                         progress_at=None if progress_s is None else ago(progress_s), progress_grace_s=grace_s,
                         now=NOW, thresholds=T)


def test_an_expired_lease_is_lease_expired_counted_from_the_last_heartbeat():
    stall = judge(heartbeat_s=12, lease_s=10, progress_s=12)
    assert stall is not None and stall.kind == "lease_expired" and stall.since_s == 12


def test_a_lease_ending_exactly_now_has_not_expired():
    assert judge(heartbeat_s=10, lease_s=10, progress_s=0) is None


def test_an_expired_lease_wins_over_frozen_progress():
    assert judge(heartbeat_s=200, lease_s=120, progress_s=300).kind == "lease_expired"


def test_frozen_progress_under_a_live_lease_is_no_progress_after_the_timeout():
    assert judge(heartbeat_s=1, lease_s=120, progress_s=29.9) is None
    assert judge(heartbeat_s=1, lease_s=120, progress_s=30) is None  # "past" the timeout: strictly after
    stall = judge(heartbeat_s=1, lease_s=120, progress_s=31)
    assert stall is not None and stall.kind == "no_progress" and stall.since_s == 31


def test_the_attempts_progress_grace_extends_the_no_progress_timeout():
    assert judge(heartbeat_s=1, lease_s=120, progress_s=45, grace_s=20) is None
    assert judge(heartbeat_s=1, lease_s=120, progress_s=51, grace_s=20).kind == "no_progress"


def test_missing_times_never_make_a_stall_by_themselves():
    assert judge(heartbeat_s=None, lease_s=10, progress_s=None) is None
    assert judge(heartbeat_s=None, lease_s=10, progress_s=31).kind == "no_progress"


def test_a_handoff_is_redriven_past_the_handoff_timeout_only():
    assert not handoff_redrive_due(queued_at=ago(20), now=NOW, thresholds=T)
    assert handoff_redrive_due(queued_at=ago(20.1), now=NOW, thresholds=T)
    assert not handoff_redrive_due(queued_at=None, now=NOW, thresholds=T)


def test_an_upload_without_a_job_is_missing_past_the_intake_timeout():
    assert work_missing(uploaded_at=ago(41), has_job=False, now=NOW, thresholds=T)
    assert not work_missing(uploaded_at=ago(41), has_job=True, now=NOW, thresholds=T)
    assert not work_missing(uploaded_at=ago(40), has_job=False, now=NOW, thresholds=T)
    assert not work_missing(uploaded_at=ago(400), has_job=False, now=None, thresholds=T)  # no log clock yet


def test_the_thresholds_come_from_the_settings():
    settings = Settings(no_progress_timeout_s=7, handoff_timeout_s=8, intake_timeout_s=9)
    assert settings.stall_thresholds() == StallThresholds(7, 8, 9)
    assert StallThresholds() == Settings().stall_thresholds()  # the defaults agree


def test_every_stall_kind_has_its_plain_words():
    assert set(STALL_WORDS) == set(STALL_KINDS)


def test_an_attempts_deadline_is_its_lease_end_or_its_no_progress_end_whichever_is_first():
    lease_end, progress = NOW + timedelta(seconds=4), NOW - timedelta(seconds=10)
    assert attempt_deadline(leased_until=lease_end, progress_at=progress, progress_grace_s=None, thresholds=T) == lease_end
    assert attempt_deadline(leased_until=NOW + timedelta(seconds=100), progress_at=progress, progress_grace_s=5.0,
                            thresholds=T) == progress + timedelta(seconds=35)
    assert attempt_deadline(leased_until=None, progress_at=None, progress_grace_s=None, thresholds=T) is None
    # Just after the deadline the rule says stalled; at it, not yet.
    end = attempt_deadline(leased_until=lease_end, progress_at=progress, progress_grace_s=None, thresholds=T)
    for now, stalled in ((end, False), (end + timedelta(milliseconds=1), True)):
        verdict = attempt_stall(leased_until=lease_end, last_heartbeat_at=lease_end - timedelta(seconds=5),
                                progress_at=progress, progress_grace_s=None, now=now, thresholds=T)
        assert (verdict is not None) is stalled


def test_the_watchdog_wakes_at_the_next_tick_or_just_after_a_sooner_deadline():
    assert next_wake_s(tick_s=5.0, elapsed_s=0.5, due_in_s=[]) == 4.5
    assert next_wake_s(tick_s=5.0, elapsed_s=0.5, due_in_s=[30.0, 9.0]) == 4.5  # the period comes first
    assert abs(next_wake_s(tick_s=5.0, elapsed_s=0.5, due_in_s=[2.0, 7.0]) - (2.0 + WAKE_MARGIN_S - 0.5)) < 1e-9
    assert next_wake_s(tick_s=5.0, elapsed_s=0.5, due_in_s=[-3.0, 0.0]) == 4.5  # judged already
    assert next_wake_s(tick_s=5.0, elapsed_s=6.0, due_in_s=[1.0]) == 0.0  # a slow tick: at once


def test_a_stage_that_declares_a_no_progress_timeout_is_judged_by_it(monkeypatch):
    from domain import pipeline

    declared = dataclasses.replace(pipeline.BY_NAME["thumbnails"], no_progress_s=45.0)
    monkeypatch.setitem(pipeline.BY_NAME, "thumbnails", declared)
    monkeypatch.setattr(pipeline, "STAGES", tuple(declared if s.name == "thumbnails" else s for s in pipeline.STAGES))
    settings = Settings(no_progress_timeout_s=7, handoff_timeout_s=8, intake_timeout_s=9)
    assert settings.stall_thresholds("thumbnails") == StallThresholds(45.0, 8, 9)
    assert settings.stall_thresholds("transcode") == settings.stall_thresholds(None) == StallThresholds(7, 8, 9)
    assert settings.stall_thresholds("no-such-stage") == StallThresholds(7, 8, 9)
    assert pipeline.declared_no_progress() == {"thumbnails": 45.0}
    progress_at = datetime(2026, 12, 5, tzinfo=timezone.utc)
    now = progress_at + timedelta(seconds=20)  # past the global 7 s, inside the stage's 45 s
    lease = now + timedelta(seconds=30)
    assert attempt_stall(leased_until=lease, last_heartbeat_at=now, progress_at=progress_at, progress_grace_s=None,
                         now=now, thresholds=settings.stall_thresholds("thumbnails")) is None
    assert attempt_stall(leased_until=lease, last_heartbeat_at=now, progress_at=progress_at, progress_grace_s=None,
                         now=now, thresholds=settings.stall_thresholds("transcode")).kind == "no_progress"



# Suspect before judged (issue 45 item 1): `attempt_suspect`.

def suspect(heartbeat_s: float, lease_s: float, progress_s: float | None, grace_s: float | None = None,
            thresholds: StallThresholds = T):
    from domain.policy.stall import attempt_suspect

    return attempt_suspect(leased_until=ago(heartbeat_s - lease_s), last_heartbeat_at=ago(heartbeat_s),
                           progress_at=None if progress_s is None else ago(progress_s), progress_grace_s=grace_s,
                           now=NOW, thresholds=thresholds)


def test_counters_still_past_half_the_allowance_make_a_suspect_in_words():
    found = suspect(heartbeat_s=1, lease_s=120, progress_s=23.6)  # T: 30 s allowance, fraction 0.5
    assert (found.kind, found.still_s, found.allowance_s) == ("no_progress", 23.6, 30.0)
    assert found.remaining_s == 30.0 - 23.6
    assert found.words() == "no progress for 24 s of the 30 s allowance"


def test_counters_still_for_less_than_the_fraction_are_no_suspect():
    assert suspect(heartbeat_s=1, lease_s=120, progress_s=15) is None  # exactly half: not more than it
    assert suspect(heartbeat_s=1, lease_s=120, progress_s=14) is None


def test_the_issue_example_95_of_120():
    found = suspect(heartbeat_s=5, lease_s=120, progress_s=95, thresholds=StallThresholds())
    assert found.words() == "no progress for 95 s of the 120 s allowance" and found.remaining_s == 25


def test_a_grace_widens_the_allowance_of_a_suspect():
    assert suspect(heartbeat_s=1, lease_s=120, progress_s=20, grace_s=30) is None  # 20 of 60: not yet
    assert suspect(heartbeat_s=1, lease_s=120, progress_s=31, grace_s=30).allowance_s == 60


def test_a_stalled_attempt_is_no_longer_a_suspect_but_the_watchdogs():
    assert judge(heartbeat_s=1, lease_s=120, progress_s=31) is not None
    assert suspect(heartbeat_s=1, lease_s=120, progress_s=31) is None


def test_silent_heartbeats_make_a_lease_suspect_and_the_nearer_verdict_wins():
    found = suspect(heartbeat_s=7, lease_s=10, progress_s=7)  # 7 of a 10 s lease; 7 of 30 s progress: no
    assert (found.kind, found.words()) == ("lease", "no heartbeat for 7 s of the 10 s lease")
    both = suspect(heartbeat_s=16, lease_s=20, progress_s=20)  # lease: 4 s left; progress: 10 s left
    assert both.kind == "lease" and both.remaining_s == 4


def test_the_suspect_fraction_comes_from_the_settings():
    thresholds = Settings(suspect_fraction=0.8).stall_thresholds()
    assert thresholds.suspect_fraction == 0.8
    assert suspect(heartbeat_s=1, lease_s=120, progress_s=95, thresholds=thresholds) is None  # 95 of 120 < 0.8
    assert suspect(heartbeat_s=1, lease_s=120, progress_s=97, thresholds=thresholds).still_s == 97

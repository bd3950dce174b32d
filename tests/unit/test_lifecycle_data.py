"""`schemas/lifecycle.json`, the one source of the lifecycle data both fold engines use, against the
event models, the Python fold and the migrations; and its loader's refusals. (The Rust engine reads
the file at build time, native/build.rs; `projections.native.check_build` refuses a stale build.)"""

from __future__ import annotations

import json
import random
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from fastavro.utils import generate_many

from domain import lifecycle as fold
from projections import writes
from domain import lifecycle_data as lifecycle
from domain import events as ev
from domain.codec import default_codec
from domain.lifecycle_data import LIFECYCLE, LifecycleFileError
from tapeline.postgres import lifecycle_table_rows

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
BOOKKEEPING_COLUMNS = {"events", "last_event_type", "updated_at"}


def test_every_event_type_is_in_exactly_one_group():
    groups = LIFECYCLE.events
    assert set().union(*groups.values()) == set(ev.Event.registry)
    assert sum(len(names) for names in groups.values()) == len(ev.Event.registry)


def test_payload_omits_are_the_envelope_fields_with_an_evidence_column():
    assert set(LIFECYCLE.payload_omits) == set(ev.Event.model_fields) & set(LIFECYCLE.evidence_columns)
    assert writes.PAYLOAD_OMITS == set(LIFECYCLE.payload_omits)
    assert writes.EVIDENCE_COLUMNS == LIFECYCLE.evidence_columns


def test_the_fold_exports_the_file_under_its_old_names():
    assert fold.FINAL_STATES == {"completed", "rejected", "failed", "cancelled"}
    assert fold.REOPENABLE_STATES == {"dead_lettered", "needs_review"}
    assert fold.TERMINAL_STATES == fold.FINAL_STATES | fold.REOPENABLE_STATES
    assert fold.STAGE_ORDER == {"intake": 0, "transcode": 1, "publish": 2}
    assert fold.JOB_STATE_COLUMNS == LIFECYCLE.job_state_columns and len(fold.JOB_STATE_COLUMNS) == 50
    assert fold.STATES == LIFECYCLE.states


def test_the_lifecycle_tables_hold_the_file():
    states, ending = lifecycle_table_rows()
    assert [r["state"] for r in states] == sorted(LIFECYCLE.states)
    assert {r["state"] for r in states if r["kind"] == "final"} == LIFECYCLE.final_states
    assert {r["state"] for r in states if r["kind"] == "reopenable"} == LIFECYCLE.reopenable_states
    assert {r["event_type"]: (r["state"], r["attempt_outcome"]) for r in ending} == \
        {kind: (rule.state, rule.attempt_outcome) for kind, rule in LIFECYCLE.ending.items()}


def test_the_attempts_view_names_no_ending_event():
    """A new state or ending event takes no migration: the view reads lifecycle_ending_events."""
    text = Path("projections/sql/migrations/024_lifecycle_tables.sql").read_text()
    view = text[text.index("CREATE OR REPLACE VIEW attempts"):]
    assert "lifecycle_ending_events" in view
    assert not any(f"'{kind}'" in view for kind in LIFECYCLE.ending), "the attempts view names an ending event"


def _random_event(kind: str, seed: int, **envelope) -> ev.Event:
    """A valid random event of `kind` (fastavro's generator over its schema), envelope overridden."""
    state = random.getstate()
    random.seed(seed)
    try:
        record = next(iter(generate_many(default_codec().parsed[kind], 1)))
    finally:
        random.setstate(state)
    record.update(event_type=kind, occurred_at=T0, **envelope)
    return ev.Event.from_record(default_codec().decode(default_codec().encode(record)))


def _running_row() -> dict:
    row = {column: None for column in fold.JOB_STATE_COLUMNS}
    row.update(job_id="j", upload_id="u", state="running", stage="transcode", attempt=1, attempts=1, claim_token="tok",
               events=3, last_event_type="AttemptStarted", created_at=T0, updated_at=T0, yields=0, redrives=0,
               budget_base=0, lease_s=30.0, leased_until=T0 + timedelta(seconds=30))
    return row


@pytest.mark.parametrize("kind", sorted(LIFECYCLE.events["bookkeeping"]))
@pytest.mark.parametrize("seed", range(5))
def test_a_bookkeeping_event_changes_only_the_bookkeeping_columns(kind, seed):
    row = _running_row()
    event = _random_event(kind, seed, job_id="j", stage="transcode", attempt=1, claim_token="tok")
    outcome = fold.evolve(row, event, T0 + timedelta(seconds=5))
    assert outcome.applied and not outcome.superseded
    changed = {c for c in row if outcome.row[c] != row[c]}
    assert changed == BOOKKEEPING_COLUMNS and outcome.row["last_event_type"] == kind


@pytest.mark.parametrize("kind", sorted(LIFECYCLE.events["opening"]))
def test_an_opening_event_makes_a_row_only_for_a_job_without_one(kind):
    event = _random_event(kind, 1, job_id="j", stage="intake", attempt=0, claim_token=None)
    made = fold.evolve(None, event, T0)
    assert made.applied and made.row["state"] in LIFECYCLE.states
    again = fold.evolve(_running_row(), event, T0)
    assert not again.applied and not again.superseded


@pytest.mark.parametrize("kind", sorted(LIFECYCLE.events["ending"]))
@pytest.mark.parametrize("seed", range(5))
def test_an_ending_event_follows_its_rule_in_the_file(kind, seed):
    rule = LIFECYCLE.ending[kind]
    row = _running_row()
    row.update(error_class="transient", reason="before", master_url="before")
    event = _random_event(kind, seed, job_id="j", stage="transcode", attempt=1, claim_token="tok")
    at = T0 + timedelta(seconds=5)
    outcome = fold.evolve(row, event, at)
    assert outcome.applied and not outcome.superseded
    new = outcome.row
    assert new["state"] == rule.state and new["completed_at"] == at and new["leased_until"] is None
    assert all(new[c] == getattr(event, c) for c in rule.copies)
    assert all(new[c] is None for c in rule.clears)
    changed = {c for c in row if new[c] != row[c]}
    assert changed <= BOOKKEEPING_COLUMNS | {"state", "completed_at", "leased_until", *rule.copies, *rule.clears}
    assert not fold.evolve(new, event, at + timedelta(seconds=1)).applied  # an ended job takes it once


@pytest.mark.parametrize("kind", sorted(LIFECYCLE.events["ending"]))
@pytest.mark.parametrize("seed", range(3))
def test_an_ending_event_without_the_claim_ends_a_running_job_only_as_its_rule_says(kind, seed):
    """Issue 44 item 6: a `JobCompleted` with no claim token completed a running job (and its
    master URL became the job's). While an attempt runs, an ending event without a claim token ends
    the job only when its rule's `without_claim` allows it: "always" (an operator's cancel),
    "after_stall" (the watchdog's dead letter, right after the attempt's `StallDetected`); else it
    is superseded. A job no attempt runs is ended as before (intake's reuse, an operator's action)."""
    rule = LIFECYCLE.ending[kind]
    event = _random_event(kind, seed, job_id="j", stage="transcode", attempt=1, claim_token=None)
    at = T0 + timedelta(seconds=5)
    running = fold.evolve(_running_row(), event, at)
    assert (running.applied, running.superseded) == ((True, False) if rule.without_claim == "always" else (False, True))
    if not running.applied:
        assert running.row == _running_row()
    stalled = fold.evolve(dict(_running_row(), last_event_type="StallDetected"), event, at)
    assert stalled.applied is (rule.without_claim in ("always", "after_stall"))
    queued = fold.evolve(dict(_running_row(), state="queued", claim_token=None, last_event_type="StageQueued"), event, at)
    assert queued.applied and queued.row["state"] == rule.state
    claimed = fold.evolve(_running_row(), event.model_copy(update={"claim_token": "tok"}), at)
    assert claimed.applied and claimed.row["state"] == rule.state


def test_the_rules_without_a_claim():
    assert {kind: rule.without_claim for kind, rule in LIFECYCLE.ending.items()} == {
        "JobCompleted": "never", "JobFailed": "never", "NeedsReview": "never", "JobDeadLettered": "after_stall",
        "JobCancelled": "always"}


@pytest.mark.parametrize("kind", sorted(LIFECYCLE.events["ending"]))
def test_an_ending_event_copies_only_string_fields_of_its_model(kind):
    model = ev.Event.registry[kind]
    for column in LIFECYCLE.ending[kind].copies:
        assert column in model.model_fields, f"{kind} has no field {column}"
        assert model.model_fields[column].annotation in (str, str | None), f"{kind}.{column} is not a string"


def test_no_ending_event_has_a_branch_of_its_own_in_either_engine():
    python = Path(fold.__file__).read_text()
    source = Path("native/src/lib.rs").read_text()
    rust = source[source.index("fn evolve("):source.index("#[pymodule]")]  # Engine::evolve
    for kind in LIFECYCLE.ending:
        assert f"ev.{kind}" not in python and f'"{kind}"' not in rust


@pytest.mark.parametrize("kind", sorted(LIFECYCLE.events["folded"]))
def test_a_folded_event_has_a_rule_of_its_own_in_the_fold(kind):
    source = Path(fold.__file__).read_text()
    assert f"ev.{kind}" in source  # a branch of `evolve` (what it does: tests/unit/test_fold_differential.py)


def _write(tmp_path: Path, change) -> Path:
    data = json.loads(lifecycle.PATH.read_text())
    change(data)
    path = tmp_path / "lifecycle.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("final_states"), "'final_states' must be a non-empty list"),
    (lambda d: d["final_states"].append("gone"), "not in 'states'"),
    (lambda d: d["reopenable_states"].append("completed"), "both final and reopenable"),
    (lambda d: d["payload_omits"].append("worker"), "not evidence columns"),
    (lambda d: d["events"]["bookkeeping"].append("Heartbeat"), "in two groups"),
    (lambda d: d["events"].pop("not_folded"), "exactly the groups"),
    (lambda d: d["job_state_columns"].append("job_id"), "names one entry twice"),
    (lambda d: d.update(states=["queued"]), "'states' must map each state"),
    (lambda d: d["events"]["ending"]["JobFailed"].update(state="running"), "not a final or reopenable state"),
    (lambda d: d["events"]["ending"]["JobFailed"].update(copies=["nope"]), "not columns the rule may set"),
    (lambda d: d["events"]["ending"]["JobFailed"].update(clears=["state"]), "not columns the rule may set"),
    (lambda d: d["events"]["ending"]["JobCompleted"].update(copies=["reason"]), "both copied and cleared"),
    (lambda d: d["events"]["ending"]["JobFailed"].pop("attempt_outcome"), "must have exactly state"),
    (lambda d: d["events"]["ending"]["JobFailed"].update(without_claim="sometimes"), "'without_claim' must be one of"),
    (lambda d: d["events"].update(ending=[]), "must map each ending event type"),
])
def test_the_loader_refuses_a_file_that_contradicts_itself(tmp_path, change, message):
    with pytest.raises(LifecycleFileError, match=message):
        lifecycle.load(_write(tmp_path, change))


def test_the_loader_refuses_what_is_not_json(tmp_path):
    path = tmp_path / "lifecycle.json"
    path.write_text("{states:")
    with pytest.raises(LifecycleFileError, match="not JSON"):
        lifecycle.load(path)


def test_the_repository_file_loads_to_what_is_exported():
    assert lifecycle.load() == LIFECYCLE

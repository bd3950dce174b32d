"""The lifecycle data both fold engines use, read once from `schemas/lifecycle.json`.

One source for the job states, the final and reopenable sets, the stage order, the `job_state` and
`lifecycle_evidence` column lists, the envelope fields left out of an evidence payload and which
event kinds the fold handles how. The Python fold (`domain/lifecycle.py`) exports these values under their old names; the Rust engine's build
(`native/build.rs`) reads the same file and generates its constants from it, so neither restates
them. `tests/unit/test_lifecycle_data.py` checks the file against the models, the fold and the
migrations. Standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

PATH = Path(str(files("schemas"))) / "lifecycle.json"
"""The file, in the language-neutral contract folder `schemas/` beside the Avro schemas."""
EVENT_GROUPS = ("opening", "folded", "ending", "bookkeeping", "not_folded")
"""The groups of `events` in the file: every event type is in exactly one (the file says what each means).
`ending` maps each of its event types to its `Ending` rule; the others are lists."""


class LifecycleFileError(ValueError):
    """`lifecycle.json` is missing a key, has a value of the wrong shape, or contradicts itself."""


@dataclass(frozen=True)
class Ending:
    """How an event of the `ending` group ends a job, the same in both engines: `state` becomes the
    row's state (a final or reopenable one); each column in `copies` takes the event's field of the
    same name (a string or null); each in `clears` becomes null; `completed_at` becomes the broker
    time and `leased_until` null. `attempt_outcome` is the `outcome` the `attempts` view gives a
    running attempt the event ends, None when it ends none. `without_claim` (one of
    `WITHOUT_CLAIM`): whether the event ends a running job when it carries no claim token: "never",
    "after_stall" (right after the attempt's applied `StallDetected`: the watchdog's) or "always"
    (an operator's)."""

    state: str
    copies: tuple[str, ...]
    clears: tuple[str, ...]
    attempt_outcome: str | None
    without_claim: str = "never"


WITHOUT_CLAIM = ("never", "after_stall", "always")
"""The values of an ending rule's `without_claim`."""


@dataclass(frozen=True)
class Lifecycle:
    """The contents of `lifecycle.json`.

    `states`: every job state, in the file's order (a state -> its meaning in `state_help`);
    `final_states`: never change again; `reopenable_states`: change only by `JobReplayed`;
    `stage_order`: stage -> its position (an unknown stage counts as 0 where compared);
    `job_state_columns`, `evidence_columns`: table columns in table order; `payload_omits`: the
    envelope fields an evidence row has a column of its own for; `events`: group -> event types;
    `ending`: event type -> its `Ending` rule (the `ending` group's types);
    `free_stall_kinds`: `StallDetected` kinds that give their attempt back (the fold counts the
    attempt like a yield, so it uses none of the budget): `region_lost`, an attempt lost with a
    region that failed over (docs/regions.md "Failover").
    """

    states: tuple[str, ...]
    state_help: dict[str, str]
    final_states: frozenset[str]
    reopenable_states: frozenset[str]
    stage_order: dict[str, int]
    job_state_columns: tuple[str, ...]
    evidence_columns: tuple[str, ...]
    payload_omits: frozenset[str]
    events: dict[str, frozenset[str]]
    ending: dict[str, Ending]
    free_stall_kinds: frozenset[str]


def _names(data: dict[str, Any], key: str, path: Path) -> tuple[str, ...]:
    value = data.get(key)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise LifecycleFileError(f"{path}: {key!r} must be a non-empty list of names")
    if len(set(value)) != len(value):
        raise LifecycleFileError(f"{path}: {key!r} names one entry twice")
    return tuple(value)


def load(path: Path = PATH) -> Lifecycle:
    """Read and check `path` (default `schemas/lifecycle.json`). Raises `LifecycleFileError` for a
    missing key, a value of the wrong shape, a final or reopenable state that is not a state, an
    omitted payload field that is not an evidence column, or an event type in two groups;
    `OSError` when the file cannot be read."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise LifecycleFileError(f"{path}: not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise LifecycleFileError(f"{path}: not a JSON object")
    states = data.get("states")
    if not isinstance(states, dict) or not states or not all(isinstance(v, str) for v in states.values()):
        raise LifecycleFileError(f"{path}: 'states' must map each state to its meaning")
    final, reopenable = _names(data, "final_states", path), _names(data, "reopenable_states", path)
    for key, names in (("final_states", final), ("reopenable_states", reopenable)):
        if not set(names) <= set(states):
            raise LifecycleFileError(f"{path}: {key!r} holds {sorted(set(names) - set(states))}, not in 'states'")
    if set(final) & set(reopenable):
        raise LifecycleFileError(f"{path}: a state cannot be both final and reopenable")
    evidence, omits = _names(data, "evidence_columns", path), _names(data, "payload_omits", path)
    if not set(omits) <= set(evidence):
        raise LifecycleFileError(f"{path}: 'payload_omits' holds {sorted(set(omits) - set(evidence))}, "
                                 "not evidence columns")
    groups = data.get("events")
    if not isinstance(groups, dict) or set(groups) != set(EVENT_GROUPS):
        raise LifecycleFileError(f"{path}: 'events' must have exactly the groups {', '.join(EVENT_GROUPS)}")
    ending = _ending(groups.get("ending"), states, final + reopenable, _names(data, "job_state_columns", path), path)
    events = {group: frozenset(ending) if group == "ending" else frozenset(_names(groups, group, path))
              for group in EVENT_GROUPS}
    seen: set[str] = set()
    for group in EVENT_GROUPS:
        if seen & events[group]:
            raise LifecycleFileError(f"{path}: {sorted(seen & events[group])} in two groups of 'events'")
        seen |= events[group]
    return Lifecycle(
        states=tuple(states), state_help=dict(states), final_states=frozenset(final),
        reopenable_states=frozenset(reopenable),
        stage_order={stage: i for i, stage in enumerate(_names(data, "stage_order", path))},
        job_state_columns=_names(data, "job_state_columns", path), evidence_columns=evidence,
        payload_omits=frozenset(omits), events=events, ending=ending,
        free_stall_kinds=frozenset(_names(data, "free_stall_kinds", path)))


def _ending(value: Any, states: dict[str, str], ended: tuple[str, ...], columns: tuple[str, ...],
            path: Path) -> dict[str, Ending]:
    if not isinstance(value, dict) or not value:
        raise LifecycleFileError(f"{path}: 'events.ending' must map each ending event type to its rule")
    rules = {}
    for kind, rule in value.items():
        where = f"{path}: 'events.ending.{kind}'"
        if not isinstance(rule, dict) or set(rule) != {"state", "copies", "clears", "attempt_outcome", "without_claim"}:
            raise LifecycleFileError(f"{where} must have exactly state, copies, clears, attempt_outcome and "
                                     "without_claim")
        if rule["without_claim"] not in WITHOUT_CLAIM:
            raise LifecycleFileError(f"{where}: 'without_claim' must be one of {', '.join(WITHOUT_CLAIM)}")
        if rule["state"] not in ended:
            raise LifecycleFileError(f"{where}: state {rule['state']!r} is not a final or reopenable state")
        lists = {}
        for key in ("copies", "clears"):
            names = rule[key]
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise LifecycleFileError(f"{where}: {key!r} must be a list of column names")
            if set(names) - set(columns) or set(names) & {"state", "completed_at", "leased_until"}:
                raise LifecycleFileError(f"{where}: {key!r} holds {sorted(set(names) - set(columns)) or names}, "
                                         "not columns the rule may set")
            lists[key] = tuple(names)
        if set(lists["copies"]) & set(lists["clears"]):
            raise LifecycleFileError(f"{where}: a column both copied and cleared")
        outcome = rule["attempt_outcome"]
        if outcome is not None and not (isinstance(outcome, str) and outcome):
            raise LifecycleFileError(f"{where}: 'attempt_outcome' must be a name or null")
        rules[kind] = Ending(rule["state"], lists["copies"], lists["clears"], outcome, rule["without_claim"])
    return rules


LIFECYCLE = load()
"""This repository's lifecycle data, read at import."""

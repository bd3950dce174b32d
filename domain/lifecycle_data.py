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
EVENT_GROUPS = ("opening", "folded", "bookkeeping", "not_folded")
"""The groups of `events` in the file: every event type is in exactly one (the file says what each means)."""


class LifecycleFileError(ValueError):
    """`lifecycle.json` is missing a key, has a value of the wrong shape, or contradicts itself."""


@dataclass(frozen=True)
class Lifecycle:
    """The contents of `lifecycle.json`.

    `states`: every job state, in the file's order (a state -> its meaning in `state_help`);
    `final_states`: never change again; `reopenable_states`: change only by `JobReplayed`;
    `stage_order`: stage -> its position (an unknown stage counts as 0 where compared);
    `job_state_columns`, `evidence_columns`: table columns in table order; `payload_omits`: the
    envelope fields an evidence row has a column of its own for; `events`: group -> event types.
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
    events = {group: frozenset(_names(groups, group, path)) for group in EVENT_GROUPS}
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
        payload_omits=frozenset(omits), events=events)


LIFECYCLE = load()
"""This repository's lifecycle data, read at import."""

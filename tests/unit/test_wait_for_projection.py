"""`tapeline demo` and `submit --wait` run right after `run --detach`: while the processors are still
migrating a new database the projection has no tables yet, and the wait goes on instead of failing
(`make demo` on an empty database failed with "projection schema public has no tables yet")."""

from __future__ import annotations

import time

import pytest

from cli import job_commands
from projections import read_model


def test_the_wait_outlasts_a_projection_not_yet_migrated_but_not_its_deadline(monkeypatch):
    answers = [read_model.ProjectionMissing("no tables yet"), read_model.ProjectionMissing("no tables yet"), "conn"]
    calls = []

    def open_reader(settings):
        calls.append(settings)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(read_model, "open_reader", open_reader)
    monkeypatch.setattr(job_commands.time, "sleep", lambda s: None)
    assert job_commands._reader_once_migrated("settings", time.monotonic() + 60) == "conn"
    assert len(calls) == 3

    monkeypatch.setattr(read_model, "open_reader", lambda settings: (_ for _ in ()).throw(
        read_model.ProjectionMissing("projection schema public has no tables yet")))
    with pytest.raises(read_model.ProjectionMissing, match="no tables yet"):
        job_commands._reader_once_migrated("settings", time.monotonic() - 1)

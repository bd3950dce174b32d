"""A dead letter's attempt count is the job's (issue 26 item 2): a job replayed and out of attempts
again shows the attempts it started (6), with the 3 its last budget counted beside them."""

from __future__ import annotations

from cli.operator_commands import _letter_attempts
from projections.read_model import letter_attempts


def test_a_replayed_job_out_of_attempts_again_shows_all_its_attempts():
    row = letter_attempts({"kind": "job", "attempt": 6, "attempts": 3})
    assert (row["attempts"], row["budget_attempts"]) == (6, 3)
    assert _letter_attempts(row) == row["attempts_text"] == "6 (3 counted against its last budget)"


def test_a_first_dead_letter_and_a_record_read_as_before():
    first = letter_attempts({"kind": "job", "attempt": 3, "attempts": 3})
    assert (first["attempts"], first["budget_attempts"], _letter_attempts(first)) == (3, 3, "3")
    record = letter_attempts({"kind": "record", "attempt": None, "attempts": None})
    assert (record["attempts"], record["budget_attempts"], _letter_attempts(record)) == (None, None, "-")

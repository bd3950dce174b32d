"""One table of error classes (issue 45): the retry policy, `AttemptFailed.retryable`, the
exceptions' messages, the diagnosis and the glossary read `domain/error_classes.py`, and the docs'
tables are generated from it (`python -m projections.doc_tables --write`)."""

from __future__ import annotations

import inspect
import random
from pathlib import Path

from domain import errors
from domain.error_classes import ERROR_CLASSES, NOT_RETRIED, error_class, markdown
from domain.policy.retry import Action, RetryPolicy, STALL_BACKOFF_S, retry_decision
from projections import doc_tables

ROOT = Path(__file__).resolve().parents[2]


def test_the_retry_policy_follows_the_table():
    """A class the table does not retry ends the job at once with its terminal event; every other
    class is retried (at once for the stalls) until attempts run out."""
    policy = RetryPolicy()
    for name, spec in ERROR_CLASSES.items():
        first = retry_decision(name, 1, policy, random.Random(1))
        if spec.retried == NOT_RETRIED:
            expected = Action.FAIL if spec.terminal_event in ("JobFailed", "JobRejected") else Action.DEAD_LETTER
            assert first.action is expected, name
        else:
            assert first.action is Action.RETRY, name
            assert (first.delay_s == 0) == (name in STALL_BACKOFF_S), name
            assert retry_decision(name, policy.max_attempts, policy).action is Action.DEAD_LETTER
    assert error_class("no such class") is ERROR_CLASSES["unknown"] and error_class(None) is ERROR_CLASSES["unknown"]


def test_every_exception_names_a_class_of_the_table():
    """Each `TapelineError` subclass records a class of the table (`region_fenced` is an intake refusal,
    never an attempt's failure)."""
    classes = {cls.error_class for _, cls in inspect.getmembers(errors, inspect.isclass)
               if issubclass(cls, errors.TapelineError)}
    assert classes - set(ERROR_CLASSES) == {"region_fenced"}


def test_the_permanent_classes_are_the_ones_a_retry_cannot_pass():
    """A class is permanent exactly when it is not retried; a retried class's words say a retry may
    pass, a permanent one's that it would not."""
    for spec in ERROR_CLASSES.values():
        assert spec.permanent == (not spec.retryable), spec.name
        assert spec.on_retry.startswith("a retry may pass" if spec.retryable else "a retry would"), spec.name
        assert spec.what_to_do.format(job="J", letter="J/1", still="") and spec.meaning


def test_an_output_conflict_says_one_thing_everywhere():
    """The issue's complaint: the event said retryable, the message "a retry would meet it again", the
    diagnosis "a retry may pass". Now the event's flag, the policy, the message and the table agree."""
    from processors.stage_outcome import failure_events
    from processors.runtime import AttemptIdentity
    from domain import events as ev
    from tests.fakeclock import FixedClock
    from tapeline.settings import Settings

    spec = ERROR_CLASSES["output_conflict"]
    assert (spec.retryable, spec.permanent, spec.terminal_event) == (False, True, "JobDeadLettered")
    assert retry_decision("output_conflict", 1, RetryPolicy()).action is Action.DEAD_LETTER
    conflict = errors.OutputConflict.found("published/j/master.m3u8", "sha256 aa != bb", None)
    assert str(conflict).endswith(spec.on_retry) and conflict.error_class == "output_conflict"

    settings = Settings()
    clock = FixedClock()
    item = ev.WorkItem.new(clock.stamp(), job_id="j", stage="publish", attempt=1, tier="standard",
                           source_key="uploads/u/a.mp4", inputs=[], renditions=[], correlation_id="c",
                           recorded_by="t")
    identity = AttemptIdentity(job_id="j", stage="publish", attempt=1, claim_token="t" * 32, recorded_by="t",
                               correlation_id="c", causation_id=item.event_id, clock=clock)
    found = {"key": "published/j/master.m3u8", "sha256": "ab" * 32, "size_bytes": 41, "written_at": None}
    out = failure_events(settings, identity, item, 0, "output_conflict", str(conflict), in_the_way=found)
    failed = next(e for _, e in out if isinstance(e, ev.AttemptFailed))
    dead = [e for _, e in out if isinstance(e, ev.JobDeadLettered)]
    assert failed.retryable is False and failed.in_the_way.key == "published/j/master.m3u8"
    assert dead and all(d.in_the_way.sha256 == "ab" * 32 and d.in_the_way.size_bytes == 41 for d in dead)
    # a retryable class out of attempts is still flagged retryable: the flag is the class's
    out = failure_events(settings, identity, item, 0, "storage_transient", "S3 503")
    assert next(e for _, e in out if isinstance(e, ev.AttemptFailed)).retryable is True


def test_the_docs_carry_the_table():
    """Both documents' error tables are the table's rendering, one row per class, and no other block
    the docs generate is stale (`python -m projections.doc_tables --write` rewrites them)."""
    assert doc_tables.stale() == [], "regenerate: python -m projections.doc_tables --write"
    table = markdown()
    assert all(f"| `{name}` |" in table for name in ERROR_CLASSES)
    for name in ("docs/design.md", "docs/operating.md"):
        assert table in (ROOT / name).read_text()


def test_a_stale_block_is_found_and_rewritten(tmp_path):
    """The check can fail: an edited row is reported, and `into` puts the rendering back."""
    block = next(b for b in doc_tables.BLOCKS if b.name == "error classes")
    doc = f"intro\n{block.begin}\n{markdown().replace('yes, at once', 'yes, later')}\n{block.end}\nrest\n"
    assert block.current(doc) != block.render()
    fixed = block.into(doc)
    assert block.current(fixed) == block.render() and fixed.startswith("intro\n") and fixed.endswith("rest\n")

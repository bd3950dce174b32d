"""Both fold engines on generated lifecycles (issue 19, item 6): the Python fold as the bulk replay
uses it (`bulk.FoldState` over `fold.fold_batch` and `lifecycle.evolve`) and the native one
(`native.NativeFoldState` over `tapeline_native.Engine`) must make the same evidence rows, job rows
(final ones flushed as they come, open ones at the end), dedup keys, uploads, log clock, positions,
dead letters and counts (`tests/enginecompare.py`).

Hypothesis writes logs of several jobs over every event type of `domain/events.py`: a writer that
mostly follows the job (a stage queued, an attempt claimed with a new token, its heartbeats and
outcome) and sometimes writes with a stale token or an older attempt (a zombie), without a token or
anywhere at all; terminal events and operator replays (reopening dead_lettered and needs_review),
events of jobs never accepted, second intake decisions; records swapped out of order and repeated
(the same bytes, or the same dedup key with other contents); uploads, watchdog ticks (the clock
topic), dead letters on the dead-letter topic and undecodable records; odd strings (quotes, tabs,
NUL), odd floats (NaN, inf, -0.0, huge leases) and broker times near year 9999, read in slices of
any size with final rows flushed every few jobs. The test then checks that the generator reached
every event type applied, duplicates, superseded events, reopened jobs and dead letters, so it
cannot pass by generating nothing interesting.
"""

from __future__ import annotations

import types
import typing
from collections import Counter
from datetime import datetime, timedelta, timezone

from hypothesis import HealthCheck, given, settings, strategies as st
from pydantic import BaseModel

from projections import native
from domain import events as ev
from domain.codec import default_codec
from domain.lifecycle_data import LIFECYCLE
from tapeline.clock import system_clock
from tests.enginecompare import DLQ, JOBS, UPLOADS, assert_same, fold_both, require_native
from tests.fakelog import T0, FakeMessage

require_native()

KINDS = tuple(sorted(set(ev.Event.registry) - {"RegionFailedOver"}))
"""Every event type of the projected topics: a new one is generated (and must fold equal) without
touching this test. `RegionFailedOver` lives on `<prefix>.regions`, which no projection reads."""
ENVELOPE = set(ev.Event.model_fields) | {"sequence"}
REOPENING = {kind for kind, rule in LIFECYCLE.ending.items() if rule.state in LIFECYCLE.reopenable_states}
"""Ending events whose state an operator's JobReplayed reopens (JobDeadLettered, NeedsReview)."""
STAGES = ("intake", "archive", "transcode", "thumbnails", "publish")
"""The stages writers move through: the old fixed order's and stages only a recorded pipeline orders."""
PIPELINES = st.one_of(st.sampled_from([["transcode", "thumbnails", "publish"], ["transcode", "publish"],
                                                  ["archive", "transcode", "thumbnails", "publish"], []]),
                      st.lists(st.sampled_from(STAGES[1:] + ("x",)), max_size=4))
LATE = datetime(9999, 12, 31, 22, tzinfo=timezone.utc)  # a lease from here overflows datetime
UTC = timezone.utc
SETUP = native.engine_setup()

PLAIN_TEXT = st.text(alphabet="ab:@ -_.", max_size=6)
ODD_TEXT = st.text(alphabet=['"', "\\", "\t", "\n", "\r", "é", "😀", "\u2028", ":", "@", "a"], max_size=5)
TEXT = st.one_of(PLAIN_TEXT, PLAIN_TEXT, ODD_TEXT)
NUL_TEXT = st.one_of(TEXT, st.text(alphabet="a\x00", min_size=1, max_size=2))  # a few fields only: a dead letter
FLOAT = st.one_of(st.sampled_from([0.0, -0.0, 1.0, 0.5, 0.1, 30.0, 1e-7, 2.5e-6, 1e16, 12.345678901]),
                  st.floats(-1e6, 1e6), st.floats())
INT = st.one_of(st.integers(0, 5), st.integers(-(2 ** 31), 2 ** 31 - 1))
DATETIME = st.one_of(st.integers(-10 ** 8, 10 ** 8).map(lambda s: T0 + timedelta(seconds=s / 7)),
                     st.datetimes(min_value=datetime(1970, 1, 2), max_value=datetime(9999, 12, 30),
                                  timezones=st.just(UTC)))
SMALL_FLOAT = st.one_of(st.sampled_from([0.0, 1.0, 2.5, 10.0, 0.1]), FLOAT)
OVERRIDES = {  # fields whose values the fold reads: drawn mostly where its rules branch
    ("AttemptStarted", "lease_s"): st.one_of(st.sampled_from([30.0, 0.5, 1e-7, 12.3456789, 0.0]),
                                             st.sampled_from([30.0, 60.0]), FLOAT),
    ("Heartbeat", "frames_done"): st.one_of(st.integers(0, 100), INT),
    ("Heartbeat", "out_time_s"): SMALL_FLOAT,
    ("Heartbeat", "progress_grace_s"): st.one_of(st.none(), st.sampled_from([0.0, 5.0]), FLOAT),
    ("StallDetected", "kind"): st.sampled_from(["handoff", "no_progress", "lease", "x"]),
    ("StallDetected", "since_s"): SMALL_FLOAT,
    ("AttemptSucceeded", "audio_playlist_key"): st.one_of(st.none(), TEXT),
    ("JobAccepted", "pipeline_stages"): PIPELINES,
    ("AttemptFailed", "reason"): NUL_TEXT,
    ("StallDetected", "detail"): NUL_TEXT,
}


def _value(annotation: typing.Any) -> st.SearchStrategy:
    """A strategy for a model field's annotation (scalars, optionals, lists, nested models, bytes maps)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = [m for m in typing.get_args(annotation) if m is not type(None)]
        inner = st.one_of(*[_value(m) for m in members])
        return st.one_of(st.none(), inner) if len(members) < len(typing.get_args(annotation)) else inner
    origin = typing.get_origin(annotation)
    if origin is list:
        return st.lists(_value(typing.get_args(annotation)[0]), max_size=2)
    if origin is dict:
        return st.dictionaries(PLAIN_TEXT, st.binary(max_size=3), max_size=2)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return st.fixed_dictionaries({name: _value(f.annotation) for name, f in annotation.model_fields.items()}
                                     ).map(lambda d, cls=annotation: cls(**d))
    return {str: TEXT, int: INT, float: FLOAT, bool: st.booleans(), datetime: DATETIME,
            bytes: st.one_of(st.none(), st.binary(max_size=3))}[annotation]


FIELDS = {kind: st.fixed_dictionaries({
    name: OVERRIDES[(kind, name)] if (kind, name) in OVERRIDES else _value(field.annotation)
    for name, field in cls.model_fields.items() if name not in ENVELOPE}) for kind, cls in ev.Event.registry.items()}


class Writer:
    """Where the writers of one job are: its current stage, attempt and claim token, the ones before."""

    def __init__(self, job_id: str) -> None:
        self.job_id, self.stage, self.attempt, self.token = job_id, "intake", 0, None
        self.history: list[tuple[str, int, str | None]] = [("intake", 0, None)]
        self.tokens = 0


@st.composite
def envelope(draw, writer: Writer, kind: str) -> dict:
    """Stage, attempt and claim token of the next event: mostly the writer's current ones (after
    moving it for a StageQueued or an AttemptStarted), else a zombie's, none, or anything."""
    token_before = writer.token
    if kind == "StageQueued" and draw(st.integers(0, 3)):
        writer.stage, writer.attempt = draw(st.sampled_from([
            (writer.stage, writer.attempt + 1),
            (STAGES[min(STAGES.index(writer.stage) + 1, len(STAGES) - 1)] if writer.stage in STAGES else "intake", 1),
        ]) | st.tuples(st.sampled_from(STAGES), st.integers(0, 4)))
        writer.token = None
    elif kind == "AttemptStarted" and draw(st.integers(0, 3)):
        writer.tokens += 1
        writer.token = f"tok-{writer.tokens}"
    writer.history.append((writer.stage, writer.attempt, writer.token))
    how = draw(st.sampled_from(["current"] * 6 + ["zombie", "no_token", "anything"]))
    if how == "current":
        token = token_before if kind == "StageQueued" and token_before is not None and draw(st.booleans()) \
            else writer.token
        return dict(stage=writer.stage, attempt=writer.attempt, claim_token=token)
    if how == "zombie":
        stage, attempt, token = draw(st.sampled_from(writer.history))
        return dict(stage=stage, attempt=attempt, claim_token=token)
    if how == "no_token":
        return dict(stage=writer.stage, attempt=writer.attempt, claim_token=None)
    return dict(stage=draw(st.sampled_from(STAGES + ("x",))), attempt=draw(st.integers(0, 4)),
                claim_token=draw(st.sampled_from([None, "tok-1", "tok-2", "other"])))


@st.composite
def event(draw, writer: Writer, kind: str, number: list[int], **fixed) -> ev.Event:
    """One event of `kind` for `writer`'s job; `fixed` overrides envelope or fields."""
    cls = ev.Event.registry[kind]
    fields = draw(FIELDS[kind])
    where = draw(envelope(writer, kind))
    occurred_at = draw(st.one_of(st.just(T0), DATETIME))
    if kind == "RetryScheduled":  # the writer's delay: not_before - occurred_at (negative, huge)
        fields["not_before"] = draw(st.one_of(
            st.integers(-60, 600).map(lambda s: occurred_at + timedelta(seconds=s)), DATETIME))
    if kind == "JobReplayed":
        fields["dead_letter_id"] = draw(st.sampled_from([None, f"{writer.job_id}/{writer.attempt}"]))
    if kind in ("JobAccepted", "JobRejected", "UploadCompleted"):
        fields["upload_id"] = f"up-{writer.job_id}"
    sequence = draw(st.integers(0, 3)) if "sequence" in cls.model_fields else None
    if kind == "ProviderBreakerChanged":
        sequence = f"p.{draw(st.integers(0, 2))}"
    values = {**where, **fields, **fixed}
    stage, attempt, claim_token = values.pop("stage"), values.pop("attempt"), values.pop("claim_token")
    made = cls.new(system_clock.stamp(), job_id=writer.job_id, stage=stage, attempt=attempt, claim_token=claim_token,
                   recorded_by=draw(st.sampled_from(["worker@h1", "watchdog@h2", "op", "a@b@c"])),
                   correlation_id="c", causation_id=draw(st.sampled_from([None, "cause"])), sequence=sequence,
                   occurred_at=occurred_at, **values)
    number[0] += 1
    return made.model_copy(update={"event_id": f"e{number[0]}"})


@st.composite
def job_records(draw, job_id: str, number: list[int]) -> list[tuple[str, ev.Event | bytes]]:
    """(topic, event or raw bytes) of one job, in the order its writers wrote them, then perturbed:
    swapped out of order and repeated."""
    writer, out = Writer(job_id), []
    opening = draw(st.sampled_from(["JobAccepted"] * 5 + ["JobRejected", None]))
    if opening:
        out.append(draw(event(writer, opening, number, stage="intake", attempt=0, claim_token=None)))
    for _ in range(draw(st.integers(0, 22))):
        kind = draw(st.sampled_from(KINDS))
        out.append(draw(event(writer, kind, number)))
        if kind in REOPENING and draw(st.booleans()):  # an operator reopens it
            out.append(draw(event(writer, "JobReplayed", number, claim_token=None)))
    if draw(st.integers(0, 9)) == 0:
        out.append(b"\xc3\x01not avro")
    for _ in range(draw(st.integers(0, 3))):  # out of order
        i, j = draw(st.integers(0, max(len(out) - 1, 0))), draw(st.integers(0, max(len(out) - 1, 0)))
        if out:
            out[i], out[j] = out[j], out[i]
    for _ in range(draw(st.integers(0, 3))):  # redelivered, or the same dedup key with other contents
        if out:
            copy = draw(st.sampled_from(out))
            if isinstance(copy, ev.Event) and draw(st.booleans()):
                number[0] += 1
                copy = copy.model_copy(update={"event_id": f"e{number[0]}", "occurred_at": T0})
            out.insert(draw(st.integers(out.index(copy) if copy in out else 0, len(out))), copy)
    topic = {"UploadCompleted": UPLOADS, "DeadLetter": DLQ, "DeadLetterDismissed": DLQ}
    return [(topic.get(getattr(item, "event_type", ""), JOBS), item) for item in out]


@st.composite
def logs(draw) -> tuple[list[FakeMessage], Counter]:
    """Several jobs' records interleaved in one log (a job keeps to one partition), with broker times
    rising per partition; and the event types written."""
    number = [0]
    jobs = [draw(job_records(f"job-{i}", number)) for i in range(draw(st.integers(1, 5)))]
    base = draw(st.sampled_from([T0] * 7 + [LATE]))
    codec, messages, offsets, clocks, kinds = default_codec(), [], {}, {}, Counter()
    pending = [list(records) for records in jobs]
    while any(pending):
        index = draw(st.sampled_from([i for i, records in enumerate(pending) if records]))
        topic, item = pending[index].pop(0)
        partition = index % 3
        offset = offsets.get((topic, partition), 0)
        offsets[(topic, partition)] = offset + 1
        at = clocks.get(partition, int(base.timestamp() * 1000)) + draw(st.sampled_from([0, 1, 7, 1000, 30_000]))
        clocks[partition] = at
        value = item if isinstance(item, bytes) else codec.encode(item.to_record())
        kinds[getattr(item, "event_type", "raw")] += 1
        messages.append(FakeMessage(topic, partition, offset, at, value, b"k", [("h", b"v")]))
    return messages, kinds


def test_both_engines_fold_generated_lifecycles_the_same():
    reached: Counter = Counter()

    # derandomize: the coverage checks below need the same examples on every run; with a random
    # seed one run in a few dozen never reached needs_review and failed. 300, not 200: with one more
    # event type (a trial reopenable state, issue 19 item 9) 200 never left a job in retry_scheduled.
    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(logs(), st.integers(1, 40), st.integers(1, 4))
    def check(log, slice_size, flush_rows):
        messages, kinds = log
        python, native_made = fold_both(messages, slice_size=slice_size, flush_rows=flush_rows, setup=SETUP)
        assert_same(python, native_made)
        reached.update(kinds)
        reached.update(f"applied {row[5]}" for row in python["evidence"] if row[14])
        reached.update(f"reopened {row[6]}" for row in python["evidence"] if row[14] and row[5] == "JobReplayed")
        records, applied, duplicates, superseded, dead = python["counts"]
        reached.update(duplicates=duplicates, superseded=superseded, dead_letters=dead,
                       final_rows=len(python["final"]), open_rows=len(python["open"]))
        reached.update(f"state {row['state']}" for row in python["final"] + python["open"] if "state" in row)

    check()
    assert set(KINDS) <= set(reached), set(KINDS) - set(reached)
    applied = {kind for kind in KINDS if reached[f"applied {kind}"]}
    must_apply = LIFECYCLE.events["opening"] | LIFECYCLE.events["folded"] | LIFECYCLE.events["ending"] | \
        LIFECYCLE.events["bookkeeping"]
    assert must_apply - {"DeadLetter"} <= applied, must_apply - applied  # (a DeadLetter goes to the DLQ topic)
    assert all(reached[name] > 0 for name in ("duplicates", "superseded", "dead_letters", "final_rows", "open_rows"))
    assert sum(n for key, n in reached.items() if key.startswith("reopened")) > 0
    assert {f"state {s}" for s in LIFECYCLE.states} <= set(reached)
    assert not {key for key in reached if key.startswith("state ")} - {f"state {s}" for s in LIFECYCLE.states}

"""The native fold engine of a fresh replay: `tapeline_native` (Rust, `native/`) behind `FoldState`'s interface.

The Python rules stay the specification (`fold.decode_batch`, `fold.fold_batch`,
`lifecycle.evolve`, `bulk.FoldState`); `tapeline_native.Engine` is a second implementation of them that
decodes the Avro bytes, folds the job rows and dedup keys and encodes the COPY rows without making a
Python object per record. What it cannot reproduce exactly it does not guess:

- a record it cannot decode, a record of the dead-letter topic and an event holding a NUL
  character are handed back here one at a time and go through the Python `decode_batch` and
  `fold_batch` (they only ever make dead letters, so they need no job row); if the Python codec
  decodes a record into an event that would be folded, the engines disagree: `NativeUnsupported`;
- an event whose date arithmetic `lifecycle.evolve` raises on (a NaN lease) is kept as evidence by the
  engine and its dead letter made here, worded by the same Python expression;
- anything else it cannot fold exactly (bytes or maps in a lifecycle event, a writer schema it cannot
  resolve) raises `NativeUnsupported`.

`NativeUnsupported` makes the replay roll back and start again with the Python engine
(`projections.replay`), with a log line saying why. Select with `--engine` / `TAPELINE_REPLAY_ENGINE`:
`auto` (native when the extension imports), `native`, `python`.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from typing import Any

# Only what a replay worker's native fold needs is imported here (a worker starts in a third of the
# time without the projector, psycopg, the models and the Python codec): the rest is imported where
# it is used, by the parent (`engine_setup`) or on the rare record the Python rules must handle.
from projections.batch import BatchResult
from domain.errors import ConfigurationError, TapelineError

try:
    import tapeline_native
except ImportError as exc:  # not built (e.g. no Rust toolchain): the Python engine replays
    tapeline_native = None
    IMPORT_ERROR: str | None = str(exc)
else:
    IMPORT_ERROR = None

ENGINES = ("auto", "native", "python")
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
COPY_CHUNK_BYTES = 4 * 1024 * 1024


class NativeUnsupported(TapelineError):
    """The native engine cannot fold this log exactly; the replay is redone with the Python engine."""


def resolve_engine(engine: str) -> str:
    """`auto` -> `native` when `tapeline_native` imports, else `python`. Raises `ConfigurationError`
    for an unknown name, or for `native` without the extension."""
    if engine not in ENGINES:
        raise ConfigurationError(f"unknown replay engine {engine!r} (TAPELINE_REPLAY_ENGINE): use one of {', '.join(ENGINES)}")
    if engine == "python":
        return "python"
    if tapeline_native is None:
        if engine == "native":
            raise ConfigurationError(f"the native replay engine is not installed ({IMPORT_ERROR}): "
                                     "`pip install ./native` (needs cargo), or use --engine python")
        return "python"
    return "native"


def _ts(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def _schemas() -> tuple[dict[str, dict], list[tuple[bytes, str, dict]]]:
    """The current schema of each event type, and every writer the Python codec reads (the current
    ones first, then `registered/*.avsc`, the first of a fingerprint winning as in `Codec`)."""
    from domain.codec import REGISTERED_DIR, default_codec, schema_fingerprint

    codec = default_codec()
    writers = [(codec.fingerprints[name], name, schema) for name, schema in codec.schemas.items()]
    seen = {fp for fp, _, _ in writers}
    if REGISTERED_DIR.is_dir():
        for path in sorted(REGISTERED_DIR.glob("*.avsc")):
            old = json.loads(path.read_text())
            fp = schema_fingerprint(old)
            if fp not in seen:
                seen.add(fp)
                writers.append((fp, old["name"].rsplit(".", 1)[-1], old))
    if set(codec.writers) != seen:
        raise NativeUnsupported("the codec reads writer schemas this module did not find")
    return codec.schemas, writers


def check_build() -> None:
    """Raise `NativeUnsupported` when `tapeline_native` was built from a `schemas/lifecycle.json` other
    than this repository's (a stale build: `scripts/bootstrap.sh` rebuilds it) or is not installed."""
    from domain.lifecycle_data import PATH

    if tapeline_native is None:
        raise NativeUnsupported(f"tapeline_native is not installed: {IMPORT_ERROR}")
    built = getattr(tapeline_native, "LIFECYCLE_JSON", None)
    if built is None or json.loads(built) != json.loads(PATH.read_text(encoding="utf-8")):
        raise NativeUnsupported(f"tapeline_native was built from another {PATH.name} than {PATH}: rebuild it "
                                "(scripts/bootstrap.sh)")


EngineSetup = tuple[dict[str, dict], list[tuple[bytes, str, dict]], list[str], list[str]]
"""What `tapeline_native.Engine` is built from: reader schemas, writer schemas, `lifecycle.JOB_STATE_COLUMNS`
and the sorted `writes.PAYLOAD_OMITS`. Plain data: a replay's parent computes it once and pickles it
to its workers."""


def engine_setup() -> EngineSetup:
    """This code's `EngineSetup` (imports the Python codec, the fold and the writes)."""
    from domain import lifecycle
    from projections import writes

    check_build()
    readers, writers = _schemas()
    return readers, writers, list(lifecycle.JOB_STATE_COLUMNS), sorted(writes.PAYLOAD_OMITS)


class NativeFoldState:
    """`bulk.FoldState` over `tapeline_native.Engine`: evidence comes out as binary COPY bytes, final
    and open job rows and dedup keys as text COPY bytes (`lifecycle.JOB_STATE_COLUMNS`, one column)."""

    native = True

    def __init__(self, clock_topic: str | None = None, dlq_topic: str | None = None, flush_rows: int = 2000,
                 setup: EngineSetup | None = None) -> None:
        """`setup`: `engine_setup()`, computed here when not given (a replay worker gets its parent's)."""
        if tapeline_native is None:
            raise NativeUnsupported(f"tapeline_native is not installed: {IMPORT_ERROR}")
        self.clock_topic, self.dlq_topic, self.flush_rows = clock_topic, dlq_topic, flush_rows
        readers, writers, columns, omits = setup if setup is not None else engine_setup()
        try:
            self.engine = tapeline_native.Engine(readers, writers, columns, omits, clock_topic, dlq_topic)
        except (tapeline_native.Unsupported, TypeError) as exc:  # TypeError: a stale build of another signature
            raise NativeUnsupported(str(exc)) from exc
        self.positions: dict[tuple[str, int], int] = {}
        self.pending_dead: list[tuple[list, list]] = []

    def fold(self, messages: list, end_positions: dict[tuple[str, int], int] | None,
             phases: dict[str, float]) -> tuple[BatchResult, bytes]:
        """Decode and fold one slice; returns its counts and its evidence rows (binary COPY, no
        header). Seconds go to `phases["fold"]` (decode and fold are one pass here)."""
        started = time.perf_counter()
        result = BatchResult(records=len(messages), positions=self.positions)
        try:
            evidence, positions, counts, dead = self.engine.fold(messages)
        except tapeline_native.Unsupported as exc:
            raise NativeUnsupported(str(exc)) from exc
        for topic, partition, offset in positions:
            self.positions[(topic, partition)] = offset
        for position, offset in (end_positions or {}).items():  # as decode_batch does
            if offset > 0:
                self.positions[position] = max(self.positions.get(position, 0), offset)
        result.applied, result.duplicates, result.superseded = counts
        dead_letters: list[dict[str, Any]] = []
        replays: list[dict[str, Any]] = []
        for kind, data in dead:
            if kind == "delegate":
                self._delegate(messages[data], dead_letters, replays, result)
            elif kind == "evolve_error":
                self._evolve_error(messages[data[0]], data[1], dead_letters, result)
            elif kind == "job":
                from projections.fold import dead_letter

                (id_, topic, partition, offset, ts, reason, processor, error_class, job_id, stage, attempt, attempts,
                 evidence_ref) = data
                dead_letters.append(dead_letter(id_, "job", topic, partition, offset, _ts(ts), reason, processor,
                                                error_class=error_class, job_id=job_id, stage=stage, attempt=attempt,
                                                attempts=attempts, evidence=evidence_ref))
            else:
                id_, ts, operator, reason = data
                replays.append({"id": id_, "broker_ts": _ts(ts), "operator": operator, "reason": reason})
        if dead_letters or replays:
            self.pending_dead.append((dead_letters, replays))
        phases["fold"] = phases.get("fold", 0.0) + time.perf_counter() - started
        return result, evidence

    def _delegate(self, message, dead_letters: list, marks: list, result: BatchResult) -> None:
        """A record the engine handed back (any record of the dead-letter topic, or one holding NUL): the
        Python rules make its dead letter, or its mark (a `DeadLetterDismissed`), or nothing."""
        from projections.fold import decode_batch, fold_batch

        sub = BatchResult(records=1, positions={})
        folded = fold_batch(decode_batch([message], sub), {}, set(), sub, self.clock_topic, self.dlq_topic,
                            binary_payload=True)
        if folded.evidence or folded.changed or folded.uploads or folded.new_keys:
            raise NativeUnsupported(f"{message.topic()}/{message.partition()}/{message.offset()}: the native "
                                    "engine could not decode a record the Python codec folds")
        dead_letters.extend(folded.dead)
        marks.extend(folded.replays)
        result.dead_letters += sub.dead_letters

    def _evolve_error(self, message, lease: float | None, dead_letters: list, result: BatchResult) -> None:
        """An event whose date arithmetic `lifecycle.evolve` raises on (the engine kept it as evidence, not
        applied): the dead letter `fold_batch` makes, its error worded by the same Python expression
        (`lease`: the job row's lease a heartbeat extends by). The expression must raise here too."""
        from projections.fold import dead_letter, decode_batch
        from tapeline.ports import broker_time
        from domain import events as ev

        decoded = decode_batch([message], BatchResult(records=1, positions={}))
        event = decoded[0][1]
        ts = broker_time(message)
        try:
            if isinstance(event, ev.AttemptStarted):
                ts + timedelta(seconds=event.lease_s)
            elif isinstance(event, ev.Heartbeat) and lease is not None:
                ts + timedelta(seconds=lease)
            elif isinstance(event, ev.RetryScheduled):
                ts + max(timedelta(0), event.not_before - event.occurred_at)
        except (ArithmeticError, ValueError, TypeError) as exc:  # what fold_batch catches around evolve
            topic, partition, offset = message.topic(), message.partition(), message.offset()
            dead_letters.append(dead_letter(
                f"{topic}/{partition}/{offset}", "projection", topic, partition, offset, ts,
                f"{event.event_type} cannot be applied to its job: {type(exc).__name__}: {exc}", "projector",
                key=message.key(), value=message.value(), headers=message.headers(), error_class="invalid_input",
                job_id=event.job_id, stage=event.stage, attempt=event.attempt, evidence=f"{topic}/{partition}/{offset}"))
            result.dead_letters += 1
            return
        raise NativeUnsupported(f"{message.topic()}/{message.partition()}/{message.offset()}: the native engine "
                                "found date arithmetic out of range where the Python fold finds none")

    def final_count(self) -> int:
        return self.engine.pending_final()

    def flush_due(self) -> bool:
        return self.final_count() >= self.flush_rows or len(self.pending_dead) >= self.flush_rows

    def take_final_rows_copy(self) -> bytes:
        """The queued final jobs' rows, text COPY format; they become stubs."""
        return self.engine.take_final_rows()

    def take_dead(self) -> list[tuple[list, list]]:
        taken, self.pending_dead = self.pending_dead, []
        return taken

    def open_rows_copy(self) -> list[bytes]:
        """Rows of the jobs not written yet, text COPY format, in chunks; after `take_final_rows_copy`."""
        return self.engine.open_rows(COPY_CHUNK_BYTES)

    def keys_copy(self) -> list[bytes]:
        """Every applied dedup key, text COPY format, in chunks."""
        return self.engine.keys(COPY_CHUNK_BYTES)

    def job_ids(self) -> set[str]:
        return set(self.engine.job_ids())

    @property
    def uploads(self) -> dict[str, list]:
        """upload id -> `bulk.UPLOAD_COLUMNS` values, as `FoldState.uploads`."""
        return {row[0]: [*row[:6], _ts(row[6]), row[7], row[8]] for row in self.engine.uploads()}

    @property
    def clock(self) -> dict[int, datetime]:
        return {partition: _ts(us) for partition, us in self.engine.clock()}

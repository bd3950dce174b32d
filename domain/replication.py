"""Media replication from region A to region B, the pure part (docs/regions.md "Media replication").

Three decisions, each taking its inputs (and `now` where time matters) and doing no I/O:

- `objects_named(event)`: which objects of the bucket a lifecycle or upload event names, with the
  sha256 (and size) the log recorded for each. The replicator copies exactly these.
- `after_failure(kind, attempts, now, ...)`: what the replicator does when an object could not be
  copied: wait on the record (a store that does not answer: nothing moves past it) or park the
  object as pending and retry it later (missing in A, bytes not matching their recorded sha256).
- `ObjectTotals` / `pending_age_s`: the figures `tapeline region status` prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum

from domain import events as ev


@dataclass(frozen=True)
class NamedObject:
    """One object an event names: its `key` in the bucket, the hex `sha256` the log recorded for it
    (None: the event records none, so the copy is checked against the sha256 region A's store keeps
    in the object's metadata), and its size in bytes when the log says (None otherwise)."""

    key: str
    sha256: str | None
    size_bytes: int | None = None


def objects_named(event: ev.Event) -> list[NamedObject]:
    """The objects `event` names, in the event's order, each key once (the first mention wins, one
    with a sha256 over one without). Pure.

    - `UploadCompleted`: the source (`object_key`, `sha256`, `size_bytes`);
    - `JobAccepted`: the source again (`source_key`, `source_sha256`, `source_size_bytes`);
    - `CheckpointRecorded`: the finished segment (`object_key`, `sha256`);
    - `AttemptSucceeded`, `ResultReused`: every output (`key`, `sha256`, `size_bytes`). A publish
      attempt's outputs are the published copies under `published/{job}/`, the master playlist
      among them: publish copies each attempt output's bytes unchanged (`processors/providers.py`
      `OriginProvider.publish`), so a copy's sha256 is its output's; the master playlist is written
      by publish and its sha256 is recorded here;
    - `Published` (and `ResultReused` beside its outputs): the master playlist (`master_key`) and
      each rendition's playlist (`playlist_key`), with no sha256 (the event records none; the
      publish attempt's `AttemptSucceeded`, committed in the same transaction, does);
    - every other event: none.
    """
    found: list[NamedObject] = []
    if isinstance(event, ev.UploadCompleted):
        found.append(NamedObject(event.object_key, event.sha256, event.size_bytes))
    elif isinstance(event, ev.JobAccepted):
        found.append(NamedObject(event.source_key, event.source_sha256, event.source_size_bytes))
    elif isinstance(event, ev.CheckpointRecorded):
        found.append(NamedObject(event.object_key, event.sha256))
    elif isinstance(event, ev.AttemptSucceeded):
        found.extend(NamedObject(o.key, o.sha256, o.size_bytes) for o in event.outputs)
    elif isinstance(event, ev.ResultReused):
        found.extend(NamedObject(o.key, o.sha256, o.size_bytes) for o in event.outputs)
        found.extend(_playlists(event.master_key, event.renditions))
    elif isinstance(event, ev.Published):
        found.extend(_playlists(event.master_key, event.renditions))
    return merge_named(found)


def _playlists(master_key: str, renditions: list[ev.Rendition]) -> list[NamedObject]:
    return [NamedObject(master_key, None)] + [NamedObject(r.playlist_key, None) for r in renditions if r.playlist_key]


def merge_named(objects: list[NamedObject]) -> list[NamedObject]:
    """`objects` with each key once, in first-mention order; a mention with a sha256 replaces an
    earlier one without. Pure."""
    by_key: dict[str, NamedObject] = {}
    for named in objects:
        if not named.key:
            continue
        earlier = by_key.get(named.key)
        if earlier is None or (earlier.sha256 is None and named.sha256 is not None):
            by_key[named.key] = named
    return list(by_key.values())


class CopyFailure(str, Enum):
    """Why an object was not copied."""

    MISSING_IN_A = "missing_in_a"
    """Region A's store answered that the key does not exist (not there yet, or removed)."""
    SHA256_MISMATCH = "sha256_mismatch"
    """The bytes read from A do not have the sha256 the log (or A's metadata) recorded."""
    CONFLICT_IN_B = "conflict_in_b"
    """Region B already holds other bytes under the key; they are never overwritten."""
    STORE_UNAVAILABLE = "store_unavailable"
    """Region A's or region B's store did not answer (or failed the call)."""


class Verdict(str, Enum):
    WAIT = "wait"
    """Keep the record: retry its objects after the delay, move past nothing."""
    PARK = "park"
    """Record the object as pending with its reason and retry time, and move on to the next record."""


@dataclass(frozen=True)
class FailureDecision:
    verdict: Verdict
    retry_at: datetime
    delay_s: float


def retry_delay_s(attempts: int, first_s: float = 0.5, max_s: float = 30.0) -> float:
    """Seconds before the next try of an object that failed `attempts` times (>= 1): `first_s`
    doubled per failure, at most `max_s`. Pure."""
    return min(max_s, first_s * 2 ** max(0, min(attempts, 32) - 1))


def after_failure(kind: CopyFailure, attempts: int, now: datetime, *, first_s: float = 0.5,
                  max_s: float = 30.0) -> FailureDecision:
    """What to do after the `attempts`-th failure (>= 1) of one object's copy, at `now` (UTC). Pure.

    A store that does not answer (`STORE_UNAVAILABLE`) makes the replicator WAIT on the record: every
    other object would fail the same way, and nothing may move past an object that was not copied.
    An object that is missing in A, whose bytes do not match their sha256, or whose key holds other
    bytes in B, is PARKed: recorded as pending (never as replicated) with the reason, retried at
    `retry_at` from the table, so one bad object does not stop the log behind it.
    """
    delay = retry_delay_s(attempts, first_s, max_s)
    verdict = Verdict.WAIT if kind is CopyFailure.STORE_UNAVAILABLE else Verdict.PARK
    return FailureDecision(verdict, now + timedelta(seconds=delay), delay)


@dataclass(frozen=True)
class ObjectTotals:
    """The objects region B's mirrored log names, against those copied to B's store.

    `named`: distinct keys named (recorded by the replicator, plus those in records it has not read
    yet); `replicated` / `replicated_bytes`: copied and verified (bytes actually in B);
    `pending`: named and not replicated; `pending_bytes`: their sizes where the log states one
    (`pending_bytes_known` False when some pending object has no size in the log);
    `oldest_pending_named_at`: B's broker time of the record that first named the oldest pending
    object (None when nothing is pending); `pending_by_reason`: pending objects per last failure
    (`CopyFailure` value, `unread` for objects in records the replicator has not reached).
    """

    named: int
    replicated: int
    replicated_bytes: int
    pending: int
    pending_bytes: int
    pending_bytes_known: bool
    oldest_pending_named_at: datetime | None
    pending_by_reason: dict[str, int]

    def as_dict(self, now: datetime) -> dict:
        """JSON-ready, with `oldest_pending_age_s` measured at `now` (None when nothing is pending)."""
        return {"named": self.named, "replicated": self.replicated, "replicated_bytes": self.replicated_bytes,
                "pending": self.pending, "pending_bytes": self.pending_bytes,
                "pending_bytes_known": self.pending_bytes_known,
                "oldest_pending_age_s": pending_age_s(self.oldest_pending_named_at, now),
                "pending_by_reason": dict(sorted(self.pending_by_reason.items()))}


def pending_age_s(named_at: datetime | None, now: datetime) -> float | None:
    """Seconds from `named_at` to `now` (at least 0, 0.1 s precision), None when `named_at` is None. Pure."""
    if named_at is None:
        return None
    return round(max(0.0, (now - named_at).total_seconds()), 1)


@dataclass(frozen=True)
class RecordedObject:
    """One row of the replicator's table as the totals need it: `state` `replicated` or `pending`,
    its size (None: unknown), when it was first named (B's broker time), its last failure."""

    key: str
    state: str
    size_bytes: int | None
    named_at: datetime
    failure: str | None = None


def object_totals(recorded: list[RecordedObject], unread: list[tuple[NamedObject, datetime]]) -> ObjectTotals:
    """The totals from the replicator's rows (`recorded`) and the objects named by records it has
    not read yet (`unread`: each with its record's broker time in B). An unread object already
    recorded is counted once, as recorded. Pure."""
    rows = {r.key: r for r in recorded}
    pending_sizes: list[int | None] = []
    oldest: datetime | None = None
    reasons: dict[str, int] = {}
    replicated = replicated_bytes = 0
    for row in rows.values():
        if row.state == "replicated":
            replicated += 1
            replicated_bytes += row.size_bytes or 0
            continue
        pending_sizes.append(row.size_bytes)
        oldest = row.named_at if oldest is None else min(oldest, row.named_at)
        reasons[row.failure or "not_tried"] = reasons.get(row.failure or "not_tried", 0) + 1
    seen_unread: set[str] = set()
    for named, at in unread:
        if named.key in rows or named.key in seen_unread:
            continue
        seen_unread.add(named.key)
        pending_sizes.append(named.size_bytes)
        oldest = at if oldest is None else min(oldest, at)
        reasons["unread"] = reasons.get("unread", 0) + 1
    return ObjectTotals(named=len(rows) + len(seen_unread), replicated=replicated, replicated_bytes=replicated_bytes,
                        pending=len(pending_sizes), pending_bytes=sum(s or 0 for s in pending_sizes),
                        pending_bytes_known=all(s is not None for s in pending_sizes),
                        oldest_pending_named_at=oldest, pending_by_reason=reasons)

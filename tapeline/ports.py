"""The ports the processors depend on: small typing Protocols, one per outside system.

A processor is handed its adapters (built in one place, `cli/wiring.py` `build_processor`) and
calls them only through these shapes; which adapter stands behind each:

| port            | adapter                                   | what stands behind it          |
|-----------------|-------------------------------------------|--------------------------------|
| `Clock`         | `tapeline.clock.SystemClock`              | the machine's clock, uuid4 ids |
| `EventLog`      | `tapeline.kafka.KafkaEventLog`            | Kafka (confluent-kafka)        |
| `AssignedReader`| `tapeline.kafka.KafkaAssignedReader`      | an assign-only Kafka consumer  |
| `Reader`        | `tapeline.kafka.KafkaReader`              | a Kafka consumer               |
| `Writer`        | `tapeline.kafka.KafkaWriter`              | a transactional Kafka producer |
| `JobStore`      | `tapeline.postgres.PostgresJobStore`      | PostgreSQL, named queries only |
| `ObjectStorage` | `tapeline.objectstore.ObjectStore`        | S3 (boto3)                     |
| `MediaTool`     | `processors.media.FfmpegTool`             | ffprobe and ffmpeg processes   |

Records, positions and errors are this module's own (`Record`, `PartitionEnd`, `ReadError`,
`Offset`, `EventLogError`, `TransactionMustAbort`, `WriterFenced`, `LockTimeout`): the processors
import no client library (an import contract in pyproject.toml holds that), so no client type
crosses a port. The projector (`projections/projector.py`) reads through
`EventLog.assigned_reader`: records as `LogRecord` (the client's own record object, read through
these methods, not copied), a partition's end as `PartitionEnd`, an error as `ReadError`. Each Protocol lists only the methods a processor calls. They are `runtime_checkable` so a unit test
can check that each adapter has them (tests/unit/test_ports.py); that checks names, not signatures.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, NamedTuple, Protocol, runtime_checkable

from tapeline.clock import Clock, system_clock

if TYPE_CHECKING:
    from domain.policy.cleanup import MultipartUpload, StoredObject

Partition = tuple[str, int]
"""(topic, partition) of the event log."""


class Offset(NamedTuple):
    """A consumer position to commit: the next offset to read of `topic[partition]`."""

    topic: str
    partition: int
    offset: int


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class Record:
    """One record read from the event log. `timestamp_ms`: the broker's timestamp, milliseconds since
    the epoch (LogAppendTime on every topic the projections read, so one clock)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]] | None
    timestamp_ms: int

    @property
    def broker_time(self) -> datetime:
        """`timestamp_ms` as an aware UTC datetime, exact to the millisecond (a float division was
        off by microseconds after about 2112; the native engine is exact)."""
        return _EPOCH + timedelta(milliseconds=self.timestamp_ms)

    @property
    def where(self) -> dict[str, Any]:
        """`{"topic", "partition", "offset"}` of the record (log scopes, error messages)."""
        return {"topic": self.topic, "partition": self.partition, "offset": self.offset}

    def next_offset(self) -> Offset:
        """The position past this record (what a transaction commits once it is handled)."""
        return Offset(self.topic, self.partition, self.offset + 1)


class LogRecord(Protocol):
    """One committed record as the projections read it: the adapter's own record object, read only
    through these methods (not copied into one of ours: the fold it goes to, shared with the replay,
    takes tens of thousands a second, docs/benchmarks.md)."""

    def topic(self) -> str: ...

    def partition(self) -> int: ...

    def offset(self) -> int: ...

    def key(self) -> bytes | None: ...

    def value(self) -> bytes | None: ...

    def headers(self) -> list[tuple[str, bytes | None]] | None: ...

    def timestamp(self) -> tuple[int, int]:
        """(timestamp type, milliseconds since the epoch): the broker's time (LogAppendTime on every
        topic the projections read, so one clock); `broker_time` reads it."""
        ...


def broker_time(record: LogRecord) -> datetime:
    """The record's broker timestamp as an aware UTC datetime, exact to the millisecond
    (`fromtimestamp(millis / 1000.0)` was off by microseconds after about 2112, where the float's
    resolution passes half a microsecond; the native engine is exact)."""
    return _EPOCH + timedelta(milliseconds=record.timestamp()[1])


@dataclass(frozen=True)
class PartitionEnd:
    """A reader reached the end of `topic[partition]`: nothing more is waiting there now (only from a
    reader opened with `enable.partition.eof`); `offset` is the position there (the next offset a
    record would have)."""

    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class ReadError:
    """A reader reported an error instead of a record (`fatal`: the reader cannot go on)."""

    reason: str
    fatal: bool


@runtime_checkable
class AssignedReader(Protocol):
    """A reader of committed records assigned explicit partitions at explicit offsets, outside any
    consumer group's commits (the projector keeps its positions in PostgreSQL). Reports each
    partition's end (`PartitionEnd`). Not thread-safe."""

    def assign(self, positions: list[tuple[str, int, int | None]]) -> None:
        """Read exactly these (topic, partition, next offset) from now on; an offset of None is the
        partition's first record still in the log."""
        ...

    def poll(self, timeout_s: float) -> LogRecord | PartitionEnd | ReadError | None:
        """The next record, partition end or error, or None when nothing arrived in `timeout_s`."""
        ...

    def consume(self, max_records: int, timeout_s: float) -> list[LogRecord | PartitionEnd | ReadError]:
        """Up to `max_records` records, partition ends and errors; returns when that many arrived or
        `timeout_s` passed (0: only what has already arrived)."""
        ...

    def records_behind(self) -> int:
        """Records between the reader's position and the end of each assigned partition, summed, from
        the client's cached end offsets (approximate: transaction markers count)."""
        ...

    def close(self) -> None:
        ...

class LockTimeout(Exception):
    """A `JobStore` operation waited for a lock longer than the transaction's lock timeout allows."""


class EventLogError(Exception):
    """A call on the event log failed; the message is the client's. `retriable`: the same call may
    succeed if made again (a transaction's commit). Deliberately not a `TapelineError`: it is no
    error class of a job (an attempt that meets it fails as `unknown`)."""

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable


class TransactionMustAbort(EventLogError):
    """The writer's open transaction cannot commit any more: abort it, then it may begin another."""


class WriterStuck(EventLogError):
    """A call on the writer did not return within its timeout plus a grace (a client bug: librdkafka
    issues #5456 and #5511, `send_offsets_to_transaction` waiting for ever on a group coordinator
    that died). The call still runs, so this writer can neither commit nor abort: abandon it and
    make a new one; its open transaction is aborted by the coordinator after the transaction
    timeout, or at once when a writer with the same transactional id is initialised."""


class WriterFenced(EventLogError):
    """A newer writer with the same transactional id took over (or the writer hit a fatal error):
    this writer can never write again."""


class WriterBroken(WriterFenced):
    """The client declared the writer unusable with a fatal error that is no newer owner's fence
    (librdkafka answers an abort that follows a record's timeout with a fatal INVALID_TXN_STATE:
    issues #3297, #4849). Like a fence it stops the writer; unlike a fence, its owner may replace
    it, but only after a caught-up projection shows it still owns the transactional id, since the
    new writer fences whatever else holds that id."""


@runtime_checkable
class Reader(Protocol):
    """A consumer of the event log in one group (from `EventLog.consumer`). Not thread-safe. Every
    method but `poll` and `close` raises `EventLogError` when the client refuses the call (e.g. a
    partition no longer assigned)."""

    def subscribe(self, topics: list[str], on_assign: Callable[[list[Partition]], None] | None = None,
                  on_revoke: Callable[[list[Partition]], None] | None = None,
                  on_lost: Callable[[list[Partition]], None] | None = None) -> None:
        """Join the group on `topics`; the callbacks get the partitions assigned, revoked or lost (they
        run inside `poll`)."""
        ...

    def unsubscribe(self) -> None:
        """Leave the group (completes while the caller goes on polling)."""
        ...

    def poll(self, timeout_s: float) -> Record | PartitionEnd | ReadError | None:
        """The next record, a partition's end, an error, or None when nothing arrived in `timeout_s`."""
        ...

    def seek(self, topic: str, partition: int, offset: int) -> None:
        """Read `topic[partition]` from `offset` next."""
        ...

    def pause(self, partitions: list[Partition]) -> None:
        """Stop fetching `partitions` (what was prefetched there is dropped)."""
        ...

    def resume(self, partitions: list[Partition]) -> None:
        """Fetch `partitions` again, from the position after the last record returned."""
        ...

    def assignment(self) -> list[Partition]:
        """The partitions assigned to this reader now."""
        ...

    def commit(self, offsets: list[Offset]) -> None:
        """Commit `offsets` for the group now (synchronous, outside any transaction)."""
        ...

    def group_metadata(self) -> Any:
        """The group's metadata, opaque: what `Writer.send_offsets` needs."""
        ...

    def close(self) -> None:
        """Leave the group and release the client."""
        ...


@runtime_checkable
class Writer(Protocol):
    """A transactional writer of the event log (from `EventLog.transactional_producer`), fenced by its
    transactional id. Calls raise `WriterFenced` (stop: never write again), `TransactionMustAbort`
    (abort, then begin again) or another `EventLogError` (`retriable` says whether to repeat it)."""

    def begin_transaction(self) -> None:
        ...

    def produce(self, topic: str, key: bytes, value: bytes, partition: int,
                on_delivery: Callable[[str, int, int], None] | None = None) -> None:
        """Queue one record for `topic[partition]` in the open transaction; `on_delivery(topic,
        partition, offset)` runs once the broker stored it (inside `flush`, `poll` or a commit)."""
        ...

    def flush(self, timeout_s: float) -> int:
        """Send what is queued and wait up to `timeout_s` seconds; the number of records still queued."""
        ...

    def send_offsets(self, offsets: list[Offset], group_metadata: Any, timeout_s: float) -> None:
        """Add a reader's `offsets` (its `group_metadata`) to the open transaction."""
        ...

    def commit_transaction(self, timeout_s: float) -> None:
        ...

    def abort_transaction(self, timeout_s: float) -> None:
        ...

    def poll(self, timeout_s: float) -> None:
        """Serve delivery reports (`on_delivery`) that are ready, waiting up to `timeout_s` seconds."""
        ...


__all__ = ["AssignedReader", "Clock", "EventLog", "EventLogError", "JobStore", "LockTimeout", "LogRecord", "MediaTool", "ObjectStorage", "Offset", "Partition",
           "PartitionEnd", "ReadError", "Reader", "Record", "TransactionMustAbort", "Writer", "WriterFenced",
           "broker_time", "system_clock"]

@runtime_checkable
class EventLog(Protocol):
    """What processors need from the event log (Kafka): transactional writers, consumers, partition
    counts and last stable offsets. Records are keyed by job id; the partition is chosen by the caller
    (`tapeline.kafka.partition_for`)."""

    def transactional_producer(self, transactional_id: str) -> Writer:
        """A transactional writer for `transactional_id`, its transactions initialised: this fences
        any older writer with the same id (and aborts a transaction it left open). Raises
        `ServiceUnavailable` when the broker cannot be reached in time."""
        ...

    def consumer(self, group_id: str, **overrides: Any) -> Reader:
        """A new reader in group `group_id`: reads committed records only, never commits on its own
        (offsets commit inside the caller's transactions), starts from the earliest offset when the
        group has none; `overrides` are client settings (e.g. `fetch.wait.max.ms`). The caller
        subscribes it and closes it."""
        ...

    def partition_count(self, topic: str) -> int:
        """The number of partitions of `topic` (cached per topic). Raises `ServiceUnavailable` when
        the topic does not exist, `EventLogError` when the broker refuses."""
        ...

    def last_stable_offset(self, topic: str, partition: int) -> int:
        """The offset a read_committed reader of `topic[partition]` can reach now (the LSO: past the
        last committed record, before any open transaction). Raises `EventLogError` when the broker
        does not answer."""
        ...

    def assigned_reader(self, group_id: str, **overrides: Any) -> AssignedReader:
        """A new reader that is only ever assigned partitions (`group_id` names the client; it never
        joins or commits): read_committed, partition ends reported; `overrides` are client settings."""
        ...

    def cluster_id(self) -> str:
        """The id of the cluster holding the log (offsets from another cluster mean nothing here)."""
        ...

    def close(self) -> None:
        """Release the clients this adapter opened itself."""
        ...


@runtime_checkable
class JobStore(Protocol):
    """The job-state reader and the named operations on PostgreSQL. Callers name an operation (a
    `-- name:` block of projections/sql/*.sql); they never hold SQL. Every call runs in autocommit
    on the store's own session (each read sees the latest projection; a session advisory lock
    taken through it lives as long as the store), or, inside `transaction()`, in that one
    transaction. Rows are dicts keyed by column name. A lock wait past the transaction's lock timeout
    raises `LockTimeout`; an unreachable server on first use, and a session lost under a call,
    raise `ServiceUnavailable` (the next call opens a new session), except on a store that holds a
    leader lock, where a lost session raises the adapter's own error (PostgreSQL:
    `psycopg.OperationalError`) from then on: the lock went with it."""

    def open(self) -> None:
        """Open the session now if it is not open (else the first call opens it). Raises
        `ServiceUnavailable` when the server does not answer."""
        ...

    def all(self, name: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Every row of the named query."""
        ...

    def one(self, name: str, params: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """The first row of the named query, or None."""
        ...

    def run(self, name: str, params: dict[str, Any] | None = None) -> None:
        """Run the named statement, rows (if any) ignored."""
        ...

    def transaction(self) -> ContextManager[None]:
        """A block whose operations commit together when it ends, or roll back when it raises (the
        exception goes on). Session locks taken inside stay; transaction locks end with it."""
        ...

    def wait_applied(self, topic: str, partition: int, target: int, timeout_s: float,
                     stop: threading.Event | None = None) -> None:
        """Block until the projection has applied `topic[partition]` up to offset `target`. Raises
        `ServiceUnavailable` after `timeout_s` seconds, or at once when `stop` is set."""
        ...

    def close(self) -> None:
        """Close the store's session (and with it any lock it holds)."""
        ...


@runtime_checkable
class ObjectStorage(Protocol):
    """The bucket, as far as the processors use it (intake: `head`, `download`; the workers: the
    reads and writes of objects; an operator's review: `delete`; the watchdog's cleanup: listings and
    removals). Every method raises `StorageError` on a storage failure."""

    def public_url(self, key: str) -> str:
        """The plain HTTP URL of a published object (readable anonymously)."""
        ...

    def upload_file(self, path: Path, key: str, content_type: str) -> tuple[str, int]:
        """Store the local file `path` as `key`; (hex sha256, bytes)."""
        ...

    def get_bytes(self, key: str) -> bytes:
        """The whole object `key`."""
        ...

    def put_if_absent(self, key: str, body: bytes, content_type: str, metadata: dict[str, str] | None = None) -> bool:
        """Store `body` as `key` unless it exists (a conditional write); whether it was stored."""
        ...

    def put_file_if_absent(self, path: Path, key: str, content_type: str, sha256: str,
                           metadata: dict[str, str] | None = None,
                           on_bytes: Callable[[int], None] | None = None) -> bool:
        """Store the file `path` (hex `sha256`) as `key` unless it exists, streaming; whether it was
        stored (False: the same bytes were there). Raises `OutputConflict` for different bytes."""
        ...

    def stored_mismatch(self, key: str, size: int, sha256: str) -> str | None:
        """Read `key` back: None when it has `size` bytes and hex `sha256`, else what differs."""
        ...

    def object_found(self, key: str) -> dict[str, Any] | None:
        """What is stored at `key` (`{"key", "sha256", "size_bytes", "written_at"}`: hex sha256 of the
        bytes read back, bytes, its Last-Modified as a UTC datetime), or None when it is gone or
        cannot be read. What an `OutputConflict` names."""
        ...

    def create_exclusive(self, key: str, body: bytes, content_type: str = "application/json") -> bytes | None:
        """Create `key` with `body` only when absent: None when created, else the existing object's body."""
        ...

    def head_metadata(self, key: str) -> dict[str, str] | None:
        """The user metadata of `key`, or None when there is no such object."""
        ...

    def head(self, key: str) -> tuple[int, dict[str, str]] | None:
        """(size in bytes, user metadata) of `key`, or None when there is no such object."""
        ...

    def download(self, key: str, path: Path) -> None:
        """Write the object `key` to the local file `path`. Raises `ObjectMissing` when there is no
        such object, `StorageError` for any other storage failure."""
        ...

    def delete(self, key: str) -> None:
        """Remove one object (no error when it is absent)."""
        ...

    def list_page(self, prefix: str, token: str | None, max_keys: int) -> tuple[list["StoredObject"], str | None]:
        """Up to `max_keys` objects under `prefix` from `token` on, and the next page's token (None at the end)."""
        ...

    def list_multipart(self, max_uploads: int) -> list["MultipartUpload"]:
        """Up to `max_uploads` unfinished multipart uploads."""
        ...

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Abort one multipart upload."""
        ...

    def delete_many(self, keys: list[str]) -> None:
        """Delete up to 1000 objects in one request."""
        ...

    def withdraw_published(self, keys: list[str]) -> None:
        """Delete up to 1000 published objects (every key under `published/`) in one request: the
        one way published bytes are ever removed (domain/policy/withdrawal.py). Raises
        `StorageError` for a key outside `published/` or a failed delete."""
        ...

    def total_bytes(self) -> int:
        """The bucket's total size in bytes, listed now (uncached; `StorageGauge` caches it)."""
        ...


@runtime_checkable
class MediaTool(Protocol):
    """The media tool (ffprobe and ffmpeg run as child processes on local files): intake's probe, the
    transcode worker's probe, seek point, encode and output check."""

    def inspect_source(self, path: Path, *, count_packets: bool = True, timeout_s: float = 300.0) -> Any:
        """Probe the local source file `path`: a `domain.policy.source_probe.Probe` (the `SourceMedia`
        summary and the stream indexes). Refuses playlists and containers off the allow-list; with
        `count_packets` reads every packet to find a source cut short of its index. Raises
        `InvalidInput` (unreadable, truncated, a playlist), `UnsupportedMedia` (no video),
        `LimitsExceeded` (probing ran longer than `timeout_s` seconds)."""
        ...

    def keyframe_before(self, path: Path, time_s: float, stream: int | None = None,
                        timeout_s: float = 60.0) -> float | None:
        """Presentation time (s) of the video keyframe at or before `time_s` in `path` (`stream`: an
        absolute stream index, default the first video stream); None when it cannot be told."""
        ...

    def run_ffmpeg(self, args: list[str], *, on_progress: Callable[[Any], None] | None = None,
                   on_tick: Callable[[], None] | None = None, should_stop: Callable[[], bool] | None = None,
                   tick_s: float = 1.0, timeout_s: float | None = None, limits: Any = None,
                   temp_dir: Path | None = None, on_sample: Callable[[Any], None] | None = None) -> Any:
        """Run ffmpeg with `args` (a `-progress pipe:1` command): `on_progress` gets each
        `processors.media.Progress`, `on_tick` runs every `tick_s` seconds (just before it,
        `on_sample` gets the process's `domain.events.ToolState`), `should_stop` or
        `timeout_s` seconds of wall clock stop it. With `limits` (a
        `domain.policy.ffmpeg_limits.FfmpegLimits`) ffmpeg runs under them, `temp_dir` (the
        attempt's temp directory) measured against the temp-disk limit. Returns a
        `processors.media.FfmpegResult` (classify it with `processors.media.ffmpeg_failure`); never
        raises for ffmpeg's own failure."""
        ...

    def verify_outputs(self, out_dir: Path, ladder: list[Any], media: Any, has_audio: bool,
                       tolerance_s: float) -> None:
        """Check an encode in `out_dir` against the `ladder` and the source's `SourceMedia` (`media`):
        every playlist exists, ends and lasts as long as promised within `tolerance_s`. Raises
        `OutputMismatch` otherwise."""
        ...

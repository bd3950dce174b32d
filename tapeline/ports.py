"""The ports the processors depend on: small typing Protocols, one per outside system.

A processor is handed its adapters (built in one place, `tapeline/wiring.py` `build_processor`) and
calls them only through these shapes; which adapter stands behind each:

| port            | adapter                                   | what stands behind it          |
|-----------------|-------------------------------------------|--------------------------------|
| `Clock`         | `tapeline.clock.SystemClock`              | the machine's clock, uuid4 ids |
| `EventLog`      | `tapeline.kafka.KafkaEventLog`            | Kafka (confluent-kafka)        |
| `AssignedReader`| `tapeline.kafka.KafkaAssignedReader`      | an assign-only Kafka consumer  |
| `JobStore`      | `tapeline.postgres.PostgresJobStore`      | PostgreSQL, named queries only |
| `ObjectStorage` | `tapeline.objectstore.ObjectStore`        | S3 (boto3)                     |
| `MediaTool`     | `processors.media.FfmpegTool`             | ffprobe and ffmpeg processes   |

The projector (`projections/projector.py`) reads the log through `EventLog.assigned_reader` too:
records as `LogRecord`, a partition's end as `PartitionEnd`, an error as `ReadError`.

Each Protocol lists only the methods a processor calls. They are `runtime_checkable` so a unit test
can check that each adapter has them (tests/unit/test_ports.py); that checks names, not signatures.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

from tapeline.clock import Clock, system_clock

if TYPE_CHECKING:
    from domain.policy.cleanup import MultipartUpload, StoredObject

# The event log's writers and readers are the client library's own objects (confluent-kafka's
# `Producer` and `Consumer`: `begin_transaction`, `produce`, `poll`, `seek`, ...); the port does not
# wrap them, and does not import the library either (an import contract in pyproject.toml holds that).
Writer = Any
Reader = Any

__all__ = ["AssignedReader", "Clock", "EventLog", "JobStore", "LogRecord", "MediaTool", "ObjectStorage", "PartitionEnd",
           "ReadError", "broker_time", "system_clock"]

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


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
    """A reader reached the end of `topic[partition]`: nothing more is waiting there now; `offset` is
    the position there (the next offset a record would have)."""

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
        """A new consumer in group `group_id`: reads committed records only, never commits on its own
        (offsets commit inside the caller's transactions), starts from the earliest offset when the
        group has none; `overrides` are client settings (e.g. `fetch.wait.max.ms`). The caller
        subscribes it and closes it."""
        ...

    def partition_count(self, topic: str) -> int:
        """The number of partitions of `topic` (cached per topic). Raises `ServiceUnavailable` when
        the topic does not exist."""
        ...

    def last_stable_offset(self, topic: str, partition: int) -> int:
        """The offset a read_committed reader of `topic[partition]` can reach now (the LSO: past the
        last committed record, before any open transaction)."""
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
    taken through it lives as long as the store). Rows are dicts keyed by column name. A lost
    connection raises `psycopg.OperationalError`; an unreachable server on first use raises
    `ServiceUnavailable`."""

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
        """Write the object `key` to the local file `path`."""
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

    def total_bytes(self) -> int:
        """The bucket's total size in bytes, listed now (uncached; `StorageGauge` caches it)."""
        ...


@runtime_checkable
class MediaTool(Protocol):
    """The media tool (ffprobe and ffmpeg run as child processes on local files): intake's probe, the
    transcode worker's probe, seek point, encode and output check."""

    def inspect_source(self, path: Path, *, count_packets: bool = True, timeout_s: float = 300.0) -> Any:
        """Probe the local source file `path`: a `processors.source_probe.Probe` (the `SourceMedia`
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
                   tick_s: float = 1.0, timeout_s: float | None = None) -> Any:
        """Run ffmpeg with `args` (a `-progress pipe:1` command): `on_progress` gets each
        `processors.media.Progress`, `on_tick` runs every `tick_s` seconds, `should_stop` or
        `timeout_s` seconds of wall clock stop it. Returns a `processors.media.FfmpegResult`
        (classify it with `processors.media.ffmpeg_failure`); never raises for ffmpeg's own failure."""
        ...

    def verify_outputs(self, out_dir: Path, ladder: list[Any], media: Any, has_audio: bool,
                       tolerance_s: float) -> None:
        """Check an encode in `out_dir` against the `ladder` and the source's `SourceMedia` (`media`):
        every playlist exists, ends and lasts as long as promised within `tolerance_s`. Raises
        `OutputMismatch` otherwise."""
        ...

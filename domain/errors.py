"""The exception tree. Every error Tapeline raises on purpose is a `TapelineError`.

Each subclass's docstring is its default message. `error_class` names the class of the error table
(`domain/error_classes.py`) that a failure of this kind is recorded as (`region_fenced` aside: an
intake refusal, never an attempt's failure); `tests/unit/test_error_classes.py` checks it.

Outside the tree on purpose, each caught where it is raised or one layer up and turned into a
`TapelineError`, a retry or an answer: the ports' transport errors (`tapeline/ports.py`:
`EventLogError` and its subclasses, `LockTimeout`), which the runtime maps to fenced, abort or
retry; control-flow signals that never leave their module (`processors/worker.py` `Yielded`,
`processors/publish.py` `NeedsReviewStop`, `producers/intake_body.py` `BodyTooLarge` and
`BodyTooSlow`, `regions/media_copy.py` `CopyFailed`); file and registry errors that subclass the
builtin a caller expects (`domain/lifecycle_data.py` `LifecycleFileError` is a `ValueError`,
`domain/pipeline.py` `UnknownStage` a `KeyError`); and the local home's `StackError`
(`tapeline/home.py`, a `RuntimeError`: a service that did not start, with what to do).
"""

from __future__ import annotations

from domain.error_classes import ERROR_CLASSES


class TapelineError(Exception):
    """Tapeline failed."""

    error_class = "unknown"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigurationError(TapelineError):
    """A setting or a local service is missing or wrong."""


class AccessRefused(Exception):
    """A service refused this client's credentials or certificates: retrying with the same settings
    cannot help. A mixin of the three refusals below; `service` names the service ("kafka",
    "postgresql", "s3") and `kind` the check ("tls", "authentication", "authorisation").
    `tapeline run` holds any of them the same way (cli/run_command.py `refused`)."""

    service = ""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class KafkaAccessRefused(AccessRefused, ConfigurationError):
    """Kafka refused this client: a wrong or missing certificate, password or ACL.

    `kind` says which: "tls" (the TLS handshake failed: an untrusted or missing certificate),
    "authentication" (SASL: unknown user or wrong password) or "authorisation" (an ACL does not let
    this principal use the topic, group or transactional id). Retrying cannot help: the process
    stops with it (tapeline/kafka.py `access_refusal` classifies librdkafka's errors).
    """

    service = "kafka"

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(kind, f"Kafka refused this client ({kind}): {message}")


class ServiceUnavailable(TapelineError):
    """A service (Kafka, PostgreSQL, S3) did not answer."""

    error_class = "broker_transient"


class DatabaseAccessRefused(AccessRefused, ServiceUnavailable):
    """PostgreSQL refused this client: a TLS failure (an untrusted or missing certificate, a name that
    does not match, a server without TLS where sslmode requires it) or an authentication failure (a
    wrong password, no pg_hba.conf entry for this user or address).

    `kind` says which: "tls" or "authentication". Retrying cannot help. It stays a
    `ServiceUnavailable` for the callers that only report whether PostgreSQL answers (`stack
    status`, the read API); `tapeline run` holds it like `KafkaAccessRefused`: `/health/ready` 503
    with the reason, no restart loop (tapeline/postgres.py `connect` classifies libpq's messages).
    """

    service = "postgresql"


class SchemaError(TapelineError):
    """An event does not match its schema."""


class DecodeError(TapelineError):
    """A record could not be decoded.

    Carries where the record came from (`topic`, `partition`, `offset`) so a dead letter can name it.
    """

    error_class = "invalid_input"

    def __init__(self, message: str, *, topic: str | None = None, partition: int | None = None,
                 offset: int | None = None) -> None:
        where = f" at {topic}[{partition}]@{offset}" if topic is not None else ""
        super().__init__(f"{message}{where}")
        self.topic, self.partition, self.offset = topic, partition, offset


class MediaError(TapelineError):
    """The media could not be processed."""

    error_class = "invalid_input"


class InvalidInput(MediaError):
    """The upload is not a readable video."""

    error_class = "invalid_input"


class UnsupportedMedia(MediaError):
    """The upload is a media file Tapeline does not process."""

    error_class = "unsupported_media"


class LimitsExceeded(MediaError):
    """The upload is larger than a configured limit."""

    error_class = "limits_exceeded"


class TranscodeFailed(MediaError):
    """ffmpeg failed or produced output that does not match the source's probe."""

    error_class = "unknown"


class OutputMismatch(TranscodeFailed):
    """The encode finished but does not match the source's probe (a post-encode check failed).

    The same source and command give the same output, so another attempt would fail the same way:
    recorded as `unsupported_media` (not retryable, `JobFailed` at once) with the check's reason.
    """

    error_class = "unsupported_media"


class StorageError(TapelineError):
    """Object storage failed."""

    error_class = "storage_transient"


class StorageAccessRefused(AccessRefused, StorageError):
    """The S3 endpoint refused this client's credentials or TLS: an unknown access key, a wrong
    secret, an expired token, no credentials anywhere in the default chain, or an endpoint whose
    certificate is not trusted (or that does not speak TLS where the URL says https).

    `kind` says which: "tls" or "authentication". Retrying cannot help. A missing permission
    (AccessDenied) is not one: a role may lawfully lack the permission of the call that met it
    (tapeline/objectstore.py `access_refusal` classifies; `tapeline run` holds it like
    `KafkaAccessRefused`)."""

    service = "s3"


class ObjectMissing(StorageError):
    """The object asked for does not exist (the store answered 404 / `NoSuchKey`). Told apart by
    type, never by the message: a message holds the key, and a key may hold "404"."""


class OutputConflict(StorageError):
    """A key Tapeline writes once already holds other bytes (class `output_conflict`: not retried,
    dead-lettered at once for an operator).

    `in_the_way`: what the store holds at the key, `{"key", "sha256", "size_bytes", "written_at"}`
    (`written_at` a UTC datetime or None), when the writer read it back; the failure records it in
    `AttemptFailed` and `JobDeadLettered` for the diagnosis. Use `OutputConflict.found` to build one."""

    error_class = "output_conflict"

    def __init__(self, message: str | None = None, *, in_the_way: dict | None = None) -> None:
        super().__init__(message)
        self.in_the_way = in_the_way

    @classmethod
    def found(cls, key: str, differs: str, in_the_way: dict | None) -> "OutputConflict":
        """The conflict at `key`: `differs` says how the stored object differs from the bytes sent;
        the message ends with what a retry would do (the error table's words, `domain/error_classes.py`)."""
        return cls(f"{key} already exists with different content ({differs}): another job or deployment wrote it; "
                   f"it is never overwritten, and {ERROR_CLASSES[cls.error_class].on_retry}", in_the_way=in_the_way)


class Fenced(TapelineError):
    """A newer attempt owns this job: this worker's producer was fenced and must stop."""


class QuotaExceeded(TapelineError):
    """The submitter's own quota is used up (terminal: `JobRejected`, never retried)."""

    error_class = "quota_exceeded"


class SubmitError(TapelineError):
    """The file cannot be submitted."""


class RegionFenced(TapelineError):
    """This region does not take uploads: another region holds the job history (docs/regions.md
    "What clients see"). `active_region` is the region that does, `upload_to` its intake's
    `POST /uploads` URL (None when unknown)."""

    error_class = "region_fenced"

    def __init__(self, message: str, *, active_region: str, upload_to: str | None) -> None:
        super().__init__(message)
        self.active_region, self.upload_to = active_region, upload_to


class ProviderError(TapelineError):
    """A publish provider refused or failed the call (429 or 5xx, or it did not answer)."""

    error_class = "provider_throttled"

    def __init__(self, message: str | None = None, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # the provider's cooldown (Retry-After), seconds, when it said
        self.http_status: int | None = None  # the provider's answer; None when it did not answer


class ProviderDeferred(ProviderError):
    """The provider was not called: its quota window is full, its breaker is open, another attempt
    is its half-open probe, or every in-flight slot is taken. The attempt is retried at `until` and
    does not use up an attempt (`PublishDeferred`, processors/provider_guard.py)."""

    def __init__(self, message: str, *, provider: str, wait: str, until, retry_after_s: float,
                 window: str | None = None, window_s: float | None = None, limit: int | None = None,
                 used: int | None = None) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.sent = False  # nothing reached the provider
        self.provider, self.wait, self.until = provider, wait, until
        self.window, self.window_s, self.limit, self.used = window, window_s, limit, used


class ProviderLookupFailed(ProviderError):
    """The provider could not say whether a post exists: nothing may be posted blindly."""


class TranscodeTimeout(TapelineError):
    """ffmpeg ran longer than its wall-clock limit."""

    error_class = "timeout"


# Refusals of operator actions (processors/operator.py raises them; the CLI and the API answer them).
class NotReplayable(TapelineError):
    """The dead letter cannot be replayed (unknown id, or an undecodable record)."""

    error_class = "invalid_input"


class NoSuchDeadLetter(NotReplayable):
    """No dead letter with that id in the projections (the CLI exits 2 for it: a usage error)."""


class NoSuchJob(TapelineError):
    """No such job in the projections (not submitted, or intake has not caught up)."""

    error_class = "invalid_input"


class NotCancellable(TapelineError):
    """The job has already ended; nothing reopens or cancels an ended job."""

    error_class = "invalid_input"


class WebhookRefused(TapelineError):
    """The webhook endpoint cannot be registered or reached: its URL is malformed or resolves to an
    address that is not allowed (private, loopback, link-local, ...; see `domain/policy/webhooks.py`)."""

    error_class = "invalid_input"

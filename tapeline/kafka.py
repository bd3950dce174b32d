"""Kafka client factory: every non-default client setting in one place, each with its reason.

Consumers read committed data only; producers of processors are transactional; the intake producer
is idempotent. Records are produced to an explicit partition computed by `partition_for`, which is
Kafka's default (murmur2) partitioner, so Java clients and our own lookups agree on a job's partition.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from domain.errors import ConfigurationError, KafkaAccessRefused, ServiceUnavailable
from domain.policy.kafka_access import OPERATOR
from tapeline.home import host_port, port_open
from tapeline.partitioner import murmur2, partition_for  # noqa: F401 (the partitioner's home is client-free)
from tapeline.ports import (EventLogError, Offset, Partition, PartitionEnd, ReadError, Record, TransactionMustAbort,
                            WriterBroken, WriterFenced, WriterStuck, broker_time)  # noqa: F401 - broker_time: `kafka.broker_time` as before
from tapeline.settings import Settings


SEND_OFFSETS_GRACE_S = 5.0
"""Seconds `KafkaWriter.send_offsets` waits past the call's own timeout before it calls the writer stuck."""
RESUME_TIMEOUT_S = 10.0
"""Seconds `KafkaWriter.begin_transaction` waits for an unfinished commit or abort it resumes."""


ACCESS_ERRORS = {
    KafkaError._SSL: "tls",
    KafkaError._AUTHENTICATION: "authentication",
    KafkaError.SASL_AUTHENTICATION_FAILED: "authentication",
    KafkaError.ILLEGAL_SASL_STATE: "authentication",
    KafkaError.UNSUPPORTED_SASL_MECHANISM: "authentication",
    KafkaError.TOPIC_AUTHORIZATION_FAILED: "authorisation",
    KafkaError.GROUP_AUTHORIZATION_FAILED: "authorisation",
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: "authorisation",
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: "authorisation",
}
"""librdkafka's error codes that mean the cluster refused this client, and which kind of refusal
(`KafkaAccessRefused.kind`): the TLS handshake, SASL authentication, or an ACL. None is retriable:
the same certificate, password or ACL is refused again."""
SECURED_KEYS = ("security.protocol", "sasl.mechanism", "sasl.username", "sasl.password", "ssl.ca.location",
                "ssl.certificate.location", "ssl.key.location", "ssl.key.password", "bootstrap.servers")
"""librdkafka settings `client_config` derives from the settings; `kafka_extra_config` may not set them."""


def principal(settings: Settings) -> tuple[str | None, SecretStr | None]:
    """`(username, password)` of the principal this process uses: the entry of its role
    (`settings.kafka_role`, unset: "operator") in `kafka_credentials_file` when it has one, else
    `kafka_sasl_username` / `kafka_sasl_password` (both None when neither is set).

    Raises `ConfigurationError` when the credentials file cannot be read or is not
    `{"<role>": {"username": str, "password": str}, ...}`.
    """
    role = settings.kafka_role or OPERATOR
    if settings.kafka_credentials_file is not None:
        path = Path(settings.kafka_credentials_file)
        try:
            entries = json.loads(path.read_text())
            entry = entries.get(role) if isinstance(entries, dict) else None
            if entry is not None:
                return str(entry["username"]), SecretStr(str(entry["password"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigurationError(f"TAPELINE_KAFKA_CREDENTIALS_FILE {path} is not readable JSON of "
                                     f"{{role: {{username, password}}}} ({type(exc).__name__}: {exc})") from exc
    return settings.kafka_sasl_username, settings.kafka_sasl_password


def client_config(settings: Settings) -> dict[str, Any]:
    """The librdkafka settings every client gets: `bootstrap.servers`, the security settings
    (`security.protocol` and, as the protocol needs them, the SASL mechanism and this role's
    `principal`, the CA file, the client certificate and key), `kafka_extra_config`, and an
    `error_cb` that raises `KafkaAccessRefused` for a refusal (`access_refusal`), so a wrong
    certificate, password or ACL stops the call that polls instead of retrying unseen.

    Raises `ConfigurationError` for a SASL protocol without a principal (PLAIN and SCRAM need a user
    name and password), or an extra setting that overrides one of these (`SECURED_KEYS`).
    """
    protocol = settings.kafka_security_protocol
    config: dict[str, Any] = {"bootstrap.servers": settings.kafka_bootstrap_servers, "security.protocol": protocol,
                              "error_cb": raise_refusal}
    if protocol.startswith("SASL_"):
        config["sasl.mechanism"] = settings.kafka_sasl_mechanism
        username, password = principal(settings)
        if settings.kafka_sasl_mechanism != "OAUTHBEARER":
            if not username or password is None:
                raise ConfigurationError(f"TAPELINE_KAFKA_SECURITY_PROTOCOL={protocol} with "
                                         f"{settings.kafka_sasl_mechanism} needs a user name and password for role "
                                         f"{settings.kafka_role or OPERATOR!r}: set TAPELINE_KAFKA_SASL_USERNAME and "
                                         "TAPELINE_KAFKA_SASL_PASSWORD, or an entry in TAPELINE_KAFKA_CREDENTIALS_FILE")
            config["sasl.username"], config["sasl.password"] = username, password.get_secret_value()
    if protocol in ("SSL", "SASL_SSL"):
        for key, value in (("ssl.ca.location", settings.kafka_ssl_ca_location),
                           ("ssl.certificate.location", settings.kafka_ssl_certificate_location),
                           ("ssl.key.location", settings.kafka_ssl_key_location)):
            if value is not None:
                config[key] = str(value)
        if settings.kafka_ssl_key_password is not None:
            config["ssl.key.password"] = settings.kafka_ssl_key_password.get_secret_value()
    clashes = sorted(set(settings.kafka_extra_config) & set(SECURED_KEYS))
    if clashes:
        raise ConfigurationError(f"TAPELINE_KAFKA_EXTRA_CONFIG may not set {', '.join(clashes)}: use the settings "
                                 "named TAPELINE_KAFKA_* for them (docs/security.md)")
    config.update({key: value.get_secret_value() for key, value in settings.kafka_extra_config.items()})
    return config


def access_refusal(error: KafkaError | KafkaException | BaseException | None) -> KafkaAccessRefused | None:
    """`KafkaAccessRefused` when `error` (a librdkafka `KafkaError`, or an exception carrying one) is
    a refusal of `ACCESS_ERRORS`, else None. An SSL failure librdkafka reports as a transport error
    (`_TRANSPORT` "SSL handshake failed") counts as "tls"."""
    if isinstance(error, KafkaAccessRefused):
        return error
    if isinstance(error, BaseException):
        error = error.args[0] if error.args and isinstance(error.args[0], KafkaError) else None
    if not isinstance(error, KafkaError):
        return None
    kind = ACCESS_ERRORS.get(error.code())
    text = error.str()
    if kind is None and error.code() == KafkaError._TRANSPORT and "SSL handshake failed" in text:
        kind = "tls"
    return KafkaAccessRefused(kind, text) if kind else None


def raise_refusal(error: KafkaError) -> None:
    """librdkafka's `error_cb`: raise `KafkaAccessRefused` for a refusal (confluent-kafka re-raises an
    exception of a callback from the call that served it: `poll`, `flush`, `list_topics`, ...); other
    client errors are librdkafka's to retry, as before."""
    refusal = access_refusal(error)
    if refusal is not None:
        raise refusal


def served_refusal(client: Producer | Any) -> KafkaAccessRefused | None:
    """A refusal librdkafka queued for `client`'s `error_cb` but no call has served yet (a producer's or
    admin client's errors are served by `poll`): `poll(0)` once and return the `KafkaAccessRefused` it
    raised, else None. Not for consumers (their `poll` takes records)."""
    try:
        client.poll(0)
    except KafkaAccessRefused as refusal:
        return refusal
    except Exception:  # noqa: BLE001 - only a refusal is wanted here
        return None
    return None


def transport_refusal(settings: Settings, timeout_s: float = 3.0) -> KafkaAccessRefused | None:
    """Why a broker that accepts TCP connections closes this client's, when the client speaks no TLS
    or no SASL to a listener that wants them (librdkafka then reports only a transport failure, "connection
    closed by peer ... in state APIVERSION_QUERY"): a TLS handshake (certificate not checked: this only
    asks whether the port speaks TLS) to the first bootstrap address. Returns `KafkaAccessRefused`
    ("authentication": an unauthenticated client) when the port speaks TLS and this client's
    `security.protocol` is PLAINTEXT or SASL_PLAINTEXT, or is SSL without SASL (a SASL_SSL listener closes
    it after the handshake); else None."""
    import socket
    import ssl

    protocol = settings.kafka_security_protocol
    if protocol == "SASL_SSL":
        return None
    address = settings.kafka_bootstrap_servers.split(",")[0].strip()
    host, port = host_port(address, 9092)
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            with context.wrap_socket(raw, server_hostname=host):
                pass
    except (OSError, ssl.SSLError):
        return None  # no TLS there (or nothing): not this kind of refusal
    if protocol == "SSL":
        return KafkaAccessRefused("authentication", f"{address} closed the connection after TLS: it wants SASL "
                                  "credentials (an unauthenticated client; TAPELINE_KAFKA_SECURITY_PROTOCOL=SASL_SSL "
                                  "and a principal)")
    return KafkaAccessRefused("authentication", f"{address} speaks TLS but this client uses {protocol}: an "
                              "unauthenticated client, refused (set TAPELINE_KAFKA_SECURITY_PROTOCOL=SASL_SSL or SSL, "
                              "the CA and a principal: docs/security.md)")


def refusal_of(settings: Settings, exc: BaseException, client: Any = None) -> KafkaAccessRefused | None:
    """The `KafkaAccessRefused` behind `exc`, a failed call of `client` (a producer or admin client;
    not a consumer): `exc` itself classified (`access_refusal`), else a refusal queued for the client's
    `error_cb` (`served_refusal`), else, when nothing else says why, whether the listener wants TLS or
    SASL this client does not speak (`transport_refusal`); None when it is no refusal."""
    refusal = access_refusal(exc)
    if refusal is None and client is not None and not isinstance(client, Consumer):
        refusal = served_refusal(client)
    return refusal or transport_refusal(settings)


def consumer(settings: Settings, group_id: str, **overrides: Any) -> Consumer:
    """A consumer that reads committed records only and never commits on its own."""
    config = {
        **client_config(settings),
        "group.id": group_id,
        "isolation.level": "read_committed",  # never see aborted or open transactions (docs/design.md guarantee 2)
        "enable.auto.commit": False,  # offsets commit inside the processor's transaction
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",  # a new group starts from the beginning: nothing is skipped
        "partition.assignment.strategy": "cooperative-sticky",  # cheap rebalances when workers leave while busy
        # A dead worker's partitions move within seconds (the broker's minimum is lowered locally). A
        # killed process restarted at once waits this long too: the group keeps its old member until then.
        "session.timeout.ms": settings.kafka_session_timeout_ms,
        "heartbeat.interval.ms": 500,  # members learn of a rebalance (a worker leaving while busy) within 0.5 s, not 3 s
        "max.poll.interval.ms": 300_000,
    }
    config.update(overrides)
    return Consumer(config)


def transactional_producer(settings: Settings, transactional_id: str, *, init: bool = True,
                           init_timeout_s: float = 30.0) -> Producer:
    """A transactional producer; `init_transactions` fences any older producer with the same id.

    Raises `KafkaAccessRefused` when the cluster refuses this client (`access_refusal`,
    `transport_refusal`), `ServiceUnavailable` when the broker cannot be reached within
    `init_timeout_s` seconds.
    """
    producer = Producer({
        **client_config(settings),
        "transactional.id": transactional_id,
        "transaction.timeout.ms": settings.transaction_timeout_ms,  # well below the lease: a dead writer blocks readers briefly
        # The client gives up on a record before the coordinator gives up on the transaction, so an
        # election that outlasts it ends in a clean abort (then the writer tries again), not in the
        # coordinator's own timeout abort, which librdkafka learns of as a fatal INVALID_TXN_STATE
        # and which leaves the producer unusable (seen when a broker was killed mid-transaction).
        "message.timeout.ms": max(1000, settings.transaction_timeout_ms * 2 // 3),
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 2,  # lifecycle events are few and small: latency over batching
        "partitioner": "murmur2_random",  # same as Java clients and partition_for()
    })
    if init:
        try:
            # Connect first: librdkafka asks for a producer id only once the coordinator's connection is
            # up, and when it is not up yet it retries on a fixed 500 ms timer (rdkafka_idempotence.c,
            # state WAIT_TRANSPORT, "Coordinator not up"). A fresh producer lost that race for about one
            # init in seven here (0.50 s instead of 0.05 s); a claim pays it before AttemptStarted.
            producer.list_topics(timeout=init_timeout_s)
            producer.init_transactions(init_timeout_s)
        except KafkaException as exc:
            refusal = refusal_of(settings, exc, producer)
            if refusal is not None:
                raise refusal from exc
            raise ServiceUnavailable(f"init_transactions({transactional_id}) failed: {exc}") from exc
    return producer


def idempotent_producer(settings: Settings, **overrides: Any) -> Producer:
    """An idempotent (not transactional) producer for intake and the region records: no duplicates
    from its own retries. `overrides`: more librdkafka settings."""
    return Producer({
        **client_config(settings),
        "enable.idempotence": True,  # retries never duplicate a record
        "acks": "all",
        "partitioner": "murmur2_random",
        **overrides,
    })


def last_stable_offsets(client: Consumer, topic: str, partitions: list[int], timeout_s: float = 10.0) -> dict[int, int]:
    """The high offset a read_committed reader can reach, per partition (the last stable offset).

    `client` must be a read_committed consumer: the broker answers ListOffsets with the LSO then.
    """
    result = {}
    for partition in partitions:
        _, high = client.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout_s, cached=False)
        result[partition] = high
    return result


def partition_count(client: Consumer | Producer, topic: str, timeout_s: float = 10.0) -> int:
    """Number of partitions of `topic`. Raises `KafkaAccessRefused` when this principal may not describe
    it, `ServiceUnavailable` when the topic is missing."""
    deadline = time.monotonic() + timeout_s
    while True:
        metadata = client.list_topics(topic, timeout=timeout_s)
        info = metadata.topics.get(topic)
        if info is not None and info.error is None and info.partitions:
            return len(info.partitions)
        if info is not None and info.error is not None:
            raise_refusal(info.error)  # not allowed to describe it: an ACL, not a missing topic
        if time.monotonic() > deadline:
            raise ServiceUnavailable(f"topic {topic} does not exist (run `tapeline stack up`)")
        time.sleep(0.2)


def log_error(exc: KafkaException) -> EventLogError:
    """The port's error for a client error: `WriterFenced` (`is_fenced` by a fenced code),
    `WriterBroken` (`is_fenced` by another fatal error), `TransactionMustAbort`
    (`txn_requires_abort`), else an `EventLogError` that says whether it is `retriable`."""
    error = exc.args[0] if exc.args else None
    if is_fenced(exc):
        if isinstance(error, KafkaError) and error.code() in FENCED_CODES:
            return WriterFenced(str(exc))
        return WriterBroken(str(exc))
    if isinstance(error, KafkaError) and error.txn_requires_abort():
        return TransactionMustAbort(str(exc), retriable=error.retriable())
    return EventLogError(str(exc), retriable=isinstance(error, KafkaError) and error.retriable())


def record_of(message: Message) -> Record:
    """The port's `Record` of a consumed message without an error."""
    return Record(topic=message.topic(), partition=message.partition(), offset=message.offset(), key=message.key(),
                  value=message.value(), headers=message.headers(), timestamp_ms=message.timestamp()[1])


class KafkaReader:
    """The `Reader` port over a confluent-kafka `Consumer` (built by `consumer`): records come out as
    `Record`, a partition's end as `PartitionEnd`, another error as `ReadError`, and a refused call
    raises `EventLogError` instead of `KafkaException`."""

    def __init__(self, client: Consumer) -> None:
        self.client = client

    def subscribe(self, topics: list[str], on_assign=None, on_revoke=None, on_lost=None) -> None:
        """`Consumer.subscribe`; each callback gets [(topic, partition), ...]."""
        def adapt(callback):
            if callback is None:
                return None
            return lambda _client, partitions: callback([(p.topic, p.partition) for p in partitions])

        kwargs = {name: adapt(cb) for name, cb in (("on_assign", on_assign), ("on_revoke", on_revoke),
                                                   ("on_lost", on_lost)) if cb is not None}
        self.client.subscribe(topics, **kwargs)

    def unsubscribe(self) -> None:
        self.client.unsubscribe()

    def poll(self, timeout_s: float) -> Record | PartitionEnd | ReadError | None:
        message = self.client.poll(timeout_s)
        if message is None:
            return None
        error = message.error()
        if error is None:
            return record_of(message)
        if error.code() == KafkaError._PARTITION_EOF:
            return PartitionEnd(message.topic(), message.partition(), message.offset())
        raise_refusal(error)
        return ReadError(str(error), fatal=error.fatal())

    def seek(self, topic: str, partition: int, offset: int) -> None:
        try:
            self.client.seek(TopicPartition(topic, partition, offset))
        except KafkaException as exc:
            raise log_error(exc) from exc

    def pause(self, partitions: list[Partition]) -> None:
        try:
            self.client.pause([TopicPartition(topic, partition) for topic, partition in partitions])
        except KafkaException as exc:
            raise log_error(exc) from exc

    def resume(self, partitions: list[Partition]) -> None:
        try:
            self.client.resume([TopicPartition(topic, partition) for topic, partition in partitions])
        except KafkaException as exc:
            raise log_error(exc) from exc

    def assignment(self) -> list[Partition]:
        try:
            return [(p.topic, p.partition) for p in self.client.assignment()]
        except KafkaException as exc:
            raise log_error(exc) from exc

    def commit(self, offsets: list[Offset]) -> None:
        """`Consumer.commit(offsets, asynchronous=False)`."""
        try:
            self.client.commit(offsets=[TopicPartition(*o) for o in offsets], asynchronous=False)
        except KafkaException as exc:
            raise log_error(exc) from exc

    def group_metadata(self) -> Any:
        return self.client.consumer_group_metadata()

    def close(self) -> None:
        self.client.close()


class KafkaWriter:
    """The `Writer` port over a confluent-kafka transactional `Producer` (built by
    `transactional_producer`): every `KafkaException` is raised as the port's error (`log_error`),
    also when it comes out of a delivery callback as a `SystemError` (a fenced producer's fatal error
    raised while the callback ran)."""

    def __init__(self, client: Producer) -> None:
        self.client = client
        self.unfinished: str | None = None
        """"commit" or "abort": that call timed out while the client still runs it. librdkafka then
        refuses every other transactional call with `_CONFLICT` ("Conflicting commit_transaction API
        call is already in progress") until the same call is made again and ends (rdkafka_txnmgr.c
        `rd_kafka_txn_curr_api_begin`; its timeout says "retry call to resume"). Before this was
        tracked, a commit that timed out during a broker outage wedged its writer for good: the abort
        after it and every later `begin_transaction` were refused, so an attempt's heartbeats stopped
        for a whole lease after the log came back (issue 24, two brokers down). `begin_transaction`
        and `abort_transaction` resume it first."""

    def _call(self, method, *args):
        try:
            return method(*args)
        except KafkaException as exc:
            raise (access_refusal(exc) or log_error(exc)) from exc
        except SystemError as exc:
            if isinstance(exc.__cause__, KafkaException):
                raise (access_refusal(exc.__cause__) or log_error(exc.__cause__)) from exc
            raise

    def begin_transaction(self) -> None:
        """Begin a transaction, after finishing an unfinished commit or abort (`unfinished`; waits up
        to `RESUME_TIMEOUT_S`). A resumed commit may still commit the earlier transaction: its
        caller was told the outcome is unknown and reconciles (`processors.attempt.Attempt.record`).
        Raises `EventLogError` (retriable) while that call still does not end."""
        if self.unfinished:
            self.abort_transaction(RESUME_TIMEOUT_S)  # resumes the unfinished call (see there)
        self._call(self.client.begin_transaction)

    def _resumable(self, name: str, method, timeout_s: float) -> None:
        """Call `method(timeout_s)` (commit or abort) and remember whether it is left `unfinished`:
        a retriable `_TIMED_OUT` that requires no abort means it still runs in the client."""
        try:
            self._call(method, timeout_s)
        except EventLogError as exc:
            kafka_error = exc.__cause__  # `_call` raises the port's error from the client's
            error = kafka_error.args[0] if isinstance(kafka_error, KafkaException) and kafka_error.args else None
            running = (isinstance(error, KafkaError) and error.code() == KafkaError._TIMED_OUT and error.retriable()
                       and not error.txn_requires_abort() and not error.fatal())
            self.unfinished = name if running else None
            raise
        self.unfinished = None

    def produce(self, topic: str, key: bytes, value: bytes, partition: int, on_delivery=None) -> None:
        """`Producer.produce`; `on_delivery(topic, partition, offset)` runs for a stored record only."""
        def delivered(error, message) -> None:
            if error is None and on_delivery is not None:
                on_delivery(message.topic(), message.partition(), message.offset())

        self._call(lambda: self.client.produce(topic, key=key, value=value, partition=partition,
                                               on_delivery=delivered))

    def flush(self, timeout_s: float) -> int:
        return self._call(self.client.flush, timeout_s)

    def send_offsets(self, offsets: list[Offset], group_metadata: Any, timeout_s: float) -> None:
        """`send_offsets_to_transaction`, bounded: librdkafka 2.16 ignores the call's timeout while it
        waits for a group coordinator (issues #5456, #5511: a killed broker that was the coordinator
        is dropped from the metadata and the request is never sent again), which held an intake for
        good after a broker's death. The call runs in a thread of its own; if it has not returned
        `SEND_OFFSETS_GRACE_S` seconds after `timeout_s`, `WriterStuck` is raised and the thread is
        left to it (a daemon; the producer stays referenced by it, so it is never destroyed under
        the running call)."""
        outcome: list[BaseException | None] = []

        def call() -> None:
            try:
                self._call(self.client.send_offsets_to_transaction, [TopicPartition(*o) for o in offsets],
                           group_metadata, timeout_s)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                outcome.append(exc)

        thread = threading.Thread(target=call, name="send-offsets", daemon=True)
        thread.start()
        thread.join(timeout_s + SEND_OFFSETS_GRACE_S)
        if not outcome:
            raise WriterStuck(f"send_offsets_to_transaction did not return within {timeout_s + SEND_OFFSETS_GRACE_S:.0f} s "
                              "(librdkafka issues #5456/#5511); this writer is abandoned")
        if outcome[0] is not None:
            raise outcome[0]

    def commit_transaction(self, timeout_s: float) -> None:
        self._resumable("commit", self.client.commit_transaction, timeout_s)

    def abort_transaction(self, timeout_s: float) -> None:
        """Abort the open transaction, or finish an `unfinished` call: an unfinished commit is resumed
        instead (an abort would be refused with `_CONFLICT`): if it ends, the transaction is
        committed and there is nothing to abort; if the commit failed, the abort follows; an
        unfinished abort is made again."""
        if self.unfinished == "commit":
            try:
                self._resumable("commit", self.client.commit_transaction, timeout_s)
                return
            except TransactionMustAbort:
                pass
        self._resumable("abort", self.client.abort_transaction, timeout_s)

    def poll(self, timeout_s: float) -> None:
        self._call(self.client.poll, timeout_s)


class KafkaEventLog:
    """The `EventLog` port (`tapeline/ports.py`) over Kafka, for one process. Its read_committed
    client for last stable offsets and partition counts (group `lso_group`, never subscribed) is
    created on first use; `close` closes it (a later call opens a new one)."""

    def __init__(self, settings: Settings, lso_group: str) -> None:
        self.settings, self.lso_group = settings, lso_group
        self._reader: Consumer | None = None
        self._partitions: dict[str, int] = {}

    def _lso_reader(self) -> Consumer:
        if self._reader is None:
            self._reader = consumer(self.settings, self.lso_group)
        return self._reader

    def transactional_producer(self, transactional_id: str) -> KafkaWriter:
        """`transactional_producer(settings, transactional_id)` as a `KafkaWriter`: initialised, so it
        fences older writers."""
        return KafkaWriter(transactional_producer(self.settings, transactional_id))

    def consumer(self, group_id: str, **overrides: Any) -> KafkaReader:
        """`consumer(settings, group_id, **overrides)` as a `KafkaReader`."""
        return KafkaReader(consumer(self.settings, group_id, **overrides))

    def partition_count(self, topic: str) -> int:
        """`partition_count` of `topic`, asked once per topic (a client error as `EventLogError`)."""
        if topic not in self._partitions:
            try:
                self._partitions[topic] = partition_count(self._lso_reader(), topic)
            except KafkaException as exc:
                raise log_error(exc) from exc
        return self._partitions[topic]

    def last_stable_offset(self, topic: str, partition: int) -> int:
        """`last_stable_offsets` of one partition (a client error as `EventLogError`)."""
        try:
            return last_stable_offsets(self._lso_reader(), topic, [partition])[partition]
        except KafkaException as exc:
            raise log_error(exc) from exc

    def assigned_reader(self, group_id: str, **overrides: Any) -> KafkaAssignedReader:
        """`consumer(settings, group_id, enable.partition.eof=true, **overrides)` as a `KafkaAssignedReader`."""
        return KafkaAssignedReader(consumer(self.settings, group_id, **{
            "enable.partition.eof": True,  # the projector learns "caught up" at each partition's end
            **overrides}))

    def cluster_id(self) -> str:
        """The cluster id the broker reports (metadata through the offsets client)."""
        return self._lso_reader().list_topics(timeout=10).cluster_id

    def close(self) -> None:
        """Close the offsets client, if it was opened."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def is_fenced(exc: KafkaException) -> bool:
    """Whether a Kafka error means a newer producer with our transactional.id took over.

    Besides the fenced codes and any error flagged fatal: `produce()` on a producer that has just
    been fenced raises `_FATAL` ("Unable to produce message: Local: Fatal error") whose `fatal()` is
    False (librdkafka reports the fatal error itself through the error callback, not on this one)."""
    error = exc.args[0] if exc.args else None
    if not isinstance(error, KafkaError):
        return False
    return error.code() in (*FENCED_CODES, KafkaError._FATAL) or error.fatal()


FENCED_CODES = (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH)
"""The error codes that mean a newer producer took the transactional id over (`WriterFenced`); any
other fatal error is `WriterBroken`."""


class KafkaAssignedReader:
    """The `AssignedReader` port over a confluent-kafka `Consumer` opened with `enable.partition.eof`:
    records are the client's own `Message`s (a `LogRecord`), its partition-end events become
    `PartitionEnd`, its other errors `ReadError`."""

    def __init__(self, client: Consumer) -> None:
        self.client = client

    def assign(self, positions: list[tuple[str, int, int | None]]) -> None:
        self.client.assign([TopicPartition(topic, partition, OFFSET_BEGINNING if offset is None else offset)
                            for topic, partition, offset in positions])

    def poll(self, timeout_s: float) -> Message | PartitionEnd | ReadError | None:
        message = self.client.poll(timeout_s)
        return None if message is None else self._item(message)

    def consume(self, max_records: int, timeout_s: float) -> list[Message | PartitionEnd | ReadError]:
        return [self._item(message) for message in self.client.consume(max_records, timeout=timeout_s)]

    @staticmethod
    def _item(message: Message) -> Message | PartitionEnd | ReadError:
        error = message.error()
        if error is None:
            return message
        if error.code() == KafkaError._PARTITION_EOF:
            return PartitionEnd(message.topic(), message.partition(), message.offset())
        raise_refusal(error)
        return ReadError(str(error), fatal=error.fatal())

    def records_behind(self) -> int:
        """Cached high watermark minus position, summed over the assignment."""
        total = 0
        for tp in self.client.position(self.client.assignment()):
            _, high = self.client.get_watermark_offsets(tp, cached=True)
            if tp.offset >= 0 and high >= 0:
                total += max(0, high - tp.offset)
        return total

    def close(self) -> None:
        self.client.close()


def admin_client(settings: Settings, **extra: Any):
    """An admin client of the cluster at the bootstrap addresses (5 s socket timeout), `extra` librdkafka
    settings on top."""
    from confluent_kafka.admin import AdminClient

    return AdminClient({**client_config(settings), "socket.timeout.ms": 5000, **extra})


def bootstrap_listens(settings: Settings) -> bool:
    """Whether something accepts a TCP connection at one of the bootstrap addresses (a port nobody
    listens on is refused at once: a cluster that is not there costs no wait)."""
    return any(port_open(*host_port(a.strip(), 9092)) for a in settings.kafka_bootstrap_servers.split(","))


def cluster_answers(settings: Settings, timeout_s: float = 3.0, brokers: int = 1) -> tuple[bool, str | None]:
    """`(True, None)` if the cluster at the bootstrap addresses serves metadata listing at least `brokers`
    brokers, else `(False, why)`; a refusal of this client is named as one (`KafkaAccessRefused`'s text:
    "Kafka refused this client (tls|authentication|authorisation): ...")."""
    if not bootstrap_listens(settings):
        addresses = [a.strip() for a in settings.kafka_bootstrap_servers.split(",")]
        return False, f"nothing listens on {', '.join(addresses)}"
    client = None
    try:
        client = admin_client(settings)
        metadata = client.list_topics(timeout=timeout_s)
    except Exception as exc:  # KafkaException, KafkaAccessRefused, ConfigurationError, a timeout inside librdkafka
        return False, str(refusal_of(settings, exc, client) or exc)
    if len(metadata.brokers) < brokers:
        return False, f"the cluster reports {len(metadata.brokers)} of {brokers} brokers registered"
    return True, None

"""The local Kafka broker: a single combined KRaft node from the pinned jars (`stack/pom.xml`)."""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import time
import uuid
from typing import Any

from rich.console import Console

from tapeline.settings import Settings

from tapeline.stack.base import KAFKA_HEAP, KAFKA_JVM_FLAGS, KAFKA_READY_TIMEOUT_S, POM, StackError, StackPaths, _host_port, _kafka_markers, _log_errors, _now, _owned_pid, _port_open, _say, _spawn, _tail, _update_state

# --------------------------------------------------------------------------------------------
# Kafka


def _server_properties(settings: Settings, paths: StackPaths) -> str:
    """The broker's server.properties: a single combined KRaft node on loopback."""
    host, port = _host_port(settings.kafka_bootstrap, 9092)
    controller = f"{host}:{settings.kafka_controller_port}"
    return f"""\
# Written by `tapeline stack up` (tapeline/stack/kafka.py) on every start; edits are overwritten.
# A single combined KRaft node for local development and tests: ONE broker, so nothing is
# replicated. Production runs replication factor 3 and min.insync.replicas=2.

# This one process is both the broker and the only controller (static quorum of one voter).
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@{controller}
listeners=PLAINTEXT://{host}:{port},CONTROLLER://{controller}
advertised.listeners=PLAINTEXT://{host}:{port}
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
# Topic data and KRaft metadata stay in the project-owned home directory.
log.dirs={paths.kafka_data}

# One broker: the internal topics (consumer offsets, transaction state, share-group state)
# cannot have more replicas, or a larger in-sync minimum, than there are brokers.
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1

# Tests start groups constantly: do not wait 3 s for more members before the first rebalance.
group.initial.rebalance.delay.ms=0
# Allow consumers to ask for short sessions (tests use ~seconds) so a killed worker's partitions
# move quickly; the defaults' floor is 6 s (classic) and 45 s (consumer protocol).
group.min.session.timeout.ms=1000
group.consumer.min.session.timeout.ms=1000
group.consumer.min.heartbeat.interval.ms=500

# An open transaction blocks every read_committed reader of its partitions. Sweep transactions
# past their timeout every second (default 10 s) so a killed worker stalls readers only for
# its producer's transaction.timeout.ms plus about a second.
transaction.abort.timed.out.transaction.cleanup.interval.ms=1000
# Expire abandoned transactional ids every minute (default hourly); the expiry itself,
# transactional.id.expiration.ms, keeps its default of 7 days.
transaction.remove.expired.transaction.cleanup.interval.ms=60000

# Every topic is created explicitly by `ensure_topics` with its partition count and config;
# a typo in a topic name must fail, not silently create a one-partition topic.
auto.create.topics.enable=false
num.partitions=1
default.replication.factor=1
"""


def _ensure_kafka_libs(paths: StackPaths, console: Console | None) -> None:
    """Download the broker jars with Maven into `<home>/kafka/libs` unless they are there.

    The jars are fetched again when `stack/pom.xml` changed since they were fetched (stamp
    `libs/.pom.sha256`), so a version bump in the pom takes effect on the next start; with
    ~/.m2 warm that takes a few seconds and no network.

    Raises:
        StackError: Maven is missing or fails, or the pom is missing and there are no jars.
    """
    have_jars = paths.kafka_libs.is_dir() and any(paths.kafka_libs.glob("kafka_2.13-*.jar"))
    stamp = paths.kafka_libs / ".pom.sha256"
    pom_hash = hashlib.sha256(POM.read_bytes()).hexdigest() if POM.is_file() else None
    if have_jars and (pom_hash is None or (stamp.is_file() and stamp.read_text().strip() == pom_hash)):
        return
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StackError("Maven (`mvn`) is needed once to download the Kafka jars. "
                         "Install it with `apt-get install -y maven openjdk-17-jre-headless`.")
    if not POM.is_file():
        raise StackError(f"{POM} is missing; run the stack from a source checkout of Tapeline.")
    _say(console, f"[bold]kafka[/]: resolving broker jars from Maven Central into {paths.kafka_libs}")
    if paths.kafka_libs.is_dir():
        shutil.rmtree(paths.kafka_libs)  # no stale jar of another version stays on the classpath
    paths.kafka_libs.mkdir(parents=True)
    result = subprocess.run([mvn, "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
                             f"-DoutputDirectory={paths.kafka_libs}"], capture_output=True, text=True)
    if result.returncode != 0 or not any(paths.kafka_libs.glob("kafka_2.13-*.jar")):
        raise StackError(f"Maven could not fetch the Kafka jars (exit {result.returncode}):\n"
                         f"{(result.stdout + result.stderr)[-3000:]}")
    stamp.write_text(f"{pom_hash}\n")


def _java() -> str:
    java = shutil.which("java")
    if java is None:
        raise StackError("Java 17+ is needed for Kafka. Install it with `apt-get install -y openjdk-17-jre-headless`.")
    return java


def _kafka_cluster_id() -> str:
    """A random Kafka cluster id: a UUID in unpadded URL-safe base64, as `StorageTool random-uuid`
    prints it (and, like Kafka, never one starting with a dash)."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id


def _format_kafka_storage(paths: StackPaths, console: Console | None) -> str | None:
    """Format the KRaft storage once; returns the new cluster id, or None if already formatted.

    The quorum is static (`controller.quorum.voters`), so the format runs without `--standalone`:
    Kafka refuses `--standalone` together with `controller.quorum.voters` (that flag is for a
    dynamic quorum configured with `controller.quorum.bootstrap.servers`).
    """
    if (paths.kafka_data / "meta.properties").is_file():
        return None
    cluster_id = _kafka_cluster_id()
    _say(console, f"[bold]kafka[/]: formatting storage {paths.kafka_data} (cluster id {cluster_id})")
    result = subprocess.run([_java(), "-cp", f"{paths.kafka_libs}/*", "kafka.tools.StorageTool", "format",
                             "-t", cluster_id, "-c", str(paths.kafka_properties)],
                            capture_output=True, text=True, cwd=paths.kafka)
    if result.returncode != 0 or not (paths.kafka_data / "meta.properties").is_file():
        raise StackError(f"Formatting Kafka storage failed (exit {result.returncode}):\n"
                         f"{(result.stdout + result.stderr)[-3000:]}")
    return cluster_id


def _admin(settings: Settings, **extra: Any):
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": settings.kafka_bootstrap, "socket.timeout.ms": 5000, **extra})


def _kafka_answers(settings: Settings, timeout_s: float = 3.0) -> tuple[bool, str | None]:
    """True if a broker at the bootstrap address serves metadata and lists at least one broker."""
    host, port = _host_port(settings.kafka_bootstrap, 9092)
    if not _port_open(host, port):
        return False, f"nothing listens on {host}:{port}"
    try:
        metadata = _admin(settings).list_topics(timeout=timeout_s)
    except Exception as exc:  # KafkaException or a timeout inside librdkafka
        return False, str(exc)
    if not metadata.brokers:
        return False, "the cluster reports no registered broker yet"
    return True, None


def _start_kafka(settings: Settings, paths: StackPaths, console: Console | None) -> subprocess.Popen | None:
    """Start the broker unless one answers or is starting; returns the new process, if any."""
    pid = _owned_pid(paths.kafka_pid, _kafka_markers(paths))
    if pid is not None:
        _say(console, f"[bold]kafka[/]: already running (pid {pid})")
        return None
    host, port = _host_port(settings.kafka_bootstrap, 9092)
    if _port_open(host, port):
        _say(console, f"[bold]kafka[/]: something already answers on {host}:{port}; reusing it")
        _update_state(paths, "kafka", None)
        return None
    paths.kafka_pid.unlink(missing_ok=True)
    _ensure_kafka_libs(paths, console)
    paths.kafka_data.mkdir(parents=True, exist_ok=True)
    paths.kafka_properties.write_text(_server_properties(settings, paths))
    _format_kafka_storage(paths, console)
    _warn_if_broker_logs_silent(paths, console)
    argv = [_java(), *KAFKA_HEAP, *KAFKA_JVM_FLAGS, "-cp", f"{paths.kafka_libs}/*", "kafka.Kafka",
            str(paths.kafka_properties)]
    proc = _spawn(argv, paths.kafka_log, paths.kafka_pid, cwd=paths.kafka)
    _say(console, f"[bold]kafka[/]: started pid {proc.pid}, log {paths.kafka_log}")
    _update_state(paths, "kafka", {"pid": proc.pid, "started_at": _now(), "bootstrap": settings.kafka_bootstrap,
                                   "log": str(paths.kafka_log)})
    return proc


def _warn_if_broker_logs_silent(paths: StackPaths, console: Console | None) -> None:
    """Warn when the jars bind no SLF4J logger: the broker would then log nothing, not even why it died.

    slf4j-simple 2.x needs slf4j-api 2.x; with Kafka's own slf4j-api 1.7 first, SLF4J falls back
    to its no-op logger. The fix is a direct `org.slf4j:slf4j-api:2.x` dependency in stack/pom.xml.
    """
    jars = [jar.name for jar in paths.kafka_libs.glob("slf4j-*.jar")]
    api_1 = any(name.startswith("slf4j-api-1.") for name in jars)
    simple_2 = any(name.startswith("slf4j-simple-2.") for name in jars)
    if api_1 and simple_2:
        _say(console, "[yellow]kafka[/]: slf4j-api 1.x with slf4j-simple 2.x in the broker jars: the broker "
                      "will log nothing (fix: add org.slf4j:slf4j-api 2.x to stack/pom.xml; the jars are "
                      "fetched again on the next start)")


def _wait_for_kafka(settings: Settings, paths: StackPaths, proc: subprocess.Popen | None,
                    timeout_s: float = KAFKA_READY_TIMEOUT_S) -> float:
    """Wait until the broker serves metadata; returns the seconds waited.

    Raises:
        StackError: the broker exited, or did not answer within timeout_s seconds; the message
            names the log file and shows its tail.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    reason: str | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise StackError(f"Kafka exited with code {proc.returncode} while starting. "
                             f"{_log_errors(paths.kafka_log)}See {paths.kafka_log}:\n{_tail(paths.kafka_log)}")
        ok, reason = _kafka_answers(settings, timeout_s=3.0)
        if ok:
            return time.monotonic() - started
        time.sleep(0.5)
    raise StackError(f"Kafka did not answer on {settings.kafka_bootstrap} within {timeout_s:.0f} s "
                     f"({reason}). {_log_errors(paths.kafka_log)}See {paths.kafka_log}:\n"
                     f"{_tail(paths.kafka_log)}")



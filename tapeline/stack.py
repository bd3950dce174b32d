"""The local stack: real Kafka (KRaft), PostgreSQL, an S3 endpoint and ffmpeg, without Docker.

`tapeline stack up` brings up every service the default `Settings` point at, reusing whatever
already answers and starting only what is missing:

* **Kafka** - a single combined KRaft node (broker + controller) run with the machine's Java 17+
  from jars that Maven resolves from Maven Central (`stack/pom.xml`).
* **PostgreSQL** - the Debian package's cluster (`pg_ctlcluster`), plus the role and database
  named in `settings.database_url`.
* **S3** - moto's S3 behind a signature gate, `python -m tapeline.s3server` (objects live in its
  memory and are gone when it stops), with the bucket `settings.s3_bucket`: requests signed with
  `s3_access_key`/`s3_secret_key` pass, anonymous ones only as GET/HEAD of objects under
  `published/` (tapeline/s3server.py says why not moto's own IAM mode).
* **ffmpeg** - checked, never started.

Everything the stack writes lives under `settings.home` (one project-owned directory)::

    <home>/stack.json            what the stack itself started (pids, the PostgreSQL cluster)
    <home>/stack.lock            serialises concurrent `up`/`down`
    <home>/kafka/libs/           broker jars (Maven)
    <home>/kafka/data/           KRaft metadata and topic data
    <home>/kafka/server.properties, kafka.log, kafka.pid
    <home>/s3/moto.log, moto.pid    (the tapeline.s3server process)

`down` stops only what the stack started: a process whose pid is in a pid file *and* whose command
line is still the one the stack launched (a recycled pid is never signalled), and the PostgreSQL
cluster only if `stack.json` says the stack started it. Reused services are left alone.

The local stack runs ONE Kafka broker, so every topic has replication factor 1 and the internal
topics are configured to fit it. Production replicates the log (replication factor 3,
`min.insync.replicas=2`); see docs/design.md, "Production settings".

`status()` reports the PostgreSQL DSN with its password masked (`***`): the status output is meant
to be pasted into issues and logs, and secrets are never logged.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit, urlunsplit

import typer
from rich.console import Console
from rich.table import Table

from tapeline.settings import PROJECT_ROOT, Settings

KAFKA_READY_TIMEOUT_S = 120.0
"""How long `up` waits for a freshly started broker to answer a metadata request, seconds."""
S3_READY_TIMEOUT_S = 30.0
"""How long `up` waits for a freshly started moto_server to answer HTTP, seconds."""
PG_READY_TIMEOUT_S = 30.0
"""How long `up` waits for PostgreSQL to accept the DSN after starting its cluster, seconds."""
STOP_TIMEOUT_S = 30.0
"""How long `down` waits after SIGTERM before it sends SIGKILL, seconds."""
TOPICS_TIMEOUT_S = 60.0
"""How long `ensure_topics` keeps retrying while the broker is not yet ready, seconds."""
LOG_ROTATE_BYTES = 50 * 1024**2
"""A service log larger than this (bytes) is moved to `<name>.1` when the service starts again."""
KAFKA_HEAP = ("-Xmx512m", "-Xms256m")
"""A modest broker heap on purpose: a 2-core CI machine must leave room for ffmpeg."""

KAFKA_JVM_FLAGS = (
    # What kafka-server-start.sh uses; without it a 2-core JVM picks the serial collector.
    "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
    # slf4j-simple writes to stderr (the log file); give each line a timestamp.
    "-Dorg.slf4j.simpleLogger.showDateTime=true",
    "-Dorg.slf4j.simpleLogger.dateTimeFormat=yyyy-MM-dd'T'HH:mm:ss.SSSXXX",
)

POM = PROJECT_ROOT / "stack" / "pom.xml"
"""The Maven project that resolves the Kafka broker jars."""

JOBS_TOPIC_CONFIG = {
    "retention.ms": "-1",  # the lifecycle log is the only record: keep it forever
    "retention.bytes": "-1",
    "message.timestamp.type": "LogAppendTime",  # one lease clock: the broker stamps every event
}
UNLIMITED_RETENTION = {"retention.ms": "-1"}
SIDE_TOPIC_CONFIG = {**UNLIMITED_RETENTION, "message.timestamp.type": "LogAppendTime"}
"""The uploads and dead-letter topics: kept, and stamped by the broker too. With CreateTime a
submitter whose clock ran an hour behind made a 3-second-old upload "expected work missing" for an
hour, showed an hour of projection lag, and cut `replay --as-of` at the wrong offset (the broker's
time index assumes timestamps that only grow)."""


class StackError(RuntimeError):
    """A local service could not be brought up or checked; the message says what to do."""


# --------------------------------------------------------------------------------------------
# Paths, state and small helpers


@dataclass(frozen=True)
class StackPaths:
    """Every file the stack owns, all under one home directory."""

    home: Path

    @property
    def state(self) -> Path:
        return self.home / "stack.json"

    @property
    def lock(self) -> Path:
        return self.home / "stack.lock"

    @property
    def kafka(self) -> Path:
        return self.home / "kafka"

    @property
    def kafka_libs(self) -> Path:
        return self.kafka / "libs"

    @property
    def kafka_data(self) -> Path:
        return self.kafka / "data"

    @property
    def kafka_properties(self) -> Path:
        return self.kafka / "server.properties"

    @property
    def kafka_log(self) -> Path:
        return self.kafka / "kafka.log"

    @property
    def kafka_pid(self) -> Path:
        return self.kafka / "kafka.pid"

    @property
    def s3(self) -> Path:
        return self.home / "s3"

    @property
    def s3_log(self) -> Path:
        return self.s3 / "moto.log"

    @property
    def s3_pid(self) -> Path:
        return self.s3 / "moto.pid"


def _paths(settings: Settings) -> StackPaths:
    return StackPaths(Path(settings.home).resolve())


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _read_state(paths: StackPaths) -> dict[str, Any]:
    """`stack.json` as a dict (empty if missing or unreadable)."""
    try:
        return json.loads(paths.state.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _write_state(paths: StackPaths, state: dict[str, Any]) -> None:
    """Replace `stack.json` atomically."""
    paths.home.mkdir(parents=True, exist_ok=True)
    tmp = paths.state.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    tmp.replace(paths.state)


def _update_state(paths: StackPaths, service: str, record: dict[str, Any] | None) -> None:
    """Set (or, with None, remove) one service's record in `stack.json`."""
    state = _read_state(paths)
    if record is None:
        state.pop(service, None)
    else:
        state[service] = record
    _write_state(paths, state)


@contextlib.contextmanager
def _locked(paths: StackPaths) -> Iterator[None]:
    """Hold an exclusive lock on `<home>/stack.lock` so two `up`s never start two brokers."""
    paths.home.mkdir(parents=True, exist_ok=True)
    with open(paths.lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _host_port(address: str, default_port: int) -> tuple[str, int]:
    """Split `host:port` (or a URL's netloc) into its parts."""
    host, _, port = address.rpartition(":")
    if not host:
        return address, default_port
    return host.strip("[]"), int(port)


def _port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True if something accepts TCP connections at host:port within timeout_s seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _tail(path: Path, lines: int = 25) -> str:
    """The last lines of a log file, for error messages."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log yet)"


def _log_errors(path: Path, limit: int = 5) -> str:
    """The first ERROR/FATAL lines the current run (since the last start marker) wrote to a log."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    run = text.rpartition("\n===== ")[2].splitlines()
    hits = [line for line in run if " ERROR " in line or " FATAL " in line][:limit]
    return ("First errors:\n" + "\n".join(hits) + "\n") if hits else ""


def _say(console: Console | None, message: str) -> None:
    if console is not None:
        console.print(message)


# --------------------------------------------------------------------------------------------
# Processes the stack starts: pid files checked against the command line


def _cmdline(pid: int) -> list[str] | None:
    """The argv of a live, non-zombie process, or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rpartition(")")[2].split()[0] == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # reap our own child so it really goes away
            return None
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _owned_pid(pid_file: Path, markers: tuple[str, ...]) -> int | None:
    """The pid in pid_file if that process is alive and its argv contains every marker.

    A pid file whose process is gone, or whose pid now belongs to another program, is stale and
    yields None; such a pid is never signalled.
    """
    try:
        pid = int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    argv = _cmdline(pid)
    if argv is None or not all(any(marker in arg for arg in argv) for marker in markers):
        return None
    return pid


def _kafka_markers(paths: StackPaths) -> tuple[str, ...]:
    return ("kafka.Kafka", str(paths.kafka_properties))


def _s3_markers(settings: Settings) -> tuple[str, ...]:
    _, port = _host_port(urlsplit(settings.s3_endpoint).netloc, 80)
    return ("tapeline.s3server", str(port))


def _spawn(argv: list[str], log: Path, pid_file: Path, cwd: Path,
           env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start argv detached (own session), output appended to log, pid written to pid_file; `env`
    (default: this process's environment)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    if log.exists() and log.stat().st_size > LOG_ROTATE_BYTES:
        log.replace(log.with_name(log.name + ".1"))
    with open(log, "ab") as out:
        out.write(f"\n===== {_now()} starting: {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)
    pid_file.write_text(f"{proc.pid}\n")
    return proc


def _stop_pid(pid: int, name: str, console: Console | None, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM pid, wait up to timeout_s seconds, then SIGKILL it."""
    _say(console, f"[bold]{name}[/]: stopping pid {pid} (SIGTERM)")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _cmdline(pid) is None:
            return
        time.sleep(0.2)
    _say(console, f"[yellow]{name}[/]: still alive after {timeout_s:.0f} s, sending SIGKILL")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _cmdline(pid) is not None:
        time.sleep(0.1)


# --------------------------------------------------------------------------------------------
# ffmpeg


def check_ffmpeg() -> None:
    """Check that `ffmpeg` and `ffprobe` are on PATH and run.

    Raises:
        StackError: either program is missing or fails to report its version; the message says
            `apt-get install -y ffmpeg`.
    """
    missing = [tool for tool in ("ffmpeg", "ffprobe") if shutil.which(tool) is None]
    if missing:
        raise StackError(f"{' and '.join(missing)} not found on PATH. Install them with "
                         f"`apt-get install -y ffmpeg` (Debian), then retry.")
    if _ffmpeg_version() is None:
        raise StackError("`ffmpeg -version` failed. Reinstall with `apt-get install -y --reinstall ffmpeg`.")


def _ffmpeg_version() -> str | None:
    """ffmpeg's version string (e.g. `5.1.9-0+deb12u1`), or None if it cannot be run."""
    try:
        out = subprocess.run(["ffmpeg", "-hide_banner", "-version"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    words = out.split()
    return words[2] if len(words) > 2 and words[:2] == ["ffmpeg", "version"] else (out.strip() or None)


# --------------------------------------------------------------------------------------------
# Kafka


def _server_properties(settings: Settings, paths: StackPaths) -> str:
    """The broker's server.properties: a single combined KRaft node on loopback."""
    host, port = _host_port(settings.kafka_bootstrap, 9092)
    controller = f"{host}:{settings.kafka_controller_port}"
    return f"""\
# Written by `tapeline stack up` (tapeline/stack.py) on every start; edits are overwritten.
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


def delete_topics(settings: Settings, timeout_s: float = 30.0) -> list[str]:
    """Delete every topic of `settings.all_topics()` (tests and benchmarks with their own prefix clean
    up after themselves, so a long-lived local broker does not collect thousands of topics). Best
    effort: returns the topics that could not be deleted (missing ones count as deleted)."""
    from confluent_kafka import KafkaError, KafkaException

    admin = _admin(settings)
    failed = []
    for topic, future in admin.delete_topics(list(settings.all_topics()), operation_timeout=timeout_s).items():
        try:
            future.result(timeout=timeout_s)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                failed.append(topic)
        except Exception:  # a timeout: the broker may still delete it
            failed.append(topic)
    return failed


def ensure_topics(settings: Settings, timeout_s: float = TOPICS_TIMEOUT_S) -> None:
    """Create every topic of `settings.all_topics()` that is missing; idempotent.

    Partition counts come from the settings, replication factor is 1 (one local broker). The jobs
    topic gets unlimited retention and `message.timestamp.type=LogAppendTime` (the broker's clock
    is the only lease clock); the uploads and dead-letter topics get unlimited time retention and
    LogAppendTime too (`SIDE_TOPIC_CONFIG`).
    An existing topic keeps its partition count; its required configs are set if they differ
    (a jobs topic created elsewhere with CreateTime would silently break the lease clock).
    Works for any Settings, e.g. tests with their own `topic_prefix` and small partition counts.

    Raises:
        StackError: the broker refused a topic, or was unreachable for timeout_s seconds.
    """
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic, ResourceType

    wanted: dict[str, tuple[int, dict[str, str]]] = {}
    for topic, partitions in settings.all_topics().items():
        config: dict[str, str] = {}
        if topic == settings.jobs_topic:
            config = dict(JOBS_TOPIC_CONFIG)
        elif topic in (settings.uploads_topic, settings.dlq_topic):
            config = dict(SIDE_TOPIC_CONFIG)
        wanted[topic] = (partitions, config)

    admin = _admin(settings)
    deadline = time.monotonic() + timeout_s
    pending = dict(wanted)
    existed: set[str] = set()
    while pending:
        futures = admin.create_topics(
            [NewTopic(name, num_partitions=parts, replication_factor=1, config=config)
             for name, (parts, config) in pending.items()], operation_timeout=30, request_timeout=35)
        retry: dict[str, tuple[int, dict[str, str]]] = {}
        errors: list[str] = []
        for name, future in futures.items():
            try:
                future.result()
            except KafkaException as exc:
                error = exc.args[0]
                if error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    existed.add(name)
                elif error.retriable() or error.code() in (KafkaError.INVALID_REPLICATION_FACTOR,
                                                           KafkaError._TRANSPORT, KafkaError._TIMED_OUT):
                    retry[name] = pending[name]  # broker still starting up
                    errors.append(f"{name}: {error.str()}")
                else:
                    raise StackError(f"Creating topic {name} failed: {error.str()}") from exc
        pending = retry
        if pending:
            if time.monotonic() > deadline:
                raise StackError("Could not create topics within "
                                 f"{timeout_s:.0f} s: {'; '.join(errors)}")
            time.sleep(1.0)

    # A topic that already existed keeps its partitions, but gets its required configs. The
    # broker applies an alteration through the controller, so poll until describe shows it.
    to_check = [name for name in existed if wanted[name][1]]
    altered: set[str] = set()
    while to_check:
        resources = [ConfigResource(ResourceType.TOPIC, name) for name in to_check]
        drifted: dict[str, dict[str, str]] = {}
        for resource, future in admin.describe_configs(resources, request_timeout=30).items():
            current = future.result()
            drift = {key: value for key, value in wanted[resource.name][1].items()
                     if key not in current or current[key].value != value}
            if drift:
                drifted[resource.name] = drift
        for name, drift in drifted.items():
            if name in altered:
                continue
            fix = ConfigResource(ResourceType.TOPIC, name, incremental_configs=[
                ConfigEntry(key, value, incremental_operation=AlterConfigOpType.SET)
                for key, value in drift.items()])
            admin.incremental_alter_configs([fix])[fix].result()
            altered.add(name)
        to_check = list(drifted)
        if to_check:
            if time.monotonic() > deadline:
                raise StackError(f"Topic configs not applied after {timeout_s:.0f} s: {drifted}")
            time.sleep(0.2)

    # Wait until every topic's metadata, with a leader for each partition, is visible, so a
    # producer that starts right after this returns never sees an unknown topic.
    while True:
        metadata = admin.list_topics(timeout=10)
        missing = [name for name, (parts, _) in wanted.items()
                   if name not in metadata.topics or metadata.topics[name].error is not None
                   or any(p.leader < 0 for p in metadata.topics[name].partitions.values())]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise StackError(f"Topics created but without leaders after {timeout_s:.0f} s: {missing}")
        time.sleep(0.3)


# --------------------------------------------------------------------------------------------
# PostgreSQL


def _pg_params(settings: Settings) -> dict[str, str]:
    from psycopg.conninfo import conninfo_to_dict

    params = {key: str(value) for key, value in conninfo_to_dict(settings.database_url).items()}
    params.setdefault("host", "127.0.0.1")
    params.setdefault("port", "5432")
    params.setdefault("user", os.environ.get("USER", "postgres"))
    params.setdefault("dbname", params["user"])
    return params


def masked_dsn(dsn: str) -> str:
    """The DSN with its password replaced by `***`: a URL's user info and its `password` query
    parameter (libpq reads both), or the key=value form's `password`."""
    if "://" in dsn:
        parts = urlsplit(dsn)
        netloc = parts.netloc
        if parts.password is not None:
            netloc = netloc.replace(f":{parts.password}@", ":***@", 1)
        query = "&".join("password=***" if p.split("=", 1)[0].lower() == "password" else p
                         for p in parts.query.split("&")) if parts.query else parts.query
        return urlunsplit(parts._replace(netloc=netloc, query=query))
    import psycopg
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        return make_conninfo(dsn, password="***") if "password" in conninfo_to_dict(dsn) else dsn
    except psycopg.ProgrammingError:  # malformed: it may still hold a password, so show none of it
        return "(a key=value DSN libpq cannot parse; not shown)"


def _pg_connect_error(settings: Settings, timeout_s: int = 3) -> str | None:
    """None if the DSN accepts a connection and `SELECT 1`, else the error text."""
    import psycopg

    try:
        with psycopg.connect(settings.database_url, connect_timeout=timeout_s) as conn:
            conn.execute("SELECT 1")
        return None
    except psycopg.Error as exc:
        return str(exc).strip() or type(exc).__name__


def drop_database(admin_url: str, dbname: str, attempts: int = 4) -> None:
    """Drop database `dbname` if it exists, ending its sessions first.

    `admin_url` is a DSN for another database of the same cluster (the drop cannot run inside the
    database it drops). `DROP DATABASE ... WITH (FORCE)` terminates the sessions, but PostgreSQL 15
    and 16 refuse it to a role that is not a superuser while an autovacuum worker is in the database
    (the worker has no role, so "must be a member of the role whose process is being terminated";
    PostgreSQL 17 added `pg_signal_autovacuum_worker` for this). On that error this runs a plain
    `DROP DATABASE`, which stops autovacuum workers itself and waits up to 5 seconds for the other
    sessions to end, up to `attempts` times.

    Raises psycopg.errors.ObjectInUse if sessions that this role may not end stay connected through
    every attempt, and any other psycopg.Error as it comes.
    """
    import psycopg
    from psycopg import errors, sql

    name = sql.Identifier(dbname)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        try:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))
            return
        except errors.InsufficientPrivilege:
            pass
        for attempt in range(1, attempts + 1):
            try:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(name))
                return
            except errors.ObjectInUse:
                if attempt == attempts:
                    raise


def _pg_clusters() -> list[dict[str, str]]:
    """Debian's PostgreSQL clusters (`pg_lsclusters`): version, name, port, status."""
    if shutil.which("pg_lsclusters") is None:
        return []
    out = subprocess.run(["pg_lsclusters", "-h"], capture_output=True, text=True, check=True).stdout
    clusters = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            clusters.append({"version": fields[0], "name": fields[1], "port": fields[2], "status": fields[3]})
    return clusters


def _psql_quote(value: str) -> str:
    """A value as a single-quoted psql meta-command argument (`\\set name '...'`)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


READER_ROLE_SQL = ("SELECT 'CREATE ROLE tapeline_reader NOLOGIN' WHERE NOT EXISTS "
                   "(SELECT FROM pg_roles WHERE rolname = 'tapeline_reader') \\gexec")
"""The read-only role dashboards are granted (migration 010 grants it SELECT on every projection)."""


def reader_grant_sql(user: str) -> str:
    """psql script: make the DSN's login role a member of `tapeline_reader`, so `tapeline serve` can
    `SET ROLE tapeline_reader` (a NOLOGIN role is only reachable that way). Idempotent."""
    return "\n".join([f"\\set login {_psql_quote(user)}",
                      "SELECT format('GRANT tapeline_reader TO %I', :'login') WHERE NOT pg_has_role(:'login', "
                      "'tapeline_reader', 'MEMBER') \\gexec"])


def _pg_ensure_reader_role(port: str, user: str, console: Console | None) -> None:
    """Create the NOLOGIN role `tapeline_reader` as the `postgres` OS user when it is missing and grant
    it to the DSN's login role `user` (root only; otherwise the migrations and `tapeline serve` say
    how). Failures are reported, not raised."""
    if os.geteuid() != 0 or shutil.which("runuser") is None or shutil.which("psql") is None:
        return
    result = subprocess.run(["runuser", "-u", "postgres", "--", "psql", "-X", "-q", "-v", "ON_ERROR_STOP=1",
                             "-p", port, "-d", "postgres"], input=READER_ROLE_SQL + "\n" + reader_grant_sql(user) + "\n",
                            capture_output=True, text=True, cwd="/")
    if result.returncode != 0:
        _say(console, f"[yellow]postgres[/]: could not create role tapeline_reader: {result.stderr.strip()}")


def _pg_ensure_role_and_db(params: dict[str, str], port: str, console: Console | None) -> None:
    """Create the DSN's role (LOGIN, CREATEDB, its password) and database if missing.

    Runs `psql` as the `postgres` OS user over the local socket (peer authentication); the server
    refuses to run as root and TCP logins need a password. The values travel on psql's stdin,
    never on a command line. Nothing that already exists is altered.
    """
    if shutil.which("runuser") is None or shutil.which("psql") is None:
        raise StackError("`runuser` and `psql` are needed to create the PostgreSQL role; "
                         "install `postgresql-client` (and run as root).")
    if os.geteuid() != 0:
        raise StackError(f"Creating the PostgreSQL role {params['user']!r} needs root (`runuser -u postgres`); "
                         "run `tapeline stack up` as root once, or create the role and database yourself.")
    script = "\n".join([
        f"\\set role {_psql_quote(params['user'])}",
        f"\\set pw {_psql_quote(params.get('password', ''))}",
        f"\\set db {_psql_quote(params['dbname'])}",
        "SELECT format('CREATE ROLE %I LOGIN CREATEDB PASSWORD %L', :'role', :'pw')"
        " WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'role') \\gexec",
        "SELECT format('CREATE DATABASE %I OWNER %I', :'db', :'role')"
        " WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = :'db') \\gexec",
        READER_ROLE_SQL,
        reader_grant_sql(params["user"]),
        "",
    ])
    result = subprocess.run(["runuser", "-u", "postgres", "--", "psql", "-X", "-q", "-v", "ON_ERROR_STOP=1",
                             "-p", port, "-d", "postgres"], input=script, capture_output=True, text=True,
                            cwd="/")
    if result.returncode != 0:
        raise StackError(f"Creating the PostgreSQL role/database failed:\n{result.stderr.strip()}")
    _say(console, f"[bold]postgres[/]: role {params['user']!r} (CREATEDB) and database "
                  f"{params['dbname']!r} are present")


def _up_postgres(settings: Settings, paths: StackPaths, console: Console | None) -> None:
    """Make `settings.database_url` answer: reuse it, or start the Debian cluster and create the role.

    Raises:
        StackError: PostgreSQL is not installed, no local cluster serves the DSN's port, or the
            DSN still fails after starting the cluster and creating the role and database.
    """
    if _pg_connect_error(settings) is None:
        _say(console, f"[bold]postgres[/]: {masked_dsn(settings.database_url)} answers; reusing it")
        _warn_if_no_createdb(settings, console)
        params = _pg_params(settings)
        if params["host"] in ("127.0.0.1", "localhost", "::1", ""):
            _pg_ensure_reader_role(params["port"], params["user"], console)
        return
    params = _pg_params(settings)
    if params["host"] not in ("127.0.0.1", "localhost", "::1", "") and not params["host"].startswith("/"):
        raise StackError(f"PostgreSQL at {masked_dsn(settings.database_url)} does not answer: "
                         f"{_pg_connect_error(settings)}. It is not local, so the stack does not manage it.")
    if shutil.which("pg_ctlcluster") is None:
        raise StackError("PostgreSQL is not installed. Install it with `apt-get install -y postgresql`.")
    clusters = [c for c in _pg_clusters() if c["port"] == params["port"]]
    if not clusters:
        raise StackError(f"No PostgreSQL cluster listens on port {params['port']} (see `pg_lsclusters`). "
                         f"Create one with `pg_createcluster <version> main -p {params['port']}`.")
    cluster = clusters[0]
    if not cluster["status"].startswith("online"):
        _say(console, f"[bold]postgres[/]: starting cluster {cluster['version']}/{cluster['name']}")
        result = subprocess.run(["pg_ctlcluster", cluster["version"], cluster["name"], "start"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise StackError(f"`pg_ctlcluster {cluster['version']} {cluster['name']} start` failed:\n"
                             f"{(result.stdout + result.stderr).strip()}")
        _update_state(paths, "postgres", {"cluster": f"{cluster['version']}/{cluster['name']}",
                                          "port": int(cluster["port"]), "started_at": _now()})
    _pg_ensure_role_and_db(params, cluster["port"], console)
    deadline = time.monotonic() + PG_READY_TIMEOUT_S
    while (error := _pg_connect_error(settings)) is not None:
        if time.monotonic() > deadline:
            raise StackError(f"PostgreSQL still refuses {masked_dsn(settings.database_url)}: {error}")
        time.sleep(0.5)
    _say(console, f"[bold]postgres[/]: {masked_dsn(settings.database_url)} answers")


def _warn_if_no_createdb(settings: Settings, console: Console | None) -> None:
    """Warn if the DSN's role cannot CREATE DATABASE (tests create one database per module)."""
    import psycopg

    with contextlib.suppress(psycopg.Error), psycopg.connect(settings.database_url, connect_timeout=3) as conn:
        row = conn.execute("SELECT rolcreatedb OR rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()
        if row is not None and not row[0]:
            _say(console, "[yellow]postgres[/]: the role cannot CREATE DATABASE; tests that create "
                          "their own database will fail (ALTER ROLE ... CREATEDB)")


# --------------------------------------------------------------------------------------------
# S3 (moto behind tapeline.s3server's signature gate)


def s3_server_command(host: str, port: int) -> list[str]:
    """The command line of the local object store (`tapeline.s3server`) on host:port, run by this
    interpreter (its environment has moto)."""
    return [sys.executable, "-m", "tapeline.s3server", "-H", host, "-p", str(port)]


def s3_server_env(settings: Settings) -> dict[str, str]:
    """The environment of the local object store: this process's, with the credentials it accepts
    and the bucket whose `published/` prefix anonymous GET/HEAD may read taken from `settings` (in the
    environment, never on the command line, where `ps` would show the secret)."""
    return {**os.environ, "TAPELINE_S3_ACCESS_KEY": settings.s3_access_key,
            "TAPELINE_S3_SECRET_KEY": settings.s3_secret_key, "TAPELINE_S3_BUCKET": settings.s3_bucket}


def _s3_answers(settings: Settings, timeout_s: float = 3.0) -> tuple[bool, str | None]:
    """True if an HTTP server answers at the S3 endpoint (any HTTP status counts as an answer)."""
    try:
        with urllib.request.urlopen(settings.s3_endpoint, timeout=timeout_s):
            return True, None
    except urllib.error.HTTPError:
        return True, None
    except (urllib.error.URLError, OSError) as exc:
        return False, str(getattr(exc, "reason", exc))


def _s3_client(settings: Settings):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=settings.s3_endpoint, region_name=settings.s3_region,
                        aws_access_key_id=settings.s3_access_key, aws_secret_access_key=settings.s3_secret_key,
                        config=Config(retries={"max_attempts": 3, "mode": "standard"},
                                      connect_timeout=5, read_timeout=30))


def public_read_policy(bucket: str, prefix: str = "published/") -> dict[str, Any]:
    """The bucket policy that makes objects under prefix, and only those, anonymously readable."""
    return {
        "Version": "2012-10-17",
        "Statement": [{
            "Sid": "PublicReadPublished",
            "Effect": "Allow",
            "Principal": "*",
            "Action": "s3:GetObject",
            "Resource": f"arn:aws:s3:::{bucket}/{prefix}*",
        }],
    }


def _ensure_bucket(settings: Settings, console: Console | None) -> None:
    """Create `settings.s3_bucket` if missing and give it the published-prefix read policy if it has none."""
    from botocore.exceptions import ClientError

    s3 = _s3_client(settings)
    bucket = settings.s3_bucket
    try:
        s3.head_bucket(Bucket=bucket)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise StackError(f"Checking bucket {bucket} at {settings.s3_endpoint} failed: {exc}") from exc
        extra = ({} if settings.s3_region == "us-east-1"
                 else {"CreateBucketConfiguration": {"LocationConstraint": settings.s3_region}})
        s3.create_bucket(Bucket=bucket, **extra)
        _say(console, f"[bold]s3[/]: created bucket {bucket}")
    try:
        s3.get_bucket_policy(Bucket=bucket)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") != "NoSuchBucketPolicy":
            raise StackError(f"Reading the policy of bucket {bucket} failed: {exc}") from exc
        s3.put_bucket_policy(Bucket=bucket, Policy=json.dumps(public_read_policy(bucket)))
        _say(console, f"[bold]s3[/]: {bucket}/published/* is publicly readable; everything else is private")


def _up_s3(settings: Settings, paths: StackPaths, console: Console | None) -> None:
    """Make the S3 endpoint answer (reuse, or start `tapeline.s3server`) and ensure the bucket.

    Raises:
        StackError: the server exits, or does not answer within S3_READY_TIMEOUT_S.
    """
    pid = _owned_pid(paths.s3_pid, _s3_markers(settings))
    proc = None
    if pid is not None:
        _say(console, f"[bold]s3[/]: tapeline.s3server already running (pid {pid})")
    elif _s3_answers(settings)[0]:
        _say(console, f"[bold]s3[/]: {settings.s3_endpoint} answers; reusing it")
        _update_state(paths, "s3", None)
    else:
        parts = urlsplit(settings.s3_endpoint)
        host, port = _host_port(parts.netloc, 443 if parts.scheme == "https" else 80)
        paths.s3.mkdir(parents=True, exist_ok=True)
        proc = _spawn(s3_server_command(host, port), paths.s3_log, paths.s3_pid, cwd=paths.s3,
                      env=s3_server_env(settings))
        _say(console, f"[bold]s3[/]: started tapeline.s3server pid {proc.pid} on {settings.s3_endpoint} "
                      "(moto, objects in memory; signed requests only, anonymous reads of published/)")
        _update_state(paths, "s3", {"pid": proc.pid, "started_at": _now(), "endpoint": settings.s3_endpoint,
                                    "log": str(paths.s3_log)})
    deadline = time.monotonic() + S3_READY_TIMEOUT_S
    while not (answer := _s3_answers(settings))[0]:
        if proc is not None and proc.poll() is not None:
            raise StackError(f"tapeline.s3server exited with code {proc.returncode}. See {paths.s3_log}:\n"
                             f"{_tail(paths.s3_log)}")
        if time.monotonic() > deadline:
            raise StackError(f"{settings.s3_endpoint} did not answer within {S3_READY_TIMEOUT_S:.0f} s "
                             f"({answer[1]}). See {paths.s3_log}:\n{_tail(paths.s3_log)}")
        time.sleep(0.2)
    _ensure_bucket(settings, console)


# --------------------------------------------------------------------------------------------
# Public API


def up(settings: Settings, console: Console | None = None) -> dict[str, Any]:
    """Bring up Kafka, PostgreSQL and S3 for `settings`, check ffmpeg, and create the topics.

    Idempotent: whatever already answers is reused (nothing is started twice, nothing existing is
    recreated); only what is missing is started and then recorded in `<home>/stack.json`.
    A cold start takes roughly 10-20 s (the broker's JVM dominates); a warm `up` about a second.

    Returns:
        `status(settings)` after everything is up.

    Raises:
        StackError: a service could not be started or does not answer; the message names the fix
            or the log file.
    """
    paths = _paths(settings)
    with _locked(paths):
        check_ffmpeg()
        started = time.monotonic()
        kafka = _start_kafka(settings, paths, console)  # the JVM boots while PG and S3 come up
        _up_postgres(settings, paths, console)
        _up_s3(settings, paths, console)
        _wait_for_kafka(settings, paths, kafka)
        _say(console, f"[bold]kafka[/]: ready on {settings.kafka_bootstrap}"
                      + (f" ({time.monotonic() - started:.1f} s after start)" if kafka is not None else ""))
        ensure_topics(settings)
        _say(console, f"[bold]kafka[/]: {len(settings.all_topics())} topics present "
                      f"(prefix {settings.topic_prefix!r})")
    return status(settings)


def status(settings: Settings) -> dict[str, Any]:
    """Report each service's address, whether it answers, and whether the stack started it.

    Returns a JSON-serialisable dict: `{"home": ..., "kafka": {...}, "postgres": {...}, "s3": {...},
    "ffmpeg": {...}}`; each service has `address` and `up` (bool); Kafka and S3 have `pid` (int or
    None: the stack's own process, alive) and `started_by_stack`; PostgreSQL has `cluster` and
    `started_by_stack` (the stack started the Debian cluster); `error` says why a service is down.
    The PostgreSQL address is the DSN with the password masked. Never raises for a down service.
    Takes up to ~10 s when services are down (connection timeouts), well under a second when up.
    """
    paths = _paths(settings)
    state = _read_state(paths)

    kafka_pid = _owned_pid(paths.kafka_pid, _kafka_markers(paths))
    kafka_up, kafka_error = _kafka_answers(settings)
    kafka = {"address": settings.kafka_bootstrap, "up": kafka_up, "pid": kafka_pid,
             "started_by_stack": kafka_pid is not None, "log": str(paths.kafka_log) if kafka_pid else None}
    if kafka_error:
        kafka["error"] = kafka_error

    pg_error = _pg_connect_error(settings)
    pg_state = state.get("postgres") or {}
    postgres = {"address": masked_dsn(settings.database_url), "up": pg_error is None,
                "cluster": pg_state.get("cluster"), "started_by_stack": bool(pg_state)}
    if pg_error:
        postgres["error"] = pg_error

    s3_pid = _owned_pid(paths.s3_pid, _s3_markers(settings))
    s3_up, s3_error = _s3_answers(settings)
    s3 = {"address": settings.s3_endpoint, "bucket": settings.s3_bucket, "up": s3_up, "pid": s3_pid,
          "started_by_stack": s3_pid is not None, "log": str(paths.s3_log) if s3_pid else None}
    if s3_error:
        s3["error"] = s3_error

    version = _ffmpeg_version()
    ffmpeg = {"address": shutil.which("ffmpeg"), "version": version, "up": version is not None,
              "ffprobe": shutil.which("ffprobe")}
    if version is None or ffmpeg["ffprobe"] is None:
        ffmpeg["up"] = False
        ffmpeg["error"] = "ffmpeg/ffprobe missing: apt-get install -y ffmpeg"

    return {"home": str(paths.home), "kafka": kafka, "postgres": postgres, "s3": s3, "ffmpeg": ffmpeg}


def down(settings: Settings, console: Console | None = None) -> None:
    """Stop what the stack started, and nothing else.

    Kafka and moto_server are stopped by the pid in their pid file, only if that process is alive
    and still runs the command the stack launched (SIGTERM, then SIGKILL after STOP_TIMEOUT_S
    seconds); a stale pid file is removed without signalling anything. The PostgreSQL cluster is
    stopped (`pg_ctlcluster ... stop`) only if `stack.json` records that the stack started it.
    Kafka's data stays on disk; moto's objects are gone (they lived in memory).

    Raises:
        StackError: `pg_ctlcluster stop` failed.
    """
    paths = _paths(settings)
    if not paths.home.is_dir():
        return
    with _locked(paths):
        for name, pid_file, markers in (("kafka", paths.kafka_pid, _kafka_markers(paths)),
                                        ("s3", paths.s3_pid, _s3_markers(settings))):
            pid = _owned_pid(pid_file, markers)
            if pid is not None:
                _stop_pid(pid, name, console)
            elif pid_file.exists():
                _say(console, f"[bold]{name}[/]: stale pid file {pid_file} (process gone or not ours); removing it")
            else:
                _say(console, f"[bold]{name}[/]: not started by the stack; leaving it alone")
            pid_file.unlink(missing_ok=True)
            _update_state(paths, name, None)

        pg_state = _read_state(paths).get("postgres")
        if pg_state:
            version, _, name = pg_state["cluster"].partition("/")
            _say(console, f"[bold]postgres[/]: stopping cluster {pg_state['cluster']} (the stack started it)")
            result = subprocess.run(["pg_ctlcluster", version, name, "stop"], capture_output=True, text=True)
            if result.returncode != 0 and "is not running" not in (result.stdout + result.stderr):
                raise StackError(f"`pg_ctlcluster {version} {name} stop` failed:\n"
                                 f"{(result.stdout + result.stderr).strip()}")
            _update_state(paths, "postgres", None)
        else:
            _say(console, "[bold]postgres[/]: not started by the stack; leaving it alone")


# --------------------------------------------------------------------------------------------
# CLI: `tapeline stack up|status|down|topics`

stack_app = typer.Typer(help="The local stack of real services (Kafka KRaft, PostgreSQL, S3 via moto, "
                             "ffmpeg) without Docker; state and logs under the settings' home directory.",
                        no_args_is_help=True)


def _print_table(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"Tapeline local stack ({report['home']})")
    for column in ("service", "up", "address", "started by stack", "detail"):
        table.add_column(column)
    for name in ("kafka", "postgres", "s3", "ffmpeg"):
        svc = report[name]
        if name in ("kafka", "s3"):
            started = f"yes (pid {svc['pid']})" if svc["pid"] else "no"
        elif name == "postgres":
            started = f"yes ({svc['cluster']})" if svc["started_by_stack"] else "no"
        else:
            started = "-"
        detail = svc.get("error") or (f"version {svc['version']}" if name == "ffmpeg"
                                      else f"bucket {svc['bucket']}" if name == "s3" else svc.get("log") or "")
        table.add_row(name, "[green]up[/]" if svc["up"] else "[red]down[/]", str(svc["address"]), started,
                      str(detail))
    console.print(table)


@stack_app.command("up")
def up_command() -> None:
    """Start (or reuse) Kafka, PostgreSQL and S3, check ffmpeg, create the topics."""
    err = Console(stderr=True)
    try:
        report = up(Settings(), console=err)
    except StackError as exc:
        err.print(f"[red]stack up failed:[/] {exc}")
        raise typer.Exit(1) from exc
    _print_table(report, Console())


@stack_app.command("status")
def status_command(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Show each service's address, whether it answers, and whether the stack started it.

    The PostgreSQL DSN is shown with its password masked. Exit code 0 either way.
    """
    report = status(Settings())
    if as_json:
        typer.echo(json.dumps(report))
    else:
        _print_table(report, Console())


@stack_app.command("down")
def down_command() -> None:
    """Stop only what `stack up` started (Kafka data stays on disk; moto's objects are lost)."""
    err = Console(stderr=True)
    try:
        down(Settings(), console=err)
    except StackError as exc:
        err.print(f"[red]stack down failed:[/] {exc}")
        raise typer.Exit(1) from exc


@stack_app.command("topics")
def topics_command() -> None:
    """Create any missing topic (LogAppendTime and unlimited retention where `ensure_topics` says)."""
    settings = Settings()
    try:
        ensure_topics(settings)
    except StackError as exc:
        Console(stderr=True).print(f"[red]creating topics failed:[/] {exc}")
        raise typer.Exit(1) from exc
    for topic, partitions in settings.all_topics().items():
        typer.echo(f"{topic}\t{partitions} partitions")

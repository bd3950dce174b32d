"""The local Kafka cluster from the pinned jars (`stack/pom.xml`): one combined KRaft node by
default, or `settings.kafka_brokers` nodes (each a broker and a controller, ports and files of its
own) that replicate every topic as production does."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from tapeline.settings import PROJECT_ROOT, Settings
from tapeline.kafka import admin_client, cluster_answers
from devstack import kafka_secure
from tapeline.home import KAFKA_JVM_FLAGS, java, StackError, HomePaths, host_port, log_errors, now_iso, owned_pid, port_open, say, spawn, tail, update_state


KAFKA_READY_TIMEOUT_S = 120.0
"""How long `up` waits for a freshly started broker to answer a metadata request, seconds."""
KAFKA_HEAP = ("-Xmx512m", "-Xms256m")
"""A modest broker heap on purpose: a 2-core CI machine must leave room for ffmpeg."""
POM = PROJECT_ROOT / "stack" / "pom.xml"
"""The Maven project that resolves the Kafka broker jars."""

# --------------------------------------------------------------------------------------------
# Kafka


@dataclass(frozen=True)
class KafkaNode:
    """One node of the local Kafka cluster: a combined broker and controller with its own ports and
    files. A one-node stack keeps its files directly in `<home>/kafka/`; a cluster's node n in
    `<home>/kafka/node-<n>/`."""

    node_id: int
    host: str
    port: int
    controller_port: int
    dir: Path

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def data(self) -> Path:
        return self.dir / "data"

    @property
    def properties(self) -> Path:
        return self.dir / "server.properties"

    @property
    def log(self) -> Path:
        return self.dir / "kafka.log"

    @property
    def pid_file(self) -> Path:
        return self.dir / "kafka.pid"

    @property
    def markers(self) -> tuple[str, ...]:
        """What the node's command line holds (`owned_pid`): the broker class and its properties file."""
        return ("kafka.Kafka", str(self.properties))


def secured(settings: Settings) -> bool:
    """Whether the local stack runs secured (`stack up --secure`): its clients' settings name a protocol
    other than PLAINTEXT (`kafka_secure.client_settings`)."""
    return settings.kafka_security_protocol != "PLAINTEXT"


def stack_client(settings: Settings, paths: HomePaths) -> Settings:
    """The settings the stack's own admin calls use: `settings`, or on a secured stack its `admin` principal."""
    return kafka_secure.admin_settings(settings, paths) if secured(settings) else settings


def kafka_nodes(settings: Settings, paths: HomePaths) -> list[KafkaNode]:
    """The nodes `settings.kafka_brokers` asks for (`Settings.kafka_nodes` gives their ports). A secured
    stack is one node whose files are in `<home>/kafka/secure/` (never mixed with the plain node's data).

    Raises StackError for a secured stack of more than one node (not built)."""
    if secured(settings):
        if settings.kafka_brokers != 1 or settings.kafka_security_protocol != "SASL_SSL":
            raise StackError("the secured local stack is one node serving SASL_SSL (`tapeline stack up --secure`); "
                             f"asked for {settings.kafka_brokers} nodes with {settings.kafka_security_protocol}")
        (node_id, host, port, controller), = settings.kafka_nodes
        return [KafkaNode(node_id, host, port, controller, kafka_secure.secure_dir(paths))]
    single = settings.kafka_brokers == 1
    return [KafkaNode(node_id, host, port, controller, paths.kafka if single else paths.kafka / f"node-{node_id}")
            for node_id, host, port, controller in settings.kafka_nodes]


def _server_properties(settings: Settings, node: KafkaNode, nodes: list[KafkaNode]) -> str:
    """`_plain_server_properties`, with a secured stack's listeners, users and authorizer in place of the
    plain listeners (`kafka_secure.listener_properties`)."""
    text = _plain_server_properties(settings, node, nodes)
    if not secured(settings):
        return text
    plain = ("listeners=", "advertised.listeners=", "listener.security.protocol.map=", "inter.broker.listener.name=",
             "controller.listener.names=")
    kept = "\n".join(line for line in text.splitlines() if not line.startswith(plain))
    credentials = kafka_secure.ensure_credentials(node.dir)
    return kept + "\n\n" + kafka_secure.listener_properties(node.host, node.port, node.controller_port, node.dir,
                                                            credentials)


def _plain_server_properties(settings: Settings, node: KafkaNode, nodes: list[KafkaNode]) -> str:
    """A node's server.properties: combined KRaft broker and controller on loopback, in a static
    quorum of every node. With one node nothing is replicated; with three, the internal topics and the
    defaults are those of production (replication factor 3, min.insync.replicas 2, unclean leader
    election off: docs/design.md "Production settings")."""
    voters = ",".join(f"{n.node_id}@{n.host}:{n.controller_port}" for n in nodes)
    replicas = min(settings.replication_factor, len(nodes))
    min_isr = min(settings.min_insync_replicas, replicas)
    controller = f"{node.host}:{node.controller_port}"
    return f"""\
# Written by `tapeline stack up` (devstack/kafka_nodes.py) on every start; edits are overwritten.
# Node {node.node_id} of {len(nodes)}: a combined KRaft broker and controller for local development and
# tests. {"ONE node, so nothing is replicated. Production runs replication factor 3 and min.insync.replicas=2."
         if len(nodes) == 1 else f"Replication factor {replicas}, min.insync.replicas {min_isr}, as production."}

# This process is both a broker and a controller (static quorum: every node votes).
process.roles=broker,controller
node.id={node.node_id}
controller.quorum.voters={voters}
listeners=PLAINTEXT://{node.host}:{node.port},CONTROLLER://{controller}
advertised.listeners=PLAINTEXT://{node.host}:{node.port}
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
# Topic data and KRaft metadata stay in the project-owned home directory.
log.dirs={node.data}

# The internal topics (consumer offsets, transaction state, share-group state) cannot have more
# replicas, or a larger in-sync minimum, than there are brokers.
offsets.topic.replication.factor={replicas}
transaction.state.log.replication.factor={replicas}
transaction.state.log.min.isr={min_isr}
share.coordinator.state.topic.replication.factor={replicas}
share.coordinator.state.topic.min.isr={min_isr}
min.insync.replicas={min_isr}
# A replica that was not in sync never becomes leader: an outage, never a silent loss (the default).
unclean.leader.election.enable=false

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
default.replication.factor={replicas}
"""


def _ensure_kafka_libs(paths: HomePaths, console: Console | None) -> None:
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
    say(console, f"[bold]kafka[/]: resolving broker jars from Maven Central into {paths.kafka_libs}")
    if paths.kafka_libs.is_dir():
        shutil.rmtree(paths.kafka_libs)  # no stale jar of another version stays on the classpath
    paths.kafka_libs.mkdir(parents=True)
    result = subprocess.run([mvn, "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
                             f"-DoutputDirectory={paths.kafka_libs}"], capture_output=True, text=True)
    if result.returncode != 0 or not any(paths.kafka_libs.glob("kafka_2.13-*.jar")):
        raise StackError(f"Maven could not fetch the Kafka jars (exit {result.returncode}):\n"
                         f"{(result.stdout + result.stderr)[-3000:]}")
    stamp.write_text(f"{pom_hash}\n")


def _kafka_cluster_id() -> str:
    """A random Kafka cluster id: a UUID in unpadded URL-safe base64, as `StorageTool random-uuid`
    prints it (and, like Kafka, never one starting with a dash)."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id


def _cluster_id(paths: HomePaths, nodes: list[KafkaNode]) -> str:
    """The cluster id every node is formatted with: a formatted node's (`meta.properties`), else new."""
    for node in nodes:
        meta = node.data / "meta.properties"
        if meta.is_file():
            for line in meta.read_text().splitlines():
                if line.startswith("cluster.id="):
                    return line.partition("=")[2].strip()
    return _kafka_cluster_id()


def _format_kafka_storage(paths: HomePaths, node: KafkaNode, cluster_id: str, console: Console | None,
                          extra: list[str] | None = None) -> bool:
    """Format a node's KRaft storage once with `cluster_id`; returns whether it formatted.

    The quorum is static (`controller.quorum.voters`), so the format runs without `--standalone`:
    Kafka refuses `--standalone` together with `controller.quorum.voters` (that flag is for a
    dynamic quorum configured with `controller.quorum.bootstrap.servers`). `extra`: more arguments
    (a secured node's `--add-scram` users).
    """
    if (node.data / "meta.properties").is_file():
        return False
    say(console, f"[bold]kafka[/]: formatting node {node.node_id} storage {node.data} (cluster id {cluster_id})")
    result = subprocess.run([java(), "-cp", f"{paths.kafka_libs}/*", "kafka.tools.StorageTool", "format",
                             "-t", cluster_id, "-c", str(node.properties), *(extra or [])],
                            capture_output=True, text=True, cwd=node.dir)
    if result.returncode != 0 or not (node.data / "meta.properties").is_file():
        output = (result.stdout + result.stderr)[-3000:]
        for argument in extra or []:  # the SCRAM passwords are on the command line: never in a message
            output = output.replace(argument, "--add-scram ***")
        raise StackError(f"Formatting Kafka storage failed (exit {result.returncode}):\n{output}")
    return True


def start_kafka_node(settings: Settings, paths: HomePaths, node: KafkaNode, nodes: list[KafkaNode],
                     console: Console | None = None) -> subprocess.Popen | None:
    """Start one node unless it runs or its port answers; returns the new process, if any. Writes its
    server.properties and formats its storage first (once). Fault tests use it to restart a node
    they killed."""
    pid = owned_pid(node.pid_file, node.markers)
    if pid is not None:
        say(console, f"[bold]kafka[/]: node {node.node_id} already running (pid {pid})")
        return None
    if port_open(node.host, node.port):
        if secured(settings):
            raise StackError(f"something that is not this stack's secured node already answers on {node.address} "
                             "(the plain stack? `tapeline stack down` first, then `tapeline stack up --secure`)")
        say(console, f"[bold]kafka[/]: something already answers on {node.address}; reusing it")
        return None
    node.pid_file.unlink(missing_ok=True)
    node.data.mkdir(parents=True, exist_ok=True)
    scram: list[str] = []
    if secured(settings):
        kafka_secure.ensure_tls(node.dir, node.host)
        scram = kafka_secure.scram_format_args(kafka_secure.ensure_credentials(node.dir))
    node.properties.write_text(_server_properties(settings, node, nodes))
    if scram:
        os.chmod(node.properties, 0o600)  # a secured node's holds the admin's password
    _format_kafka_storage(paths, node, _cluster_id(paths, nodes), console, scram)
    argv = [java(), *KAFKA_HEAP, *KAFKA_JVM_FLAGS, "-cp", f"{paths.kafka_libs}/*", "kafka.Kafka", str(node.properties)]
    proc = spawn(argv, node.log, node.pid_file, cwd=node.dir)
    say(console, f"[bold]kafka[/]: node {node.node_id} started pid {proc.pid} on {node.address}, log {node.log}")
    return proc


def start_kafka(settings: Settings, paths: HomePaths, console: Console | None) -> list[subprocess.Popen]:
    """Start every node that does not run yet (`start_kafka_node`); returns the new processes."""
    nodes = kafka_nodes(settings, paths)
    strangers = [n for n in nodes if owned_pid(n.pid_file, n.markers) is None and port_open(n.host, n.port)]
    if len(nodes) > 1 and strangers and not cluster_answers(settings, brokers=len(nodes))[0]:
        raise StackError(f"something that is not this stack's {len(nodes)}-node cluster already answers on "
                         f"{', '.join(n.address for n in strangers)} (a one-broker stack? `tapeline stack down` "
                         "first, then `tapeline stack up --brokers 3`)")
    _ensure_kafka_libs(paths, console)
    _warn_if_broker_logs_silent(paths, console)
    started = [proc for node in nodes if (proc := start_kafka_node(settings, paths, node, nodes, console))]
    if started:
        update_state(paths, "kafka", {"pids": [p.pid for p in started], "started_at": now_iso(),
                                       "bootstrap": settings.kafka_bootstrap_servers, "nodes": len(nodes),
                                       "secure": secured(settings)})
    elif not any(owned_pid(n.pid_file, n.markers) for n in nodes):
        update_state(paths, "kafka", None)  # every node answered without being ours: reused
    return started


def _warn_if_broker_logs_silent(paths: HomePaths, console: Console | None) -> None:
    """Warn when the jars bind no SLF4J logger: the broker would then log nothing, not even why it died.

    slf4j-simple 2.x needs slf4j-api 2.x; with Kafka's own slf4j-api 1.7 first, SLF4J falls back
    to its no-op logger. The fix is a direct `org.slf4j:slf4j-api:2.x` dependency in stack/pom.xml.
    """
    jars = [jar.name for jar in paths.kafka_libs.glob("slf4j-*.jar")]
    api_1 = any(name.startswith("slf4j-api-1.") for name in jars)
    simple_2 = any(name.startswith("slf4j-simple-2.") for name in jars)
    if api_1 and simple_2:
        say(console, "[yellow]kafka[/]: slf4j-api 1.x with slf4j-simple 2.x in the broker jars: the broker "
                      "will log nothing (fix: add org.slf4j:slf4j-api 2.x to stack/pom.xml; the jars are "
                      "fetched again on the next start)")


def wait_for_kafka(settings: Settings, paths: HomePaths, procs: list[subprocess.Popen],
                    timeout_s: float = KAFKA_READY_TIMEOUT_S) -> float:
    """Wait until the cluster serves metadata with every node registered; returns the seconds waited.

    Raises:
        StackError: a node this call started exited, or the cluster did not answer within timeout_s
            seconds; the message names the log file and shows its tail.
    """
    nodes = kafka_nodes(settings, paths)
    logs = {proc.pid: node.log for proc in procs for node in nodes
            if node.pid_file.is_file() and node.pid_file.read_text().strip() == str(proc.pid)}
    started = time.monotonic()
    deadline = started + timeout_s
    reason: str | None = None
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                log = logs.get(proc.pid, nodes[0].log)
                raise StackError(f"Kafka exited with code {proc.returncode} while starting. "
                                 f"{log_errors(log)}See {log}:\n{tail(log)}")
        ok, reason = cluster_answers(stack_client(settings, paths), timeout_s=3.0, brokers=len(nodes))
        if ok:
            return time.monotonic() - started
        time.sleep(0.5)
    log = nodes[0].log
    raise StackError(f"Kafka did not answer on {settings.kafka_bootstrap_servers} within {timeout_s:.0f} s "
                     f"({reason}). {log_errors(log)}See {log}:\n{tail(log)}")


def _quorum(nodes: list[KafkaNode]) -> dict[str, Any]:
    """The controller quorum as the nodes last wrote it (`<data>/__cluster_metadata-0/quorum-state`,
    KRaft's own election record): `{"voters": [ids], "leader": id or None, "epoch": int or None}`,
    the leader of the highest epoch any node recorded."""
    best: tuple[int, int] | None = None
    for node in nodes:
        try:
            state = json.loads((node.data / "__cluster_metadata-0" / "quorum-state").read_text())
        except (OSError, ValueError):
            continue
        if state.get("leaderId", -1) >= 0 and (best is None or state.get("leaderEpoch", -1) > best[1]):
            best = (state["leaderId"], state.get("leaderEpoch", -1))
    return {"voters": [n.node_id for n in nodes], "leader": best[0] if best else None,
            "epoch": best[1] if best else None}


def kafka_status(settings: Settings, paths: HomePaths) -> dict[str, Any]:
    """The cluster's status for `stack status`: `address`, `up`, `pid` (node 1's, when the stack runs
    it), `started_by_stack`, `log`, `error`; on a secured stack `security` (protocol, mechanism, the CA
    and credentials files) and `client_error` when the cluster answers the stack's admin but refuses
    this environment's principal (why: `cluster_answers`); and `nodes` (each node's id, address, controller address,
    whether its port answers, its pid when the stack runs it, its log), `brokers_registered` (ids in
    the metadata), `quorum` (`_quorum`) and `under_replicated_partitions` (partitions with fewer
    in-sync replicas than replicas; None when the cluster does not answer)."""
    nodes = kafka_nodes(settings, paths)
    client = stack_client(settings, paths)
    up, error = cluster_answers(client)
    rows, registered, under = [], [], None
    for node in nodes:
        pid = owned_pid(node.pid_file, node.markers)
        rows.append({"node_id": node.node_id, "address": node.address,
                     "controller": f"{node.host}:{node.controller_port}", "up": port_open(node.host, node.port),
                     "pid": pid, "log": str(node.log) if pid else None})
    if up:
        try:
            metadata = admin_client(client).list_topics(timeout=5)
            registered = sorted(metadata.brokers)
            under = sum(1 for topic in metadata.topics.values() for p in topic.partitions.values()
                        if len(p.isrs) < len(p.replicas))
        except Exception as exc:  # the cluster went away between the two calls
            error = str(exc)
    first = rows[0]
    report = {"address": settings.kafka_bootstrap_servers, "up": up, "pid": first["pid"],
              "started_by_stack": any(r["pid"] for r in rows), "log": first["log"], "nodes": rows,
              "brokers_registered": registered, "quorum": _quorum(nodes), "under_replicated_partitions": under}
    if secured(settings):
        if up:  # the stack answers its admin: does it answer this environment's own principal?
            ok, refusal = cluster_answers(settings)
            if not ok:
                report["client_error"] = refusal
        report["security"] = {"protocol": settings.kafka_security_protocol, "mechanism": settings.kafka_sasl_mechanism,
                              "ca": str(settings.kafka_ssl_ca_location),
                              "credentials_file": str(settings.kafka_credentials_file)}
    if error:
        report["error"] = error
    return report

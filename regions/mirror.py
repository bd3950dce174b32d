"""The log mirror: Kafka's MirrorMaker 2 in dedicated mode copying the active region's topics into
the standby region.

`tapeline stack up --region b` writes `<region B home>/mirror/mm2.properties` (`mm2_properties`, a
pure rendering of both regions' settings) and runs `org.apache.kafka.connect.mirror.MirrorMaker` on
the stack's Kafka jars (`stack/pom.xml` pins `connect-mirror` at the broker's version), for the
flow `a->b` only (`--clusters b`: this process writes to region B). After a failover to region B,
`tapeline region rejoin a --as-standby` (regions/rejoin.py) runs the flow `b->a` the same way, its
files under region A's home (`--clusters a`). The cluster aliases are the regions' names. Its log is
`<target home>/mirror/mirror.log`, its pid `mirror/mirror.pid`; `stack down --region b`, a failover
into the target, or a rejoin stops it. What it copies, and why each setting, is in docs/regions.md
("The log mirror", "Failback").
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from pydantic import SecretStr

from rich.console import Console

from tapeline.settings import Settings

from tapeline.home import KAFKA_JVM_FLAGS, java, StackError, HomePaths, log_errors, now_iso, owned_pid, say, spawn, tail, update_state, stop_owned

MIRROR_MAIN = "org.apache.kafka.connect.mirror.MirrorMaker"
MIRROR_HEAP = ("-Xmx256m", "-Xms64m")
"""A small heap: the mirror copies bytes, and the 2-core machine runs two brokers beside it."""
HEARTBEATS_TOPIC = "heartbeats"
"""Where MM2's heartbeat connector writes in the target cluster, once a second (identity policy: no prefix)."""
MIRROR_READY_TIMEOUT_S = 90.0
"""How long `up` waits for the mirror's first heartbeat in region B, seconds."""


def mirrored_topics(settings: Settings) -> list[str]:
    """The topics the standby region receives: every topic of the contract (`Settings.all_topics`): the uploads,
    the lifecycle (`<prefix>.jobs`), every stage's work topics and the dead letters; not the region
    epochs (`<prefix>.regions`: each region's own, written by a failover)."""
    return sorted(set(settings.all_topics()) - {settings.regions_topic})


def _property_value(text: str) -> str:
    """`text` as a java.util.Properties value: a backslash is an escape there, so it is doubled."""
    return text.replace("\\", "\\\\")


JAAS_MODULES = {"SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
                "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
                "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule"}
"""The Java login module of each SASL mechanism MirrorMaker 2 is configured for (Kafka's
`sasl.jaas.config`, docs "Authentication using SASL")."""


def _jaas_quoted(text: str) -> str:
    """`text` inside a JAAS option's double quotes: backslash and double quote escaped."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def mm2_security(alias: str, settings: Settings, principal: tuple[str | None, SecretStr | None]) -> list[str]:
    """The client security lines of cluster `alias` for MirrorMaker 2 (Java client names, prefixed by
    the alias: `<alias>.security.protocol`, ...) from `settings`' Kafka security and the mirror's
    `principal` (user name, password). Pure. Nothing for PLAINTEXT.

    Raises ValueError for what is not built for the mirror: OAUTHBEARER and a client certificate
    (mutual TLS); and for a SASL protocol without a principal."""
    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return []
    lines = [f"# Region {alias}'s Kafka is secured (docs/security.md): the mirror's own principal.",
             f"{alias}.security.protocol = {protocol}"]
    if settings.kafka_ssl_certificate_location is not None:
        raise ValueError("MirrorMaker 2 with a client certificate (mutual TLS) is not built: use SASL_SSL for the mirror")
    if protocol.startswith("SASL_"):
        mechanism = settings.kafka_sasl_mechanism
        if mechanism not in JAAS_MODULES:
            raise ValueError(f"MirrorMaker 2 with SASL {mechanism} is not built (SCRAM-SHA-512, SCRAM-SHA-256, PLAIN)")
        username, password = principal
        if not username or password is None:
            raise ValueError(f"region {alias}'s Kafka is {protocol}: the mirror needs a principal (role \"mirror\" in "
                             "TAPELINE_KAFKA_CREDENTIALS_FILE, or TAPELINE_KAFKA_SASL_USERNAME/PASSWORD)")
        user, secret = (_jaas_quoted(value) for value in (username, password.get_secret_value()))
        jaas = f'{JAAS_MODULES[mechanism]} required username="{user}" password="{secret}";'
        lines += [f"{alias}.sasl.mechanism = {mechanism}", f"{alias}.sasl.jaas.config = {_property_value(jaas)}"]
    if protocol.endswith("SSL") and settings.kafka_ssl_ca_location is not None:
        lines += [f"{alias}.ssl.truststore.type = PEM",
                  f"{alias}.ssl.truststore.location = {_property_value(str(settings.kafka_ssl_ca_location))}"]
    return lines


def mm2_properties(source: Settings, target: Settings,
                   principals: dict[str, tuple[str | None, SecretStr | None]] | None = None) -> str:
    """The mm2.properties of the flow `source` (the active region) -> `target` (the standby). Pure.

    Clusters are aliased by the regions' names (`source.region`, `target.region`: `a, b` for the
    flow a->b, `b, a` for b->a); `<source>-><target>` is enabled and the reverse flow disabled. The
    topic list is every name of `mirrored_topics(source)` as an exact regex (MM2 reads `topics` as a
    list of regexes). Config names are MirrorMaker 2's own (MirrorMakerConfig, MirrorSourceConfig,
    MirrorCheckpointConfig, MirrorHeartbeatConfig of Kafka 4.1); docs/regions.md explains each choice.
    A secured cluster gets the mirror's principal (`principals[region]`, `mm2_security`); the file then
    holds a password and is written readable by its owner only. Raises ValueError when both settings
    name the same region, or from `mm2_security`.
    """
    s, t = source.region, target.region
    if s == t:
        raise ValueError(f"a mirror needs two regions, got {s!r} twice")
    topics = ", ".join(re.escape(topic) for topic in mirrored_topics(source))
    groups = re.escape(source.app_name) + r"\..*"
    rf = target.replication_factor
    lines = [
        "# Written by regions/mirror.py (`tapeline stack up --region b` or `tapeline region rejoin`) on",
        f"# every start; edits are overwritten. MirrorMaker 2, dedicated mode: region {s} -> region {t}",
        "# (docs/regions.md).",
        f"clusters = {s}, {t}",
        f"{s}.bootstrap.servers = {source.kafka_bootstrap_servers}",
        f"{t}.bootstrap.servers = {target.kafka_bootstrap_servers}",
        "",
        f"# One direction: {t} is the standby.",
        f"{s}->{t}.enabled = true",
        f"{t}->{s}.enabled = false",
        f"{s}->{t}.topics = {_property_value(topics)}",
        "# Topic names are kept (tapeline.jobs stays tapeline.jobs), so the standby's processors need no",
        f"# other settings. Identity names cannot detect cycles: never enable {t}->{s} beside {s}->{t}.",
        "replication.policy.class = org.apache.kafka.connect.mirror.IdentityReplicationPolicy",
        "",
        f"# Committed records only: an aborted transaction in {s} never reaches {t} (every consumer on {s}).",
        f"{s}.consumer.isolation.level = read_committed",
        f"# Every record MM2 writes to {t} is acknowledged by all in-sync replicas (idempotent producer).",
        f"{t}.producer.acks = all",
        "",
        f"# Region {t}'s topics are created by its own stack (ensure_topics: partitions, retention,",
        f"# LogAppendTime), before the mirror starts; their configs are {t}'s own, never copied from {s}.",
        "sync.topic.configs.enabled = false",
        "# ACLs are each region's own (a secured stack makes its roles' ACLs itself: docs/security.md).",
        "sync.topic.acls.enabled = false",
        *(line for region, settings in ((s, source), (t, target))
          for line in mm2_security(region, settings, (principals or {}).get(region, (None, None)))),
        "# New topics (a stage added to the registry) are picked up within this many seconds.",
        "refresh.topics.interval.seconds = 30",
        "",
        f"# Heartbeats: one record a second in {t}'s `heartbeats` topic; `tapeline region status` shows the",
        "# newest one's age (the mirror is alive) beside the lag.",
        "emit.heartbeats.enabled = true",
        "emit.heartbeats.interval.seconds = 1",
        f"# Checkpoints: {s}'s consumer-group offsets of this deployment translated into {t}'s offsets",
        f"# (topic {s}.checkpoints.internal in {t}), for a failover to start {t}'s workers near where {s}'s",
        f"# stopped. They are not written into {t}'s groups (sync.group.offsets: the failover decides).",
        "emit.checkpoints.enabled = true",
        "emit.checkpoints.interval.seconds = 5",
        f"{s}->{t}.groups = {_property_value(groups)}",
        "sync.group.offsets.enabled = false",
        f"# The offset syncs live in {t}, so the mirror writes nothing into region {s}.",
        "offset-syncs.topic.location = target",
        "",
        "# Every plugin MM2 needs ships a ServiceLoader manifest: skip the reflective classpath scan",
        "# (about 10 s of a 2-core machine's start).",
        "plugin.discovery = service_load",
        "",
        f"# Region {t} runs {rf} broker(s): no internal topic may ask for more replicas.",
        f"replication.factor = {rf}",
        f"heartbeats.topic.replication.factor = {rf}",
        f"checkpoints.topic.replication.factor = {rf}",
        f"offset-syncs.topic.replication.factor = {rf}",
        f"offset.storage.replication.factor = {rf}",
        f"config.storage.replication.factor = {rf}",
        f"status.storage.replication.factor = {rf}",
        "",
    ]
    return "\n".join(lines)


def mirror_internal_topics(source_region: str) -> list[str]:
    """The topics MirrorMaker 2 keeps in the target cluster of a flow from `source_region` (identity
    policy, offset syncs in the target): Connect's offsets, status and configs, the checkpoints and
    the offset syncs. `heartbeats` is not among them (shared by every flow into the cluster). A
    standby whose own topics are recreated must lose these too: their source offsets would make a
    new mirror resume instead of copying the active region's log from its start."""
    return [f"mm2-offsets.{source_region}.internal", f"mm2-status.{source_region}.internal",
            f"mm2-configs.{source_region}.internal", f"{source_region}.checkpoints.internal",
            f"mm2-offset-syncs.{source_region}.internal"]


def _markers(paths: HomePaths) -> tuple[str, ...]:
    return (MIRROR_MAIN, str(paths.mirror / "mm2.properties"))


def newest_heartbeat_ms(target: Settings, timeout_s: float = 5.0) -> int | None:
    """Broker time (ms) of the newest record in `target`'s heartbeats topic (the mirror into it), or None
    when it has none or does not answer."""
    from tapeline import kafka_scan

    consumer = kafka_scan.committed_reader(target, "mirror-probe", **{"socket.timeout.ms": 5000})
    try:
        partitions = kafka_scan.existing_topics(consumer, timeout_s).get(HEARTBEATS_TOPIC, 0)
        last = {}  # the newest record of each partition
        for partition in range(partitions):
            low, high = kafka_scan.offsets(consumer, HEARTBEATS_TOPIC, partition, timeout_s)
            if high > low:
                last[(HEARTBEATS_TOPIC, partition)] = (high - 1, high)
        stamps: list[int] = []
        kafka_scan.scan(consumer, last, lambda message: stamps.append(kafka_scan.broker_millis(message)) or False,
                        timeout_s)
        return max(stamps) if stamps else None
    except Exception:  # the broker does not answer: no heartbeat known
        return None
    finally:
        consumer.close()


def up_mirror(source: Settings, target: Settings, paths: HomePaths, console: Console | None) -> None:
    """Start MirrorMaker 2 for the flow `source.region` -> `target.region` (unless this stack's runs
    already), its files under `paths` (the target's home: `home_paths(target)`), with a fresh
    mm2.properties, and wait for its first heartbeat in the target.

    Raises:
        StackError: the jars lack connect-mirror; the process exits, or no heartbeat arrives within
            MIRROR_READY_TIMEOUT_S seconds (the message shows the log's first errors and tail).
    """
    properties, log, pid_file = paths.mirror / "mm2.properties", paths.mirror / "mirror.log", paths.mirror / "mirror.pid"
    pid = owned_pid(pid_file, _markers(paths))
    if pid is not None:
        say(console, f"[bold]mirror[/]: MirrorMaker 2 already running (pid {pid})")
        return
    if not any(paths.kafka_libs.glob("connect-mirror-[0-9]*.jar")):
        raise StackError(f"MirrorMaker 2 (connect-mirror) is not among the Kafka jars in {paths.kafka_libs}; "
                         "they come from stack/pom.xml: `tapeline stack up` fetches them again when it changed")
    paths.mirror.mkdir(parents=True, exist_ok=True)
    from domain.policy.kafka_access import MIRROR
    from tapeline.kafka import principal

    principals = {settings.region: principal(settings.model_copy(update={"kafka_role": MIRROR}))
                  for settings in (source, target)}
    properties.touch(mode=0o600)
    os.chmod(properties, 0o600)  # it may hold the mirror's password
    properties.write_text(mm2_properties(source, target, principals))
    argv = [java(), *MIRROR_HEAP, *KAFKA_JVM_FLAGS, "-cp", f"{paths.kafka_libs}/*", MIRROR_MAIN,
            str(properties), "--clusters", target.region]
    started_ms = int(time.time() * 1000)
    proc = spawn(argv, log, pid_file, cwd=paths.mirror)
    update_state(paths, "mirror", {"pid": proc.pid, "started_at": now_iso(), "log": str(log),
                                    "flow": f"{source.region} -> {target.region}",
                                    "source": source.kafka_bootstrap_servers, "topics": len(mirrored_topics(source))})
    say(console, f"[bold]mirror[/]: started MirrorMaker 2 pid {proc.pid} ({source.kafka_bootstrap_servers} -> "
                  f"{target.kafka_bootstrap_servers}, {len(mirrored_topics(source))} topics), log {log}")
    deadline = time.monotonic() + MIRROR_READY_TIMEOUT_S
    while (newest := newest_heartbeat_ms(target)) is None or newest < started_ms:
        if proc.poll() is not None:
            raise StackError(f"MirrorMaker 2 exited with code {proc.returncode}. {log_errors(log)}See {log}:\n"
                             f"{tail(log)}")
        if time.monotonic() > deadline:
            raise StackError(f"MirrorMaker 2 wrote no heartbeat to region {target.region} within {MIRROR_READY_TIMEOUT_S:.0f} s. "
                             f"{log_errors(log)}See {log}:\n{tail(log)}")
        time.sleep(1.0)
    say(console, f"[bold]mirror[/]: heartbeats arrive in region {target.region}")


def down_mirror(paths: HomePaths, console: Console | None) -> None:
    """Stop this stack's MirrorMaker 2 (by its pid file, only if that process is still the mirror)."""
    stop_owned(paths.mirror / "mirror.pid", _markers(paths), "mirror", console, quiet_when_absent=True)
    update_state(paths, "mirror", None)


def mirror_status(target: Settings, paths: HomePaths, enabled: bool) -> dict[str, Any]:
    """`{"up", "pid", "enabled", "log", "heartbeat_age_s", "address"}`: whether the mirror into `target`
    (its files under `paths`) runs, and how old the newest heartbeat in `target` is (None: none yet, or
    the target does not answer). `address` is the flow, e.g. `"a -> b"`."""
    pid = owned_pid(paths.mirror / "mirror.pid", _markers(paths))
    newest = newest_heartbeat_ms(target, timeout_s=3.0) if pid is not None else None
    age = None if newest is None else round(max(0.0, time.time() - newest / 1000.0), 1)
    source = "b" if target.region == "a" else "a"
    report = {"up": pid is not None, "pid": pid, "enabled": enabled, "address": f"{source} -> {target.region}",
              "started_by_stack": pid is not None, "log": str(paths.mirror / "mirror.log") if pid else None,
              "heartbeat_age_s": age}
    if pid is None and enabled:
        report["error"] = ("MirrorMaker 2 is not running (`tapeline stack up --region b`)" if target.region == "b"
                           else "MirrorMaker 2 is not running (`tapeline region rejoin a --as-standby`)")
    return report

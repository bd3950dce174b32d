"""The local dev stack and test harness: real Kafka (KRaft), PostgreSQL, an S3 endpoint and ffmpeg,
without Docker, plus what tests and benchmarks drive against them (`chaos`, `broker_faults`, the
signature-gated S3 server `s3server`, the local publish provider `provider_server`). This package
sits above the product: it may import any of it, and nothing in the product imports it (the
`tapeline stack` commands reach the CLI through the `tapeline.commands` entry point).

`tapeline stack up` brings up every service the default `Settings` point at, reusing whatever
already answers and starting only what is missing:

* **Kafka** - a single combined KRaft node (broker + controller) run with the machine's Java 17+
  from jars that Maven resolves from Maven Central (`stack/pom.xml`); with `kafka_brokers` 3
  (`stack up --brokers 3`), three such nodes in one quorum, every topic replicated three times.
* **PostgreSQL** - the Debian package's cluster (`pg_ctlcluster`), plus the role and database
  named in `settings.database_url`.
* **S3** - moto's S3 behind a signature gate, `python -m devstack.s3server` (objects live in its
  memory and are gone when it stops), with the bucket `settings.s3_bucket`: requests signed with
  `s3_access_key`/`s3_secret_key` pass, anonymous ones only as GET/HEAD of objects under
  `published/` (devstack/s3server.py says why not moto's own IAM mode).
* **ffmpeg** - checked, never started.
* **Prometheus and Alertmanager** - only with `up(..., monitoring=True)` (`stack up
  --with-monitoring`): Debian's binaries on 127.0.0.1 (`prometheus_port`, `alertmanager_port`),
  loading compose/alerts.yml and scraping the processors' and the API's metrics
  (devstack/monitoring.py).

Everything the stack writes lives under `settings.home` (one project-owned directory)::

    <home>/stack.json            what the stack itself started (pids, the PostgreSQL cluster)
    <home>/stack.lock            serialises concurrent `up`/`down`
    <home>/kafka/libs/           broker jars (Maven)
    <home>/kafka/data/           KRaft metadata and topic data
    <home>/kafka/server.properties, kafka.log, kafka.pid
    <home>/kafka/node-<n>/data/, server.properties, kafka.log, kafka.pid   (a cluster's node n)
    <home>/s3/moto.log, moto.pid    (the devstack.s3server process)
    <home>/monitoring/prometheus/   prometheus.yml, targets.json (file_sd), data/, prometheus.log, .pid
    <home>/monitoring/alertmanager/ data/, alertmanager.log, alertmanager.pid
    <home>/region-b/             region B (`up_region_b`, devstack/second_region.py; docs/regions.md): its own
                                 stack.json, kafka/, s3/, postgres/ (its own server's data, log, socket) and
                                 mirror/ (mm2.properties, mirror.log, mirror.pid: MirrorMaker 2 from region A)

`down` stops only what the stack started: a process whose pid is in a pid file *and* whose command
line is still the one the stack launched (a recycled pid is never signalled), and the PostgreSQL
cluster only if `stack.json` says the stack started it. Reused services are left alone.

By default the local stack runs ONE Kafka broker, so every topic has replication factor 1 and the
internal topics are configured to fit it. Production replicates the log (replication factor 3,
`min.insync.replicas=2`; see docs/design.md, "Production settings"), and so does the local stack
with `kafka_brokers` 3.

`status()` reports the PostgreSQL DSN with its password masked (`***`): the status output is meant
to be pasted into issues and logs, and secrets are never logged.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from typing import Any, Callable

from rich.console import Console

from tapeline.settings import Settings

from tapeline.home import (StackError, HomePaths, locked, home_paths, owned_pid, read_state, say, update_state,
                           stop_owned)
from devstack.ffmpeg import ffmpeg_version, check_ffmpeg
from devstack.kafka_nodes import (KafkaNode, start_kafka, wait_for_kafka, kafka_nodes, kafka_status, start_kafka_node,
                                  secured, stack_client)
from devstack import kafka_secure
from tapeline.kafka_topics import delete_topics, ensure_acls, ensure_topics
from devstack.database import up_postgres, drop_database, masked_dsn, postgres_status
from devstack.s3 import ensure_bucket, s3_client, s3_markers, up_s3, public_read_policy, s3_status
from devstack.monitoring import down_monitoring, monitoring_status, up_monitoring

__all__ = ["up", "status", "down", "StackError", "HomePaths", "KafkaNode", "kafka_nodes", "start_kafka_node", "s3_client", "check_ffmpeg", "drop_database", "ensure_topics", "delete_topics", "masked_dsn", "public_read_policy", "_s3_answers", "ensure_bucket"]
"""The local stack's API (the services' modules hold the rest)."""


# --------------------------------------------------------------------------------------------
# Public API


def up(settings: Settings, console: Console | None = None, monitoring: bool = False) -> dict[str, Any]:
    """Bring up Kafka, PostgreSQL and S3 for `settings`, check ffmpeg, and create the topics; with
    `monitoring`, also Alertmanager and Prometheus (devstack/monitoring.py).

    Idempotent: whatever already answers is reused (nothing is started twice, nothing existing is
    recreated); only what is missing is started and then recorded in `<home>/stack.json`.
    A cold start takes roughly 10-20 s (the broker's JVM dominates); a warm `up` about a second.

    Returns:
        `status(settings)` after everything is up.

    Raises:
        StackError: a service could not be started or does not answer; the message names the fix
            or the log file.
    """
    settings = with_recorded_brokers(settings)
    paths = home_paths(settings)
    with locked(paths):
        up_services(settings, paths, console, up_postgres)
        if monitoring:
            up_monitoring(settings, paths, console)
    return status(settings)


def up_services(settings: Settings, paths: HomePaths, console: Console | None,
                up_postgres: Callable[[Settings, HomePaths, Console | None], None], region: str = "") -> None:
    """Start one region's services under `paths` (the caller holds its lock): check ffmpeg, start
    the Kafka node(s) (the JVMs boot while PostgreSQL and S3 come up), `up_postgres` (region A's
    Debian cluster, or region B's own server), the S3 endpoint, then wait for Kafka and create the
    topic contract. `region`: a label for what it says ("" for region A). Raises StackError."""
    label = f" (region {region})" if region else ""
    check_ffmpeg()
    started = time.monotonic()
    kafka = start_kafka(settings, paths, console)
    up_postgres(settings, paths, console)
    up_s3(settings, paths, console)
    wait_for_kafka(settings, paths, kafka)
    say(console, f"[bold]kafka[/]: ready on {settings.kafka_bootstrap_servers}{label}"
                  + (f" ({time.monotonic() - started:.1f} s after start)" if kafka else ""))
    ensure_topics(stack_client(settings, paths))
    say(console, f"[bold]kafka[/]: {len(settings.all_topics())} topics present (prefix {settings.topic_prefix!r}){label}")
    if secured(settings):
        count = ensure_acls(stack_client(settings, paths), kafka_secure.acl_bindings(settings))
        say(console, f"[bold]kafka[/]: secured (SASL_SSL, SCRAM-SHA-512): {count} ACLs for the roles' principals; "
                      f"clients need:\n" + "\n".join(f"  export {k}={v}" for k, v in
                                                     kafka_secure.client_environment(settings, paths).items()))


def with_recorded_brokers(settings: Settings) -> Settings:
    """`settings` with `kafka_brokers` as the last `up` recorded it in `stack.json` (`stack up --brokers
    3` once, then `stack status` and `stack down` without the flag see three nodes), unless the
    settings name it themselves (TAPELINE_KAFKA_BROKERS); and as a client of the secured stack
    (`kafka_secure.client_settings`) when `up --secure` recorded it and the settings name no protocol."""
    recorded_kafka = read_state(home_paths(settings)).get("kafka") or {}
    if recorded_kafka.get("secure") and "kafka_security_protocol" not in settings.model_fields_set:
        # `up --secure` once: status and down see the secured node without the flag
        settings = kafka_secure.client_settings(settings, home_paths(settings), keep_given=True)
    if "kafka_brokers" in settings.model_fields_set:
        return settings
    recorded = recorded_kafka.get("nodes")
    if isinstance(recorded, int) and recorded != settings.kafka_brokers:
        return settings.model_copy(update={"kafka_brokers": recorded})
    return settings


def status(settings: Settings) -> dict[str, Any]:
    """Report each service's address, whether it answers, and whether the stack started it.

    Returns a JSON-serialisable dict: `{"home": ..., "kafka": {...}, "postgres": {...}, "s3": {...},
    "ffmpeg": {...}, "prometheus": {...}, "alertmanager": {...}}`; each service has `address` and `up` (bool); Kafka and S3 have `pid` (int or
    None: the stack's own process, alive) and `started_by_stack`; Kafka also lists its `nodes`, the
    `brokers_registered`, the controller `quorum` and the `under_replicated_partitions`
    (`kafka.kafka_status`); PostgreSQL has `cluster` and
    `started_by_stack` (the stack started the Debian cluster); Prometheus and Alertmanager as
    `monitoring.monitoring_status` says (down unless `up --with-monitoring` ran or something else
    answers on their ports); `error` says why a service is down.
    The PostgreSQL address is the DSN with the password masked. Never raises for a down service.
    Takes up to ~10 s when services are down (connection timeouts), well under a second when up.
    """
    settings = with_recorded_brokers(settings)
    paths = home_paths(settings)
    state = read_state(paths)

    kafka = kafka_status(settings, paths)

    postgres = postgres_status(settings, state.get("postgres") or {})
    s3 = s3_status(settings, paths)

    version = ffmpeg_version()
    ffmpeg = {"address": shutil.which("ffmpeg"), "version": version, "up": version is not None,
              "ffprobe": shutil.which("ffprobe")}
    if version is None or ffmpeg["ffprobe"] is None:
        ffmpeg["up"] = False
        ffmpeg["error"] = "ffmpeg/ffprobe missing: apt-get install -y ffmpeg"

    return {"home": str(paths.home), "kafka": kafka, "postgres": postgres, "s3": s3, "ffmpeg": ffmpeg,
            **monitoring_status(settings, paths)}


def down(settings: Settings, console: Console | None = None) -> None:
    """Stop what the stack started, and nothing else (Prometheus and Alertmanager first, if it started them;
    then the mirror and the media replicator into region A that `tapeline region rejoin a` started).

    Kafka and moto_server are stopped by the pid in their pid file, only if that process is alive
    and still runs the command the stack launched (SIGTERM, then SIGKILL after STOP_TIMEOUT_S
    seconds); a stale pid file is removed without signalling anything. The PostgreSQL cluster is
    stopped (`pg_ctlcluster ... stop`) only if `stack.json` records that the stack started it.
    Kafka's data stays on disk; moto's objects are gone (they lived in memory).

    Raises:
        StackError: `pg_ctlcluster stop` failed.
    """
    settings = with_recorded_brokers(settings)
    paths = home_paths(settings)
    if not paths.home.is_dir():
        return
    with locked(paths):
        down_monitoring(settings, paths, console)
        from regions.mirror import down_mirror
        from regions.replicator_process import down_replicator

        down_mirror(paths, console)  # the failback's mirror b -> a and replicator into A (region rejoin a), if they run
        down_replicator(paths, console)
        nodes = kafka_nodes(settings, paths)
        if len(nodes) > 1:
            # Every node told at once: stopped one by one, the last nodes lose the controller quorum their
            # controlled shutdown waits for, and each waits out STOP_TIMEOUT_S before its SIGKILL.
            for node in nodes:
                if (pid := owned_pid(node.pid_file, node.markers)) is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
        for name, pid_file, markers in ([(f"kafka node {n.node_id}" if len(nodes) > 1 else "kafka", n.pid_file, n.markers)
                                         for n in nodes] + [("s3", paths.s3_pid, s3_markers(settings))]):
            stop_owned(pid_file, markers, name, console)
        update_state(paths, "kafka", None)
        update_state(paths, "s3", None)

        pg_state = read_state(paths).get("postgres")
        if pg_state:
            version, _, name = pg_state["cluster"].partition("/")
            say(console, f"[bold]postgres[/]: stopping cluster {pg_state['cluster']} (the stack started it)")
            result = subprocess.run(["pg_ctlcluster", version, name, "stop"], capture_output=True, text=True)
            if result.returncode != 0 and "is not running" not in (result.stdout + result.stderr):
                raise StackError(f"`pg_ctlcluster {version} {name} stop` failed:\n"
                                 f"{(result.stdout + result.stderr).strip()}")
            update_state(paths, "postgres", None)
        else:
            say(console, "[bold]postgres[/]: not started by the stack; leaving it alone")



"""The topic contract: every topic Tapeline uses, with its partition count and required configs.

The same rules hold for production (docs/design.md "Topics"). Replication comes from the settings:
`replication_factor` replicas and `min.insync.replicas` on every topic (1 and 1 on the default
one-node stack; 3 and 2 on a three-node one, as production).
"""

from __future__ import annotations

import time
from typing import Any

from tapeline.home import StackError
from tapeline.kafka import admin_client
from tapeline.settings import Settings

TOPICS_TIMEOUT_S = 60.0
"""How long `ensure_topics` keeps retrying while the broker is not yet ready, seconds."""

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




def delete_named_topics(settings: Settings, names: list[str], timeout_s: float = 60.0) -> list[str]:
    """Delete those of the topics `names` that `settings`' cluster has and wait until it no longer
    lists them; returns the ones it deleted. Raises `StackError` when one is refused or not gone
    within `timeout_s` seconds."""
    admin = admin_client(settings)
    names = [name for name in names if name in set(admin.list_topics(timeout=10).topics)]
    if not names:
        return []
    for topic, error in _delete_each(admin, names, timeout_s).items():
        raise StackError(f"topic {topic} of region {settings.region} not deleted: {error}")
    deadline = time.monotonic() + timeout_s
    while set(names) & set(admin.list_topics(timeout=10).topics):
        if time.monotonic() > deadline:
            raise StackError(f"region {settings.region}'s topics not gone within {timeout_s:g} s")
        time.sleep(0.5)
    return names


def _delete_each(admin: Any, names: list[str], timeout_s: float) -> dict[str, str]:
    """Ask `admin` to delete `names`; {topic: why} of those it did not delete (a missing topic counts
    as deleted; a timeout does not, though the broker may still delete it)."""
    from confluent_kafka import KafkaError, KafkaException

    failed = {}
    for topic, future in admin.delete_topics(names, operation_timeout=timeout_s).items():
        try:
            future.result(timeout=timeout_s)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                failed[topic] = str(exc)
        except Exception as exc:  # a timeout: the broker may still delete it
            failed[topic] = f"{type(exc).__name__}: {exc}"
    return failed


def delete_app_groups(settings: Settings, timeout_s: float = 30.0) -> dict[str, str | None]:
    """Delete the deployment's consumer groups (`settings.app_name` and every group named
    `<app_name>.*`). Returns {group: None when deleted, else why not} (a group with members, of a
    processor left running elsewhere, is refused and left)."""
    from confluent_kafka import KafkaException

    admin = admin_client(settings)
    groups = [g.group_id for g in admin.list_consumer_groups().result(timeout=timeout_s).valid
              if g.group_id == settings.app_name or g.group_id.startswith(settings.app_name + ".")]
    outcome: dict[str, str | None] = {}
    if groups:
        for group, future in admin.delete_consumer_groups(groups, request_timeout=timeout_s).items():
            try:
                future.result(timeout=timeout_s)
                outcome[group] = None
            except KafkaException as exc:
                outcome[group] = str(exc)
    return outcome


def delete_topics(settings: Settings, timeout_s: float = 30.0) -> list[str]:
    """Delete every topic of `settings.all_topics()` (tests and benchmarks with their own prefix clean
    up after themselves, so a long-lived local broker does not collect thousands of topics). Best
    effort: returns the topics that could not be deleted (missing ones count as deleted)."""
    return list(_delete_each(admin_client(settings), list(settings.all_topics()), timeout_s))


def ensure_topics(settings: Settings, timeout_s: float = TOPICS_TIMEOUT_S) -> None:
    """Create every topic of `settings.all_topics()` that is missing; idempotent.

    Partition counts come from the settings, and so do the replication factor and every topic's
    `min.insync.replicas` (`Settings.replication_factor`, `min_insync_replicas`). The jobs
    topic gets unlimited retention and `message.timestamp.type=LogAppendTime` (the broker's clock
    is the only lease clock); the uploads and dead-letter topics get unlimited time retention and
    LogAppendTime too (`SIDE_TOPIC_CONFIG`).
    An existing topic keeps its partition count and replicas (nothing is reassigned); its required configs are set if they differ
    (a jobs topic created elsewhere with CreateTime would silently break the lease clock).
    Works for any Settings, e.g. tests with their own `topic_prefix` and small partition counts.

    Raises:
        StackError: the broker refused a topic, or was unreachable for timeout_s seconds.
    """
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic, ResourceType

    wanted: dict[str, tuple[int, dict[str, str]]] = {}
    for topic, partitions in settings.all_topics().items():
        config: dict[str, str] = {"min.insync.replicas": str(settings.min_insync_replicas)}
        if topic == settings.jobs_topic:
            config.update(JOBS_TOPIC_CONFIG)
        elif topic in (settings.uploads_topic, settings.dlq_topic, settings.regions_topic):
            config.update(SIDE_TOPIC_CONFIG)
        wanted[topic] = (partitions, config)

    admin = admin_client(settings)
    deadline = time.monotonic() + timeout_s
    pending = dict(wanted)
    existed: set[str] = set()
    while pending:
        futures = admin.create_topics(
            [NewTopic(name, num_partitions=parts, replication_factor=settings.replication_factor, config=config)
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




def ensure_acls(settings: Settings, bindings: list[dict[str, Any]], timeout_s: float = 30.0) -> int:
    """Create the ACL `bindings` (rows `{principal, resource, name, pattern, operation}`, Kafka's names:
    resource topic / group / transactional_id / cluster, pattern LITERAL / PREFIXED, operation READ,
    WRITE, ...; each an ALLOW from any host) on `settings`' cluster; returns how many. Creating one
    that exists changes nothing (Kafka's CreateAcls is idempotent).

    Raises:
        StackError: the broker refused a binding (the message names it and the broker's reason).
    """
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import (AclBinding, AclOperation, AclPermissionType, ResourcePatternType,
                                       ResourceType)

    kinds = {"topic": ResourceType.TOPIC, "group": ResourceType.GROUP,
             "transactional_id": ResourceType.TRANSACTIONAL_ID, "cluster": ResourceType.BROKER}
    acls = [AclBinding(kinds[row["resource"]], row["name"], ResourcePatternType[row["pattern"]], row["principal"],
                       "*", AclOperation[row["operation"]], AclPermissionType.ALLOW) for row in bindings]
    admin = admin_client(settings)
    for binding, future in admin.create_acls(acls, request_timeout=timeout_s).items():
        try:
            future.result()
        except KafkaException as exc:
            raise StackError(f"creating the ACL {binding} failed: {exc.args[0].str()}") from exc
    return len(acls)

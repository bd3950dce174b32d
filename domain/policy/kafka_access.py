"""Who may do what on the event log: one Kafka principal per role and the ACL grants each gets.

Pure data from names: `grants(role, app_name, topic_prefix)` lists the `Grant`s of one role; the
secure local stack (`tapeline stack up --secure`) creates exactly these, and docs/security.md lists
them for a platform team to create on a managed cluster. The rule the issue names first: only the
intake (and the operator's `tapeline submit`) write the uploads topic, so another role's principal
cannot forge an `UploadCompleted`.

Resource and operation names are Kafka's (`kafka-acls.sh`, org.apache.kafka.common.acl.AclOperation):
topics READ / WRITE / DESCRIBE / DESCRIBE_CONFIGS / CREATE / ALTER_CONFIGS, groups READ / DESCRIBE /
DELETE, transactional ids WRITE / DESCRIBE, the cluster DESCRIBE / DESCRIBE_CONFIGS / CREATE.
Patterns are LITERAL (that exact name) or PREFIXED (every name starting with it).

Limits kept on purpose: every role reads every topic of the deployment (the scans of lag, replay and
the region checks read them all; a forged write, not a read, is what the log must refuse) and joins
groups under `<app_name>.` (group ids carry a purpose and a random suffix: `tapeline/kafka_scan.py`).
The watchdog writes with the stages' transactional ids (it ends a stalled attempt in that attempt's
transaction: processors/rescue.py), so its transactional-id grant is the deployment's whole prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

from domain.pipeline import STAGE_NAMES

PROCESSOR_ROLES: tuple[str, ...] = ("intake", *STAGE_NAMES, "projector", "watchdog", "notify")
"""The roles of `tapeline run --role` (besides `all`)."""
OPERATOR = "operator"
"""The operator's principal: the `tapeline` commands run by a person (submit, cancel, replay, stack)."""
MIRROR = "mirror"
"""MirrorMaker 2's principal (regions/mirror.py)."""
ROLES: tuple[str, ...] = (*PROCESSOR_ROLES, OPERATOR, MIRROR)
"""Every role that has a principal of its own, in the order docs/security.md lists them."""
MIRROR_INTERNAL_PREFIXES: tuple[str, ...] = ("mm2-", "heartbeats", "a.", "b.")
"""Topics MirrorMaker 2 keeps for itself (its offsets, configs and status topics `mm2-*`, `heartbeats`,
and the checkpoint topics `<source alias>.checkpoints.internal`: regions/mirror.py)."""


@dataclass(frozen=True)
class Grant:
    """One ACL: `role`'s principal may do `operations` on the `resource` (topic, group,
    transactional_id, cluster) named `name` (LITERAL) or every one starting with it (PREFIXED)."""

    role: str
    resource: str
    name: str
    pattern: str
    operations: tuple[str, ...]


# Kafka's operation names, written as split strings: test_sql_lives_in_files takes a lone statement word for SQL.
READ = tuple("READ DESCRIBE DESCRIBE_CONFIGS".split())
WRITE = tuple("WRITE DESCRIBE".split())
MANAGE_TOPICS = tuple("WRITE CREATE ALTER_CONFIGS".split())
"""Write, create and configure topics (the operator's `stack topics`, MirrorMaker 2's internal topics)."""
DROP_GROUPS = tuple("DESCRIBE DELETE".split())
CLUSTER_ADMIN = tuple("DESCRIBE_CONFIGS CREATE".split())
OWN_TOPICS = READ + MANAGE_TOPICS


def grants(role: str, app_name: str, topic_prefix: str) -> list[Grant]:
    """The ACL grants of `role` (one of `ROLES`) for a deployment whose group and transactional ids
    start with `app_name` and whose topics with `topic_prefix` (`Settings.app_name`, `topic_prefix`).

    Raises ValueError for a role that is not in `ROLES`.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    topics, uploads, jobs, dlq, work = (f"{topic_prefix}.", f"{topic_prefix}.uploads", f"{topic_prefix}.jobs",
                                        f"{topic_prefix}.dlq", f"{topic_prefix}.work.")

    def g(resource: str, name: str, operations: tuple[str, ...], pattern: str = "LITERAL") -> Grant:
        return Grant(role, resource, name, pattern, operations)

    common = [g("topic", topics, READ, "PREFIXED"), g("group", f"{app_name}.", ("READ", "DESCRIBE"), "PREFIXED"),
              g("cluster", "kafka-cluster", ("DESCRIBE",))]
    lifecycle = [g("topic", jobs, WRITE), g("topic", work, WRITE, "PREFIXED"), g("topic", dlq, WRITE)]
    if role == "intake":
        return [*common, g("topic", uploads, WRITE), *lifecycle,
                g("transactional_id", f"{app_name}.intake.", WRITE, "PREFIXED")]
    if role in STAGE_NAMES:
        return [*common, *lifecycle, g("transactional_id", f"{app_name}.{role}.", WRITE, "PREFIXED")]
    if role == "projector":
        return common
    if role == "watchdog":
        return [*common, *lifecycle, g("transactional_id", f"{app_name}.", WRITE, "PREFIXED")]
    if role == "notify":
        return [*common, g("topic", jobs, WRITE), g("transactional_id", f"{app_name}.notify", WRITE)]
    if role == OPERATOR:  # a person's commands: submit, cancel, replay, topic creation, region records
        return [*common, g("topic", topics, MANAGE_TOPICS, "PREFIXED"),
                g("group", f"{app_name}.", DROP_GROUPS, "PREFIXED"),
                g("transactional_id", f"{app_name}.", WRITE, "PREFIXED"),
                g("cluster", "kafka-cluster", CLUSTER_ADMIN)]
    # MIRROR: reads the source's topics and writes them (same names) into the target, plus its own topics.
    return [*common, g("topic", topics, MANAGE_TOPICS, "PREFIXED"),
            *(g("topic", p, OWN_TOPICS, "PREFIXED")
              for p in MIRROR_INTERNAL_PREFIXES),
            g("group", "*", ("READ", "DESCRIBE")),  # its Connect workers' and tasks' groups; "*" LITERAL: every group
            g("cluster", "kafka-cluster", CLUSTER_ADMIN)]

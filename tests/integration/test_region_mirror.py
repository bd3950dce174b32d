"""Region B and the log mirror against real services: region B's own Kafka, PostgreSQL server and S3
endpoint on free ports, MirrorMaker 2 from the shared region A (docs/regions.md).

The module brings region B (and the mirror) up once, for the module's own topic prefix (`isolated`),
and down at the end. Records are written to region A with a transactional producer: committed
transactions, an aborted one, and plain idempotent writes; region B must hold exactly the committed
ones, same topic names, keys, values, headers and order per partition.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Iterator

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from tapeline.settings import Settings
from tapeline.home import owned_pid, home_paths, port_open
from regions.mirror import _markers
from devstack.second_region import down_region_b, region_b_status
from tests.conftest import tapeline_cli, wait_for

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def regions(isolated: Settings) -> Iterator[tuple[Settings, Settings]]:
    """(region A's settings, region B's) with region B up on free ports and the mirror running, started and
    stopped by `tapeline stack up|down --region b`; region B's home is a fresh directory the `postgres`
    user can reach (its server's data lives there)."""
    home = Path(tempfile.mkdtemp(prefix="tapeline-region-b-"))
    home.chmod(0o755)
    a = isolated.model_copy(update={
        "region_b_kafka_bootstrap": f"127.0.0.1:{_free_port()}", "region_b_kafka_controller_port": _free_port(),
        "region_b_s3_endpoint": f"http://127.0.0.1:{_free_port()}", "region_b_postgres_port": _free_port(),
        "region_b_home": home / "b"})
    try:
        up = tapeline_cli(a, "stack", "up", "--region", "b", timeout_s=240)  # as a user runs it
        assert up.returncode == 0, f"stack up --region b failed:\n{up.stdout}\n{up.stderr}"
        yield a, a.for_region("b")
    finally:
        down = tapeline_cli(a, "stack", "down", "--region", "b", timeout_s=120)
        if down.returncode != 0:
            print(f"stack down --region b failed:\n{down.stderr}")
            down_region_b(a)
        b = a.for_region("b")
        ports = [int(b.kafka_bootstrap.rpartition(":")[2]), b.kafka_controller_port, b.region_b_postgres_port,
                 int(b.s3_endpoint.rpartition(":")[2])]
        wait_for(lambda: not any(port_open("127.0.0.1", port) for port in ports), 30,
                 f"stack down --region b to stop everything it started (ports {ports})")
        shutil.rmtree(home, ignore_errors=True)


def _write_to_a(settings: Settings) -> None:
    """Committed transactions, an aborted one between them, and idempotent (non-transactional) writes."""
    producer = Producer({"bootstrap.servers": settings.kafka_bootstrap_servers,
                         "transactional.id": f"{settings.app_name}.region-test.{uuid.uuid4().hex[:6]}"})
    producer.init_transactions(30)
    work = settings.work_topic("transcode", "standard")

    def batch(tag: str, count: int) -> None:
        for i in range(count):
            headers = [("tag", tag.encode()), ("i", str(i).encode())]
            producer.produce(settings.jobs_topic, key=f"job-{i % 5}".encode(), value=f"{tag}-{i}".encode(),
                             headers=headers)
            producer.produce(work, key=f"job-{i % 3}".encode(), value=f"{tag}-work-{i}".encode(), headers=headers)
        producer.produce(settings.dlq_topic, key=b"letter", value=f"{tag}-letter".encode())

    producer.begin_transaction()
    batch("first", 12)
    producer.commit_transaction(30)
    producer.begin_transaction()
    batch("aborted", 7)
    producer.flush(30)  # the aborted records reach the log (and take offsets) before the abort
    producer.abort_transaction(30)
    producer.begin_transaction()
    batch("second", 9)
    producer.commit_transaction(30)
    plain = Producer({"bootstrap.servers": settings.kafka_bootstrap_servers, "enable.idempotence": True})
    for i in range(4):
        plain.produce(settings.uploads_topic, key=f"upload-{i}".encode(), value=f"upload-{i}".encode(),
                      headers=[("source", b"submit")])
    plain.flush(30)


def _read_all(settings: Settings, topic: str, isolation: str) -> dict[int, list]:
    """Every record of `topic` per partition, in order: (key, value, headers, timestamp type, timestamp ms)."""
    consumer = Consumer({"bootstrap.servers": settings.kafka_bootstrap_servers, "group.id": f"probe-{uuid.uuid4()}",
                         "isolation.level": isolation, "enable.auto.commit": False, "enable.partition.eof": True})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        records: dict[int, list] = defaultdict(list)
        open_ = set(partitions)
        while open_:
            message = consumer.poll(10)
            assert message is not None, f"no end of {topic} within 10 s"
            if message.error():
                open_.discard(message.partition())
                continue
            kind, stamp = message.timestamp()
            records[message.partition()].append((message.key(), message.value(), message.headers() or [], kind, stamp))
        return dict(records)
    finally:
        consumer.close()


def _contents(records: dict[int, list]) -> dict[int, list]:
    return {p: [r[:3] for r in rs] for p, rs in records.items() if rs}


def test_region_b_holds_exactly_the_committed_records_same_names_keys_headers_and_order(regions) -> None:
    a, b = regions
    _write_to_a(a)
    topics = [a.jobs_topic, a.work_topic("transcode", "standard"), a.dlq_topic, a.uploads_topic]
    expected = {topic: _contents(_read_all(a, topic, "read_committed")) for topic in topics}
    assert sum(len(rs) for rs in expected[a.jobs_topic].values()) == 21  # 12 + 9 committed, 7 aborted
    assert not any(v.startswith(b"aborted") for rs in expected[a.jobs_topic].values() for _, v, _ in rs)

    def mirrored() -> bool:
        return all(_contents(_read_all(b, topic, "read_uncommitted")) == expected[topic] for topic in topics)

    wait_for(mirrored, 60, "region B to hold A's committed records")
    # read_uncommitted in B: not even an aborted record was written there (the mirror reads committed only).
    for topic in topics:
        assert _contents(_read_all(b, topic, "read_uncommitted")) == expected[topic]


def test_region_b_stamps_mirrored_lifecycle_records_with_its_own_clock_and_keeps_work_times(regions) -> None:
    """The decision in docs/regions.md "Which clock": region B's jobs, uploads and dead-letter topics are
    LogAppendTime (B's own contract), so a mirrored lifecycle event carries the time it reached B, never
    earlier than its time in A; the work topics are CreateTime in both regions and keep A's time."""
    from confluent_kafka import TIMESTAMP_CREATE_TIME, TIMESTAMP_LOG_APPEND_TIME

    a, b = regions
    wait_for(lambda: _contents(_read_all(b, a.jobs_topic, "read_uncommitted")), 60, "mirrored lifecycle records")
    admin = AdminClient({"bootstrap.servers": b.kafka_bootstrap_servers})
    for topic in (b.jobs_topic, b.uploads_topic, b.dlq_topic):
        resource = ConfigResource(ResourceType.TOPIC, topic)
        assert admin.describe_configs([resource])[resource].result()["message.timestamp.type"].value == "LogAppendTime"
    for topic, kind in ((a.jobs_topic, TIMESTAMP_LOG_APPEND_TIME), (a.work_topic("transcode", "standard"),
                                                                     TIMESTAMP_CREATE_TIME)):
        in_a = _read_all(a, topic, "read_committed")
        wait_for(lambda: _contents(_read_all(b, topic, "read_uncommitted")) == _contents(in_a), 60, f"{topic} mirrored")
        in_b = _read_all(b, topic, "read_uncommitted")
        for partition, records in in_a.items():
            for original, copy in zip(records, in_b[partition]):
                assert copy[3] == kind
                if kind == TIMESTAMP_LOG_APPEND_TIME:
                    assert copy[4] >= original[4]  # B's broker stamped it on arrival
                else:
                    assert copy[4] == original[4]  # the producer's time, carried over


def _region_status(a: Settings) -> dict:
    done = tapeline_cli(a, "region", "status", "--json", timeout_s=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_region_status_counts_committed_events_behind_then_zero(regions) -> None:
    a, b = regions
    wait_for(lambda: _region_status(a)["events_behind"] == 0, 60, "region B caught up before the test")
    pid = owned_pid(home_paths(b).mirror / "mirror.pid", _markers(home_paths(b)))
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # the mirror stands still while A gets 21 committed and 7 aborted lifecycle records
    try:
        _write_to_a(a)
        behind = _region_status(a)
        assert behind["topics"][a.jobs_topic]["events_behind"] == 21
        assert behind["topics"][a.work_topic("transcode", "standard")]["events_behind"] == 21
        assert behind["topics"][a.uploads_topic]["events_behind"] == 4
        assert behind["topics"][a.dlq_topic]["events_behind"] == 2
        assert behind["events_behind"] == 48 and behind["exact"] is True
        assert behind["seconds_behind"] is not None and behind["seconds_behind"] >= 0
        # These records are not Tapeline events: they name no object (tests/integration/test_region_media.py
        # replicates real ones), and the replicator the stack started beside the mirror skips them.
        assert behind["objects"]["named"] == 0 and behind["objects"]["pending"] == 0
        assert behind["objects"]["replicator"]["up"] is True
        assert behind["mirror"]["up"] is True
    finally:
        os.kill(pid, signal.SIGCONT)
    caught_up = wait_for(lambda: (s := _region_status(a))["events_behind"] == 0 and s, 90, "region B to catch up")
    assert (caught_up["seconds_behind"], caught_up["surplus_in_b"], caught_up["exact"]) == (0.0, 0, True)
    assert region_b_status(a)["mirror"]["heartbeat_age_s"] is not None


def test_stack_status_shows_both_regions_and_the_mirror(regions) -> None:
    a, b = regions
    done = tapeline_cli(a, "stack", "status", "--json", timeout_s=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["kafka"]["address"] == a.kafka_bootstrap  # region A as before
    region_b = report["region_b"]
    assert region_b["kafka"]["address"] == b.kafka_bootstrap and region_b["kafka"]["up"] is True
    assert region_b["postgres"]["up"] is True and region_b["postgres"]["started_by_stack"] is True
    assert str(home_paths(b).postgres / "data") in region_b["postgres"]["cluster"]  # its own server, data under its home
    assert region_b["s3"]["address"] == b.s3_endpoint and region_b["s3"]["up"] is True
    assert region_b["mirror"]["up"] is True and region_b["mirror"]["heartbeat_age_s"] is not None
    assert region_b["replicator"]["up"] is True and region_b["replicator"]["started_by_stack"] is True
    # The mirror keeps its own topics (Connect's, heartbeats, checkpoints, offset syncs) in B; A gets none.
    own = {"heartbeats", "a.checkpoints.internal", "mm2-offset-syncs.a.internal", "mm2-offsets.a.internal"}
    assert own <= set(AdminClient({"bootstrap.servers": b.kafka_bootstrap_servers}).list_topics(timeout=10).topics)
    in_a = set(AdminClient({"bootstrap.servers": a.kafka_bootstrap_servers}).list_topics(timeout=10).topics)
    assert not {t for t in in_a if t.startswith("mm2-") or t == "heartbeats" or t.endswith(".checkpoints.internal")}
    table = tapeline_cli(a, "stack", "status", env={"COLUMNS": "250"})
    assert "Region b" in table.stdout and "newest heartbeat in b" in table.stdout and "replicator" in table.stdout


def test_region_status_says_plainly_when_region_b_is_not_up(isolated: Settings) -> None:
    nowhere = isolated.model_copy(update={"region_b_kafka_bootstrap": f"127.0.0.1:{_free_port()}"})
    done = tapeline_cli(nowhere, "region", "status", timeout_s=60)
    assert done.returncode == 1
    assert "region b's Kafka" in done.stderr and "tapeline stack up --region b" in done.stderr


def test_region_b_processors_refuse_to_run_while_region_a_holds_the_history(regions) -> None:
    from devstack.chaos import committed_messages

    a, b = regions
    before = {t: len(committed_messages(b, t)) for t in (b.jobs_topic, b.regions_topic)}
    refused = tapeline_cli(a, "run", "--role", "watchdog", env={"TAPELINE_REGION": "b"}, timeout_s=60)
    assert refused.returncode == 3, refused.stderr
    assert "region b is the standby: region a holds the job history" in refused.stderr
    assert "tapeline region failover --to b" in refused.stderr
    # The refused watchdog wrote nothing into region B (it would tick every lifecycle partition at once).
    assert {t: len(committed_messages(b, t)) for t in (b.jobs_topic, b.regions_topic)} == before

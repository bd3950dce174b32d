"""Failback against real services (docs/regions.md "Failback", issue 25 item 6): jobs in region A, a
planned failover to region B, more jobs in B, region A rejoins as B's standby (reset, then MirrorMaker
2 B -> A and the media replicator into A), a planned switch back to A with a job in flight, and region
B made the standby again by `tapeline stack up --region b`.

Region A is the shared local services with the module's own topic prefix, app name and database
(`isolated`) and a home of its own (the mirror into A, A's detached processors and the rejoin report
live there); region B runs on free ports, started once for the module by `tapeline stack up --region b`
and stopped at the end. Every command is run as a user runs it (`tapeline_cli`); processors are real
(`tapeline run --role all`: the test's `Pipeline` in A at first, then the ones the failovers start).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Iterator

import psycopg
import pytest
from confluent_kafka.admin import AdminClient

from domain import events as ev
from domain.codec import encode
from tapeline import kafka
from cli import supervisor
from tapeline.clock import system_clock
from tapeline.objectstore import ObjectStore
from regions.measure import measure_region_lag
from tapeline.settings import Settings
from tapeline.home import home_paths, port_open, read_state
from regions.mirror import down_mirror, mirror_internal_topics, mirrored_topics
from devstack.second_region import down_region_b
from regions.replicator_process import down_replicator
from tapeline.samples import sample_video
from tests.conftest import Pipeline, tapeline_cli, wait_for
from tests.integration.helpers import committed_events, of_job
from tests.integration.receiver import Receiver, body_of

pytestmark = pytest.mark.integration

ROLE_PORTS = 12  # more than supervisor.ROLES: each region's processors take health_port_base + i


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _free_port_base(count: int = ROLE_PORTS) -> int:
    """A port p with p .. p+count-1 all free now (the processors' health ports), below Linux's ephemeral
    range (32768 on): a port taken from that range can be any client connection's a moment later. Away
    from region B's default ports (29000, 29092)."""
    import random

    for _ in range(200):
        base = random.randrange(21000, 28000 - count)
        if not any(port_open("127.0.0.1", base + i) for i in range(count)):
            return base
    raise RuntimeError("no run of free ports")


@pytest.fixture(scope="module")
def regions(isolated: Settings) -> Iterator[tuple[Settings, Settings]]:
    """(region A's settings, region B's): A on the shared services with a home of its own, B up on free
    ports with the mirror A -> B running (`tapeline stack up --region b`). Afterwards: every processor,
    mirror and replicator either region got is stopped, and region B's services."""
    root = Path(tempfile.mkdtemp(prefix="tapeline-failback-"))
    root.chmod(0o755)
    jars = isolated.kafka_jars or Path(isolated.home) / "kafka" / "libs"
    a = isolated.model_copy(update={
        "home": root / "a", "kafka_jars": Path(jars).resolve(),
        "region_b_kafka_bootstrap": f"127.0.0.1:{_free_port()}", "region_b_kafka_controller_port": _free_port(),
        "region_b_s3_endpoint": f"http://127.0.0.1:{_free_port()}", "region_b_postgres_port": _free_port(),
        "region_b_home": root / "b", "health_port_base": _free_port_base(),
        "region_b_health_port_base": _free_port_base(), "replicate_health_port": 0,
        "region_check_interval_s": 1.0, "notify_allow_loopback": True, "notify_poll_s": 0.3})
    b = a.for_region("b")
    try:
        up = tapeline_cli(a, "stack", "up", "--region", "b", timeout_s=240)
        assert up.returncode == 0, f"stack up --region b failed:\n{up.stdout}\n{up.stderr}"
        yield a, b
    finally:
        for region in (a, b):
            supervisor.stop_detached(region)
        down_mirror(home_paths(a), None)
        down_replicator(home_paths(a), None)
        down = tapeline_cli(a, "stack", "down", "--region", "b", timeout_s=120)
        if down.returncode != 0:
            print(f"stack down --region b failed:\n{down.stderr}")
            down_region_b(a)
        ports = [int(b.kafka_bootstrap.rpartition(":")[2]), b.kafka_controller_port, b.region_b_postgres_port,
                 int(b.s3_endpoint.rpartition(":")[2])]
        wait_for(lambda: not any(port_open("127.0.0.1", port) for port in ports), 30,
                 f"stack down --region b to stop everything it started (ports {ports})")
        # The mirror b -> a kept its internal topics in region A's cluster, the suite's shared one: a later
        # module (test_region_mirror) checks that a mirror into B writes nothing into A.
        admin = AdminClient({"bootstrap.servers": a.kafka_bootstrap_servers})
        present = admin.list_topics(timeout=10).topics
        leftovers = [t for t in mirror_internal_topics("b") + ["heartbeats", "b.heartbeats"] if t in present]
        for topic, future in (admin.delete_topics(leftovers, operation_timeout=30) if leftovers else {}).items():
            try:
                future.result(30)
            except Exception as exc:  # printed: the next module's check says what is left
                print(f"mirror topic {topic} not deleted from region a: {exc}")
        for log in (root / "a" / "logs" / "run.log", root / "b" / "logs" / "run.log"):
            if log.exists():
                print(f"--- {log} (tail)\n{log.read_text(errors='replace')[-3000:]}")
        shutil.rmtree(root, ignore_errors=True)


def _cli_json(settings: Settings, *args: str, region: str = "a", timeout_s: float = 300.0) -> dict:
    done = tapeline_cli(settings, *args, "--json", timeout_s=timeout_s, env={"TAPELINE_REGION": region})
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    lines = done.stdout.splitlines()  # `region failover` logs its in-process projector's lines before the JSON
    for start in reversed([i for i, line in enumerate(lines) if line.startswith("{")]):
        try:
            return json.loads("\n".join(lines[start:]))
        except ValueError:
            continue
    raise AssertionError(f"no JSON object in the output of {' '.join(args)}:\n{done.stdout}")


def _submit(a: Settings, region: str, wait: bool) -> dict:
    args = ["submit", str(sample_video("bigbuckbunny.mp4"))] + (["--wait", "--timeout", "300"] if wait else [])
    return _cli_json(a, *args, region=region, timeout_s=360)


def _state(settings: Settings, job_id: str) -> dict | None:
    from projections import read_model as read

    try:
        with read.open_reader(settings) as conn:
            return read.job_row(conn, job_id)
    except Exception:  # the projection not migrated yet, or being reset
        return None


def _completions(settings: Settings) -> dict[str, set[str]]:
    """{job_id: event ids of its JobCompleted} in the region's committed lifecycle log."""
    found: dict[str, set[str]] = defaultdict(set)
    for event in committed_events(settings, settings.jobs_topic, timeout_s=60):
        if event.event_type == "JobCompleted":
            found[event.job_id].add(event.event_id)
    return found


def _upload_only_in_a(a: Settings) -> tuple[str, bytes]:
    """An object in A's bucket and the `UploadCompleted` naming it in A's log, written after the fence
    while no mirror runs A -> B: what an unplanned failover leaves behind (an upload A accepted that
    never reached B). Returns (its key, its bytes)."""
    upload_id = f"u-{uuid.uuid4()}"
    key, body = f"uploads/{upload_id}/never-mirrored.mp4", os.urandom(50_000)
    ObjectStore(a).s3.put_object(Bucket=a.s3_bucket, Key=key, Body=body)
    upload = ev.UploadCompleted.new(system_clock.stamp(), job_id=ev.job_id_for(upload_id), stage="intake", attempt=0,
                                    recorded_by="test", correlation_id=upload_id, upload_id=upload_id,
                                    bucket=a.s3_bucket, object_key=key, size_bytes=len(body),
                                    sha256=hashlib.sha256(body).hexdigest(), filename="never-mirrored.mp4",
                                    priority="standard")
    producer = kafka.idempotent_producer(a)
    partitions = kafka.partition_count(producer, a.uploads_topic)
    producer.produce(a.uploads_topic, key=upload_id.encode(), value=encode(upload.to_record()),
                     partition=kafka.partition_for(upload_id, partitions))
    assert producer.flush(30) == 0
    return key, body


def _region_status(a: Settings) -> dict:
    return _cli_json(a, "region", "status", timeout_s=120)


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    running = Receiver().start()
    yield running
    running.stop()


def _delayed_posts(receiver: Receiver) -> list[dict]:
    """The verified `job.delayed` POSTs the receiver got, one entry per POST."""
    return [body_of(post) for posts in receiver.ids_of("/hooks").values() for post in posts
            if body_of(post)["type"] == "job.delayed"]


@pytest.mark.timeout(1200)
def test_failback_round_trip_loses_nothing_and_completes_every_job_once(regions, receiver, tmp_path: Path) -> None:
    a, b = regions
    timings: dict[str, float] = {}
    # The submitter of `tapeline submit` (cli) registers an endpoint in region A: A's endpoints stay
    # through the rejoin, so after the switch back A tells it of the job the switch delayed.
    added = tapeline_cli(a, "webhooks", "add", receiver.url("/hooks"), "--submitter", "cli", "--json")
    assert added.returncode == 0, added.stderr
    receiver.secrets["/hooks"] = json.loads(added.stdout)["secret"]

    # 1. Region A holds the history: a job completes there and reaches B through the mirror A -> B.
    pipeline_a = Pipeline(a, tmp_path / "run-a.log").start()
    try:
        first = _submit(a, "a", wait=True)
        assert first["state"] == "completed", first
        wait_for(lambda: _region_status(a)["events_behind"] == 0, 90, "the mirror A -> B to carry the first job")

        # 2. Planned failover to B: A's processors see the fence and exit 3; B's start.
        started = time.monotonic()
        failover = _cli_json(a, "region", "failover", "--to", "b", "--why", "planned test: maintenance of a")
        timings["failover_to_b_s"] = time.monotonic() - started
        assert (failover["to_region"], failover["planned"], failover["epoch"]) == ("b", True, 1)
        assert "drained" in failover["steps_s"] and failover["lost_attempts"] == []
        wait_for(lambda: pipeline_a.process.poll() is not None, 60, "region A's processors to stop on the fence")
        assert pipeline_a.process.returncode == 3, pipeline_a.log_text()[-3000:]
    finally:
        pipeline_a.stop()

    # 3. More work in B; meanwhile A's log gets a record B never sees (as after an unplanned failover).
    orphan_key, orphan_body = _upload_only_in_a(a)
    second = _submit(a, "b", wait=True)
    assert second["state"] == "completed", second

    # 4. Only a region another took over from rejoins as the standby: B holds the history, so B is refused.
    refused = tapeline_cli(a, "region", "rejoin", "b", "--as-standby", timeout_s=120)
    assert refused.returncode == 2 and "region b holds the job history" in refused.stderr, refused.stderr
    # Region A rejoins: its log, projections and diverged objects reset, then B -> A mirrored.
    started = time.monotonic()
    rejoin = _cli_json(a, "region", "rejoin", "a", "--as-standby", timeout_s=300)
    timings["rejoin_a_s"] = time.monotonic() - started
    assert (rejoin["region"], rejoin["active"], rejoin["epoch"]) == ("a", "b", 1)
    assert a.jobs_topic in rejoin["topics_reset"]
    assert rejoin["records_copied"] == 0  # the planned failover wrote its fence into A already
    assert {"job_state", "projector_offsets", "region_objects"} <= set(rejoin["tables_reset"])
    assert not {"schema_migrations", "stall_policy", "webhook_endpoints"} & set(rejoin["tables_reset"])
    # Only the object B's log never named is set aside; the first job's objects reached B with the same bytes.
    moved_to = f"orphans/region-a/epoch-1/{orphan_key}"
    assert rejoin["set_aside"] == [{"key": orphan_key, "moved_to": moved_to, "reason": "orphan"}]
    store_a = ObjectStore(a)
    assert store_a.head(orphan_key) is None and store_a.get_bytes(moved_to) == orphan_body
    first_source = next(e.object_key for e in committed_events(b, b.uploads_topic)
                        if e.event_type == "UploadCompleted" and ev.job_id_for(e.upload_id) == first["job_id"])
    assert store_a.head(first_source) is not None  # kept in place: B names it with the same sha256
    assert (Path(a.home) / "rejoin" / "epoch-1.json").is_file()
    assert read_state(home_paths(a))["standby"]["reset_at_epoch"] == 1

    # 5. The mirror B -> A catches up: region status measures from the active region B into A.
    started = time.monotonic()
    status = wait_for(lambda: (s := _region_status(a))["events_behind"] == 0 and s["objects"].get("pending") == 0
                      and s["objects"].get("named", 0) > 0 and s, 180, "the mirror and replicator B -> A to catch up")
    timings["mirror_b_to_a_caught_up_s"] = time.monotonic() - started
    assert (status["active"], status["standby"], status["direction"]) == ("b", "a", "b -> a")
    assert status["mirror"]["up"] and status["objects"]["replicator"]["up"] and status["exact"]
    stack = _cli_json(a, "stack", "status", timeout_s=120)
    assert stack["region_a_standby"]["mirror"]["up"] is True
    assert stack["region_a_standby"]["mirror"]["address"] == "b -> a"
    assert stack["region_a_standby"]["replicator"]["up"] is True
    assert stack["region_b"]["mirror"]["up"] is False  # the flow A -> B stays stopped while B is active

    # 6. A job in flight in B, then the planned switch back to A.
    third = _submit(a, "b", wait=False)["job_id"]
    wait_for(lambda: (row := _state(b, third)) is not None and row["state"] == "running", 120,
             "the third job to be running in region B")
    started = time.monotonic()
    failback = _cli_json(a, "region", "failover", "--to", "a", "--why", "failback", timeout_s=400)
    timings["failback_to_a_s"] = time.monotonic() - started
    assert (failback["from_region"], failback["to_region"], failback["planned"], failback["epoch"]) == ("b", "a", True, 2)
    assert failback["steps_s"]["drained"] < failback["steps_s"]["mirror_stopped"]
    # Nothing committed in B is missing in A after the drain: per topic and partition, by committed counts...
    lag = measure_region_lag(b, a, mirrored_topics(b), timeout_s=60)
    assert lag.events_behind == 0 and lag.exact, lag.as_dict()
    # ...and every committed lifecycle event of B is in A, by event id.
    in_b = {e.event_id for e in committed_events(b, b.jobs_topic, timeout_s=60)}
    in_a = {e.event_id for e in committed_events(a, a.jobs_topic, timeout_s=60)}
    assert in_b and not (in_b - in_a), f"{len(in_b - in_a)} events of B missing in A"
    assert supervisor.running_pid(b) is None  # B's processors stopped by their guard
    assert stack_mirror_down(a)  # the failover stopped the mirror B -> A (its files under A's home)

    # The job in flight was delayed by the switch: one JobDelayed in A's log, one job.delayed to its
    # submitter's endpoint, from the region now serving it (issue 41 item 5).
    assert failback["delayed_jobs"] == 1 and "customers_told" in failback["steps_s"]
    delayed = wait_for(lambda: _delayed_posts(receiver), 60, "region A to send job.delayed of the job in flight")
    assert [(d["data"]["job_id"], d["data"]["serving_region"], d["data"]["from_region"]) for d in delayed] == \
        [(third, "a", "b")], delayed
    assert "region b was left for region a (planned switch: failback)" in delayed[0]["data"]["reason"]
    # The same failover's JobDelayed written again (as a second run of the command writes it): a
    # duplicate of its dedup key, applied once, never sent again.
    from cli.wiring import build_runtime
    from domain.regions import delayed_event
    from processors.runtime import transact
    from regions.authority import read_regions

    record = read_regions({"a": a, "b": b}).authority.record
    runtime = build_runtime(a, "test-failover-again")
    try:
        again = delayed_event({"job_id": third, "state": "queued"}, record, recorded_by=runtime.recorded_by,
                              stamp=system_clock.stamp())
        producer = runtime.events.transactional_producer(f"{a.app_name}.test-failover-again")
        transact(producer, lambda: runtime.produce(producer, [(a.jobs_topic, again)]), name="test")
    finally:
        runtime.close()
    written = [e for e in of_job(committed_events(a, timeout_s=60), third, "JobDelayed")]
    assert len(written) == 2 and len({e.dedup_key for e in written}) == 1

    # 7. The job in flight completes in A, and so does one submitted after the switch.
    wait_for(lambda: (row := _state(a, third)) is not None and row["state"] == "completed", 300,
             "the job in flight to complete in region A")
    fourth = _submit(a, "a", wait=True)
    assert fourth["state"] == "completed", fourth
    assert len(_delayed_posts(receiver)) == 1  # the duplicate was not sent; the fourth job was never delayed
    jobs = [first["job_id"], second["job_id"], third, fourth["job_id"]]
    completions = _completions(a)
    assert {job: len(completions[job]) for job in jobs} == {job: 1 for job in jobs}
    # The fourth job ran only in A: its JobCompleted is A's own, never in B's log.
    assert fourth["job_id"] not in {e.job_id for e in committed_events(b, b.jobs_topic, timeout_s=60)}

    # 8. Region B becomes the standby again: `stack up --region b` resets it (B held the history at epoch 1),
    # then mirrors A -> B from the start of A's log.
    started = time.monotonic()
    up = tapeline_cli(a, "stack", "up", "--region", "b", timeout_s=300)
    timings["standby_b_again_s"] = time.monotonic() - started
    assert up.returncode == 0, f"{up.stdout}\n{up.stderr}"
    assert "reset as the standby" in up.stderr
    assert read_state(home_paths(b))["standby"]["reset_at_epoch"] == 2
    status = wait_for(lambda: (s := _region_status(a))["events_behind"] == 0 and s["objects"].get("pending") == 0
                      and s, 180, "the mirror A -> B to catch up again")
    assert status["direction"] == "a -> b" and status["mirror"]["up"]
    completions_b = _completions(b)
    assert {job: len(completions_b[job]) for job in jobs} == {job: 1 for job in jobs}
    again = tapeline_cli(a, "stack", "up", "--region", "b", timeout_s=120)  # once per epoch: no second reset
    assert again.returncode == 0 and "reset as the standby" not in again.stderr, again.stderr
    store_a.delete(moved_to)  # the shared bucket
    print(f"failback timings: {json.dumps({k: round(v, 1) for k, v in timings.items()})}")
    print(f"failover to b steps: {failover['steps_s']}\nrejoin a steps: {rejoin['steps_s']}\n"
          f"failback steps: {failback['steps_s']}, lost attempts {failback['lost_attempts']}")


def stack_mirror_down(a: Settings) -> bool:
    """The mirror B -> A is not running (its pid file may stay behind)."""
    from regions.mirror import _markers
    from tapeline.home import owned_pid

    return owned_pid(home_paths(a).mirror / "mirror.pid", _markers(home_paths(a))) is None


def test_rejoin_without_as_standby_changes_nothing(regions) -> None:
    a, _b = regions
    done = tapeline_cli(a, "region", "rejoin", "a", timeout_s=60)
    assert done.returncode == 2 and "--as-standby" in done.stderr
    with psycopg.connect(a.database_url) as conn:  # the projections are still there
        assert conn.execute("SELECT count(*) FROM schema_migrations").fetchone()[0] > 0

"""Media replication from region A to region B against real services (docs/regions.md "Media
replication"): objects written to region A's S3 and lifecycle events naming them written to region
A's Kafka; MirrorMaker 2 carries the events to region B, and the replicator `tapeline stack up
--region b` starts beside it copies every object the mirrored log names to region B's S3.

Region B comes up once for the module (test_region_mirror.py's `regions` fixture, with this module's
faster retry settings), on free ports, and goes down at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Iterator

import psycopg
import pytest

from domain import events as ev
from domain.codec import encode
from processors.runtime import transact
from tapeline import kafka
from tapeline.clock import system_clock
from tapeline.objectstore import ObjectStore
from tapeline.settings import Settings
from tapeline.home import owned_pid, home_paths
from regions.replicator_process import _markers as replicator_markers
from cli.wiring import build_runtime
from tests.conftest import settings_env, tapeline_cli, wait_for
from tests.integration import test_region_mirror

pytestmark = pytest.mark.integration
regions = test_region_mirror.regions
"""The module's region B, up with the mirror and the replicator (test_region_mirror.py's fixture)."""

MEDIA = ev.SourceMedia(format_name="mov", duration_s=4.0, width=640, height=360, display_width=640,
                       display_height=360, rotation=0, fps=25.0, frames=100, video_codec="h264")


@pytest.fixture(scope="module")
def isolated(isolated: Settings) -> Iterator[Settings]:
    """The shared `isolated` settings with a replicator that retries a bad object within 2 s, and serves
    its metrics on a free port, measuring region B's lag every 2 s."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield isolated.model_copy(update={"replicate_retry_first_s": 0.2, "replicate_retry_max_s": 2.0,
                                      "replicate_health_port": port, "replicate_measure_every_s": 2.0,
                                      "replicate_measure_timeout_s": 10.0})


def _sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


class Job:
    """One job's objects in region A's bucket and the events naming them, as the pipeline writes them:
    a source, two checkpoints, a transcode attempt's outputs, the publish attempt's published copies
    and master playlist, and `Published`."""

    def __init__(self, a: Settings, segments: int = 3) -> None:
        self.upload_id = f"u-{uuid.uuid4()}"
        self.job_id = ev.job_id_for(self.upload_id)
        job = self.job_id
        self.objects: dict[str, bytes] = {f"uploads/{self.upload_id}/clip.mp4": os.urandom(300_000)}
        work = f"work/{job}/transcode/1/360p/"
        for i in range(segments):
            self.objects[f"{work}seg_{i:05d}.ts"] = os.urandom(60_000 + i)
        self.objects[f"{work}index.m3u8"] = ("#EXTM3U\n" + "".join(f"#EXTINF:2.0,\nseg_{i:05d}.ts\n"
                                                                    for i in range(segments))).encode()
        for relative in [k.removeprefix(work) for k in list(self.objects) if k.startswith(work)]:
            self.objects[f"published/{job}/360p/{relative}"] = self.objects[work + relative]  # promoted unchanged
        self.master_key = f"published/{job}/master.m3u8"
        self.master = b"#EXTM3U\n#EXT-X-STREAM-INF:BANDWIDTH=800000,RESOLUTION=640x360\n360p/index.m3u8\n"
        self.objects[self.master_key] = self.master
        self.source_key = f"uploads/{self.upload_id}/clip.mp4"
        self.work = work

    def output(self, key: str) -> ev.OutputFile:
        return ev.OutputFile(key=key, sha256=_sha(self.objects[key]), size_bytes=len(self.objects[key]),
                             content_type="video/mp2t")

    def store_in_a(self, store: ObjectStore, skip: tuple[str, ...] = ()) -> None:
        for key, body in self.objects.items():
            if key == self.master_key:  # as the origin writes it: conditional, with its idempotency key
                store.put_if_absent(key, body, "application/vnd.apple.mpegurl",
                                    metadata={"idempotency-key": f"{self.job_id}:origin"})
            elif key not in skip:
                store.s3.put_object(Bucket=store.bucket, Key=key, Body=body)

    def events(self, checkpoint_sha: str | None = None) -> tuple[ev.UploadCompleted, list[ev.Event]]:
        """(the upload, the lifecycle events); `checkpoint_sha` replaces the first checkpoint's sha256."""
        common = dict(job_id=self.job_id, recorded_by="test", correlation_id=self.upload_id)
        stamp = system_clock.stamp
        source = self.objects[self.source_key]
        upload = ev.UploadCompleted.new(stamp(), stage="intake", attempt=0, upload_id=self.upload_id, bucket="b",
                                        object_key=self.source_key, size_bytes=len(source), sha256=_sha(source),
                                        filename="clip.mp4", priority="standard", **common)
        segments = sorted(k for k in self.objects if k.startswith(self.work) and k.endswith(".ts"))
        published = sorted(k for k in self.objects if k.startswith("published/") and k != self.master_key)
        rendition = ev.Rendition(name="360p", width=640, height=360, video_bitrate_kbps=800,
                                 playlist_key=f"published/{self.job_id}/360p/index.m3u8", url="http://x")
        lifecycle = [
            ev.JobAccepted.new(stamp(), stage="intake", attempt=0, upload_id=self.upload_id, source_key=self.source_key,
                               source_sha256=_sha(source), source_size_bytes=len(source), priority="standard",
                               profile="default", media=MEDIA, ladder=[rendition.model_copy(
                                   update={"playlist_key": None, "url": None})], **common),
            *[ev.CheckpointRecorded.new(stamp(), stage="transcode", attempt=1, claim_token="t1", sequence=i,
                                        segment_index=i, rendition="360p", object_key=key,
                                        sha256=(checkpoint_sha if i == 0 and checkpoint_sha else
                                                _sha(self.objects[key])),
                                        frames=50, media_start_s=2.0 * i, media_duration_s=2.0, **common)
              for i, key in enumerate(segments[:2])],
            ev.AttemptSucceeded.new(stamp(), stage="transcode", attempt=1, claim_token="t1",
                                    outputs=[self.output(k) for k in sorted(k for k in self.objects
                                                                            if k.startswith(self.work))],
                                    renditions=[], elapsed_s=1.0, **common),
            ev.AttemptSucceeded.new(stamp(), stage="publish", attempt=1, claim_token="t2",
                                    outputs=[self.output(k) for k in published + [self.master_key]],
                                    renditions=[rendition], elapsed_s=1.0, **common),
            ev.Published.new(stamp(), stage="publish", attempt=1, claim_token="t2", provider="origin",
                             provider_ref=self.master_key, master_key=self.master_key, master_url="http://x",
                             renditions=[rendition], **common),
        ]
        return upload, lifecycle


def _write_events(a: Settings, upload: ev.UploadCompleted, lifecycle: list[ev.Event]) -> None:
    """The upload through an idempotent producer keyed by upload id (as `tapeline submit`), the lifecycle
    events in one committed transaction (as the processors)."""
    producer = kafka.idempotent_producer(a)
    partitions = kafka.partition_count(producer, a.uploads_topic)
    producer.produce(a.uploads_topic, key=upload.upload_id.encode(), partition=kafka.partition_for(upload.upload_id, partitions),
                     value=encode(upload.to_record()))
    assert producer.flush(30) == 0
    runtime = build_runtime(a, "region-media-test")
    try:
        writer = runtime.events.transactional_producer(f"{a.app_name}.region-media-test.{uuid.uuid4().hex[:6]}")
        transact(writer, lambda: runtime.produce(writer, [(a.jobs_topic, e) for e in lifecycle]))
    finally:
        runtime.close()


def _status(a: Settings) -> dict:
    done = tapeline_cli(a, "region", "status", "--json", timeout_s=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _rows(b: Settings) -> dict[str, dict]:
    with psycopg.connect(b.database_url, row_factory=psycopg.rows.dict_row) as conn:
        rows = conn.execute("SELECT object_key, state, sha256, expected_sha256, failure, written, attempts "
                            "FROM region_objects").fetchall()
    return {row["object_key"]: row for row in rows}


def _in_b(store: ObjectStore, key: str) -> bytes | None:
    return None if store.head(key) is None else store.get_bytes(key)


def _caught_up(a: Settings) -> dict | None:
    status = _status(a)
    return status if status["events_behind"] == 0 and status["objects"].get("pending") == 0 else None


def test_every_object_the_mirrored_log_names_reaches_region_b_with_its_sha256(regions) -> None:
    a, b = regions
    store_a, store_b = ObjectStore(a), ObjectStore(b)
    job = Job(a)
    job.store_in_a(store_a)
    _write_events(a, *job.events())
    status = wait_for(lambda: _caught_up(a) if job.master_key in _rows(b) else None, 90,
                      "region B to hold every object of the job")
    for key, body in job.objects.items():
        assert _in_b(store_b, key) == body, key
    # The origin's idempotency key goes with the master playlist (B's origin lookup reads it after a failover).
    assert store_b.head_metadata(job.master_key)["idempotency-key"] == f"{job.job_id}:origin"
    rows = _rows(b)
    assert {k for k in rows} >= set(job.objects)
    assert all(rows[k]["state"] == "replicated" and rows[k]["sha256"] == _sha(job.objects[k]) and rows[k]["written"]
               for k in job.objects)
    objects = status["objects"]
    assert objects["named"] == objects["replicated"] == len(rows) and objects["pending"] == 0
    assert objects["replicated_bytes"] >= sum(len(body) for body in job.objects.values())
    assert objects["oldest_pending_age_s"] is None and objects["replicator"]["up"] is True


def _metrics(a: Settings) -> dict[str, float]:
    """The replicator's `tapeline_region_*` samples (`name{label=value,...}` -> value) from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{a.replicator_health_address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name.startswith("tapeline_region_")}


def test_the_replicator_exports_region_bs_lag_and_the_dashboard_panel_shows_it(regions) -> None:
    """After the first test's job: the replicator's own periodic measurement (regions/monitor.py)
    says what `region status` says, on its metrics port, in /health/deep and on the dashboard's panel."""
    from projections.region_panel import RegionPanelSource

    a, b = regions
    started = time.time()
    status = wait_for(lambda: _caught_up(a), 60, "region B caught up")

    def measured_after_catch_up() -> dict[str, float] | None:
        found = _metrics(a)
        return found if found["tapeline_region_lag_measured_timestamp_seconds"] >= started else None

    metrics = wait_for(measured_after_catch_up, 30, "a whole measurement by the replicator")
    assert sum(v for k, v in metrics.items() if k.startswith("tapeline_region_lag_events{")) == 0
    assert {k.split("=", 1)[1].rstrip("}") for k in metrics if k.startswith("tapeline_region_lag_events{")} == \
        set(status["topics"])  # every mirrored topic, as region status lists them
    assert metrics["tapeline_region_lag_exact"] == 1
    assert metrics["tapeline_region_objects_pending"] == 0
    assert metrics["tapeline_region_objects_pending_oldest_seconds"] == 0
    assert metrics["tapeline_region_objects_replicated"] == status["objects"]["replicated"] > 0
    assert metrics["tapeline_region_mirror_heartbeat_age_seconds"] < 30  # MM2 writes one a second
    assert metrics["tapeline_region_lag_measurements_total{result=complete}"] >= 1
    with urllib.request.urlopen(f"http://{a.replicator_health_address}/health/ready", timeout=5) as resp:
        assert resp.status == 200  # it follows region B's log
    view = RegionPanelSource.for_settings(a).get()
    assert view["state"] == "measured", view
    assert view["text"] == "region B is behind region A within its alerts' thresholds", view
    assert {r["name"]: r["value"] for r in view["rows"]}["events behind"] == "0"


def test_bytes_that_do_not_match_their_recorded_sha256_are_not_replicated_until_they_do(regions) -> None:
    a, b = regions
    store_a, store_b = ObjectStore(a), ObjectStore(b)
    job = Job(a, segments=2)
    first_checkpoint, second_checkpoint = sorted(k for k in job.objects if k.startswith(job.work) and k.endswith(".ts"))
    recorded = _sha(b"the bytes the attempt recorded")
    job.store_in_a(store_a)
    upload, lifecycle = job.events(checkpoint_sha=recorded)
    lifecycle = [e for e in lifecycle if e.event_type == "CheckpointRecorded"]  # the checkpoints only
    _write_events(a, upload, lifecycle)
    wait_for(lambda: (rows := _rows(b)).get(first_checkpoint, {}).get("failure") == "sha256_mismatch"
             and rows.get(second_checkpoint, {}).get("state") == "replicated", 90,
             "the mismatching checkpoint to be recorded as pending, the other one replicated")
    status = _status(a)["objects"]
    assert status["pending"] == 1 and status["pending_by_reason"] == {"sha256_mismatch": 1}
    assert status["oldest_pending_age_s"] is not None and status["replicated"] == status["named"] - 1
    assert _in_b(store_b, first_checkpoint) is None  # never written to B
    row = _rows(b)[first_checkpoint]
    assert row["state"] == "pending" and row["sha256"] is None and row["expected_sha256"] == recorded
    # A's object is put right: the retry (at most 2 s apart here) copies it.
    store_a.s3.put_object(Bucket=store_a.bucket, Key=first_checkpoint, Body=b"the bytes the attempt recorded")
    wait_for(lambda: _rows(b)[first_checkpoint]["state"] == "replicated", 60, "the retried checkpoint to replicate")
    assert _in_b(store_b, first_checkpoint) == b"the bytes the attempt recorded"
    assert _rows(b)[first_checkpoint]["attempts"] >= 1
    assert wait_for(lambda: _caught_up(a), 60, "nothing pending")["objects"]["pending"] == 0


def test_an_object_not_yet_in_region_a_is_pending_until_it_arrives_never_assumed(regions) -> None:
    a, b = regions
    store_a, store_b = ObjectStore(a), ObjectStore(b)
    job = Job(a, segments=2)
    late = sorted(k for k in job.objects if k.startswith(job.work) and k.endswith(".ts"))[0]
    job.store_in_a(store_a, skip=(late,))
    upload, lifecycle = job.events()
    _write_events(a, upload, [e for e in lifecycle if e.event_type == "CheckpointRecorded"])
    wait_for(lambda: _rows(b).get(late, {}).get("failure") == "missing_in_a", 90, "the late checkpoint to be pending")
    status = _status(a)["objects"]
    assert status["pending_by_reason"] == {"missing_in_a": 1} and _in_b(store_b, late) is None
    store_a.s3.put_object(Bucket=store_a.bucket, Key=late, Body=job.objects[late])  # it arrives
    wait_for(lambda: _rows(b)[late]["state"] == "replicated", 60, "the late checkpoint to replicate once in A")
    assert _in_b(store_b, late) == job.objects[late]
    assert wait_for(lambda: _caught_up(a), 60, "nothing pending")["objects"]["pending"] == 0


def _stop_stack_replicator(b: Settings) -> None:
    """SIGTERM the replicator `stack up --region b` started, and wait until it is gone."""
    paths = home_paths(b)
    pid_file = paths.home / "replicator" / "replicator.pid"
    pid = owned_pid(pid_file, replicator_markers(paths))
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: owned_pid(pid_file, replicator_markers(paths)) is None, 30, "the replicator to stop on SIGTERM")


def test_while_region_a_s3_does_not_answer_the_replicator_waits_on_the_record(regions, tmp_path: Path) -> None:
    a, b = regions
    store_a, store_b = ObjectStore(a), ObjectStore(b)
    _stop_stack_replicator(b)
    job = Job(a, segments=1)
    job.store_in_a(store_a)
    upload, lifecycle = job.events()
    _write_events(a, upload, lifecycle)
    wait_for(lambda: _status(a)["events_behind"] == 0, 60, "the mirror to carry the job's events")
    before = _rows(b)
    # A replicator whose region A store is a port nobody answers on (A's S3 down).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]
    log = tmp_path / "replicate.log"
    with open(log, "wb") as out:
        waiting = subprocess.Popen([sys.executable, "-m", "cli.main", "region", "replicate", "--workdir",
                                    str(tmp_path)], stdout=out, stderr=subprocess.STDOUT,
                                   env={**settings_env(a), "TAPELINE_S3_ENDPOINT": f"http://127.0.0.1:{dead}",
                                        "TAPELINE_S3_MAX_ATTEMPTS": "1"})
        try:
            wait_for(lambda: log.read_text().count("store unavailable; waiting on the record") >= 3, 60,
                     "the replicator to retry the record while A's store does not answer")
            assert _rows(b) == before  # nothing recorded: no object assumed present, none parked
            assert not any(_in_b(store_b, key) for key in job.objects)
            objects = _status(a)["objects"]
            assert objects["pending"] >= len(job.objects) and objects["pending_by_reason"] == {"unread": objects["pending"]}
        finally:
            waiting.send_signal(signal.SIGTERM)  # stops cleanly, mid-wait
            assert waiting.wait(30) == 0
    assert '"event": "replicator stopped"' in log.read_text()
    restarted = tapeline_cli(a, "stack", "up", "--region", "b", timeout_s=180)
    assert restarted.returncode == 0, restarted.stderr
    wait_for(lambda: _caught_up(a), 90, "everything replicated once A's store answers")
    assert all(_in_b(store_b, key) == body for key, body in job.objects.items())


def test_a_replicator_killed_mid_copy_restarts_and_replicates_everything_once(regions, tmp_path: Path) -> None:
    a, b = regions
    store_a, store_b = ObjectStore(a), ObjectStore(b)
    _stop_stack_replicator(b)
    assert '"event": "replicator stopped"' in (home_paths(b).home / "replicator" / "replicator.log").read_text()
    job = Job(a, segments=6)
    job.store_in_a(store_a)
    _write_events(a, *job.events())
    wait_for(lambda: _status(a)["events_behind"] == 0, 60, "the mirror to carry the job's events")
    before = _rows(b)
    # A replicator of our own that kills itself (SIGKILL) once an object is in B and not yet recorded.
    crashed = subprocess.run([sys.executable, "-m", "cli.main", "region", "replicate", "--workdir", str(tmp_path)],
                             env={**settings_env(a), "TAPELINE_CRASH_POINTS": "replicate.after_copy",
                                  "TAPELINE_CRASH_ONCE_DIR": str(tmp_path)},
                             capture_output=True, text=True, timeout=120)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    rows = _rows(b)
    unrecorded = [k for k in job.objects if k not in rows and _in_b(store_b, k) is not None]
    assert len(unrecorded) == 1, unrecorded  # copied, then killed before its row
    assert set(rows) == set(before)  # nothing of the job recorded yet: the crash was at its first copy
    restarted = tapeline_cli(a, "stack", "up", "--region", "b", timeout_s=180)  # as a user restarts it
    assert restarted.returncode == 0, restarted.stderr
    status = wait_for(lambda: _caught_up(a) if set(job.objects) <= set(_rows(b)) else None, 90,
                      "the restarted replicator to finish")
    rows = _rows(b)
    for key, body in job.objects.items():
        assert _in_b(store_b, key) == body and rows[key]["state"] == "replicated"
        assert rows[key]["written"] is (key not in unrecorded)  # the one copied before the kill was found in B
    objects = status["objects"]
    assert objects["named"] == objects["replicated"] == len(rows) and objects["pending"] == 0  # each key once

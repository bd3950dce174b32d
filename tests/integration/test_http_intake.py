"""The HTTP intake (`POST /uploads` on `tapeline serve`, issue 9) against real Kafka, PostgreSQL, S3
and the real pipeline: backpressure under a load from another process, Idempotency-Key under
concurrency, the per-submitter in-flight cap and the storage guard."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import psycopg
import pytest

from producers.http_intake import upload_id_for_key
from projections.read_model import open_reader
from domain import events as ev
from tapeline.samples import sample_video
from tests.conftest import REPO, settings_env, wait_for
from tests.integration.helpers import committed_events

pytestmark = pytest.mark.integration
TOKENS = {"tok-alice": "alice", "tok-bob": "bob", "tok-carol": "carol"}


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> bytes:
    """A 1 s 160x90 H.264 clip without audio (a transcode of it takes about a second)."""
    path = tmp_path_factory.mktemp("clip") / "tiny.mp4"
    subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-y", "-i", str(sample_video("bigbuckbunny.mp4")), "-t", "1",
                    "-an", "-vf", "scale=160:90", "-c:v", "libx264", "-preset", "ultrafast", str(path)],
                   check=True, timeout=60)
    return path.read_bytes()


@contextlib.contextmanager
def intake_server(settings, log_path: Path, processes: list | None = None) -> Iterator[str]:
    """`tapeline serve` as a child process with `settings`; yields its base URL (and appends its
    `Popen` to `processes` when given)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(log_path, "ab")
    server = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--port", str(port)],
                              env=settings_env(settings), stdout=log, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    if processes is not None:
        processes.append(server)

    def live() -> bool:
        assert server.poll() is None, log_path.read_text()[-3000:]
        try:
            return httpx.get(f"{url}/health/live", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False
    try:
        wait_for(live, 30, "tapeline serve to answer")
        yield url
    finally:
        server.terminate()
        server.wait(20)
        log.close()


def post(url: str, body, token: str = "tok-alice", **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}", **kw.pop("headers", {})}
    return httpx.post(f"{url}/uploads", content=body, headers=headers, timeout=60.0, **kw)


def uploads_published(settings) -> list[ev.UploadCompleted]:
    return [e for e in committed_events(settings, settings.uploads_topic) if isinstance(e, ev.UploadCompleted)]


def job_states(settings, job_ids: list[str]) -> dict[str, str]:
    with open_reader(settings) as conn:
        rows = conn.execute("SELECT job_id, state FROM job_state WHERE job_id = ANY(%s)", (job_ids,)).fetchall()
    return {r["job_id"]: r["state"] for r in rows}


def test_the_same_idempotency_key_twice_concurrently_is_one_job(isolated, clip, tmp_path):
    settings = isolated.model_copy(update={"intake_tokens": TOKENS})
    with intake_server(settings, tmp_path / "serve.log") as url:
        def slow_body() -> Iterator[bytes]:  # the first request is still streaming when the second arrives
            for i in range(0, len(clip), 4096):
                time.sleep(0.02)
                yield clip[i:i + 4096]
        answers: dict[str, httpx.Response] = {}
        first = threading.Thread(target=lambda: answers.update(first=post(
            url, slow_body(), params={"priority": "archive"}, headers={"Idempotency-Key": "order-17"})))
        first.start()
        upload_id = upload_id_for_key("alice", "order-17")

        def uploading() -> bool:
            with psycopg.connect(settings.database_url) as conn:
                row = conn.execute("SELECT state FROM intake_uploads WHERE upload_id = %s", (upload_id,)).fetchone()
            return row is not None and row[0] == "uploading"
        wait_for(uploading, 20, "the first request to be uploading", interval_s=0.02)
        second = post(url, clip, params={"priority": "archive"}, headers={"Idempotency-Key": "order-17"})
        assert first.is_alive() or "first" in answers
        first.join(60)
        third = post(url, clip, params={"priority": "archive"}, headers={"Idempotency-Key": "order-17"})
        other_body = post(url, clip[:-10], params={"priority": "archive"}, headers={"Idempotency-Key": "order-17"})
        other_params = post(url, clip, params={"priority": "index"}, headers={"Idempotency-Key": "order-17"})
        bob = post(url, clip, token="tok-bob", params={"priority": "archive"}, headers={"Idempotency-Key": "order-17"})
    one = answers["first"]
    assert one.status_code == second.status_code == third.status_code == 202
    assert one.json() == second.json() == third.json()
    assert one.json() == {"job_id": ev.job_id_for(upload_id), "upload_id": upload_id,
                          "status_url": f"/api/jobs/{ev.job_id_for(upload_id)}"}
    assert one.headers["location"] == second.headers["location"] == one.json()["status_url"]
    assert second.headers.get("idempotent-replayed") == "true" and "idempotent-replayed" not in one.headers
    assert other_body.status_code == 422 and "different body" in other_body.json()["reason"]
    assert other_params.status_code == 422 and "priority=archive" in other_params.json()["reason"]
    assert bob.status_code == 202 and bob.json()["job_id"] != one.json()["job_id"]  # keys are per submitter
    published = [e for e in uploads_published(settings) if e.upload_id == upload_id]
    assert len(published) == 1 and published[0].size_bytes == len(clip) and published[0].priority == "archive"


def test_in_flight_cap_429_storage_507_and_no_token_401(isolated, clip, tmp_path):
    settings = isolated.model_copy(update={"intake_tokens": TOKENS, "intake_max_in_flight_per_submitter": 2,
                                           "intake_retry_after_max_s": 7.0})
    before = len(uploads_published(settings))
    with intake_server(settings, tmp_path / "serve.log") as url:  # no pipeline yet: accepted jobs stay in flight
        answers = [post(url, clip, token="tok-carol", params={"priority": "index"}) for _ in range(3)]
        bob = post(url, clip, token="tok-bob", params={"priority": "archive"})
        nobody = post(url, clip, token="tok-mallory")
    assert [a.status_code for a in answers] == [202, 202, 429]
    assert answers[2].headers["retry-after"] == "7"  # nothing completed recently: the ceiling
    assert answers[2].json()["error"] == "in_flight_cap"
    assert "submitter 'carol' has 2 jobs in flight, at or past its cap 2" in answers[2].json()["reason"]
    assert bob.status_code == 202  # another submitter is not held by carol's flood
    assert nobody.status_code == 401
    assert len(uploads_published(settings)) == before + 3

    full = settings.model_copy(update={"storage_limit_bytes": 1, "max_upload_bytes": 1000})
    with intake_server(full, tmp_path / "serve-full.log") as url:
        too_big = post(url, clip)  # Content-Length past max_upload_bytes: refused before admission
        refused = post(url, clip[:500])
    assert too_big.status_code == 413 and f"{len(clip)} bytes exceeds max_upload_bytes = 1000" in too_big.json()["reason"]
    assert refused.status_code == 507 and refused.json()["error"] == "storage_full"
    assert "at or past its limit storage_limit_bytes = 1" in refused.json()["reason"]
    assert "retry-after" not in refused.headers
    assert len(uploads_published(settings)) == before + 3  # nothing stored or published


def test_a_load_past_capacity_gets_503s_and_every_accepted_upload_completes_once(isolated, pipeline, clip, tmp_path):
    settings = isolated.model_copy(update={
        "intake_tokens": TOKENS, "intake_tier_capacity": {"standard": 3}, "intake_max_in_flight_per_submitter": 1000,
        # one submitter sends the whole load: the tier's capacity is measured here, not its share
        "intake_submitter_tier_share": 1.0,
        "intake_retry_after_min_s": 1.0, "intake_retry_after_max_s": 3.0, "intake_throughput_window_s": 60.0})
    (tmp_path / "clip.mp4").write_bytes(clip)
    with intake_server(settings, tmp_path / "serve.log") as url:
        load = subprocess.run([sys.executable, "-m", "bench.intake_load", url, "tok-alice", str(tmp_path / "clip.mp4"),
                               "--uploads", "10", "--deadline", "45", "--retry"],
                              capture_output=True, text=True, timeout=120, cwd=REPO, env=settings_env(settings))
        assert load.returncode == 0, load.stderr[-3000:]
        uploads = json.loads(load.stdout)["uploads"]
        accepted = [u["response"] for u in uploads if u["response"] and "job_id" in u["response"]]
        ids = [a["job_id"] for a in accepted]
        wait_for(lambda: job_states(settings, ids) == dict.fromkeys(ids, "completed"), 150,  # a job the projector has not reached yet has no row
                 "every accepted upload to complete")
    print([[(a["status"], a["retry_after"], round(a["started"], 1)) for a in u["attempts"]] for u in uploads])
    first = sorted(u["attempts"][0]["status"] for u in uploads)
    assert first == [202] * 3 + [503] * 7  # capacity 3: the first wave admits exactly 3 (admission is serialised)
    refusals = [a for u in uploads for a in u["attempts"] if a["status"] == 503]
    assert refusals and all(1 <= int(a["retry_after"]) <= 3 for a in refusals)
    assert all({a["status"] for a in u["attempts"]} <= {202, 503} for u in uploads)
    assert len(accepted) >= 4 and len(set(ids)) == len(ids)  # a retried upload got in once capacity freed
    for a in accepted:
        assert a["status_url"] == f"/api/jobs/{a['job_id']}" and a["job_id"] == ev.job_id_for(a["upload_id"])
    published = [e for e in uploads_published(settings) if (e.submitter, e.priority) == ("alice", "standard")]
    assert sorted(e.job_id for e in published) == sorted(ids)  # refused uploads published nothing
    lifecycle = committed_events(settings)
    for job_id in ids:  # exactly once through the pipeline
        kinds = [e.event_type for e in lifecycle if e.job_id == job_id]
        assert kinds.count("JobAccepted") == 1 and kinds.count("JobCompleted") == 1, kinds


def test_submit_url_waits_out_a_503_then_completes(isolated, pipeline, clip, tmp_path):
    settings = isolated.model_copy(update={
        "intake_tokens": TOKENS, "intake_tier_capacity": {"index": 1}, "intake_max_in_flight_per_submitter": 1000,
        "intake_retry_after_min_s": 1.0, "intake_retry_after_max_s": 2.0,
        # the held body's first 1000 bytes make it moving (64 KiB/s x 0.01 s = 656 bytes), so it is
        # admitted and holds the slot; with the default 2 s window it would hold none
        "intake_body_rate_window_s": 0.01})
    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)
    release, answers, stderr = threading.Event(), {}, []

    def held_body() -> Iterator[bytes]:  # holds the index tier's one slot until the CLI has been refused
        yield clip[:1000]
        release.wait(90)
        yield clip[1000:]
    with intake_server(settings, tmp_path / "serve.log") as url:
        holder = threading.Thread(target=lambda: answers.update(busy=post(url, held_body(), params={"priority": "index"})))
        holder.start()

        def holding() -> bool:
            with psycopg.connect(settings.database_url) as conn:
                return conn.execute("SELECT count(*) FROM intake_uploads WHERE priority = 'index' AND submitter = 'alice' "
                                    "AND state = 'uploading'").fetchone()[0] == 1
        wait_for(holding, 20, "the held upload to be admitted", interval_s=0.05)
        cli = subprocess.Popen([sys.executable, "-m", "cli.main", "submit", str(path), "--url", url, "--token",
                                "tok-bob", "--priority", "index", "--retries", "60", "--wait", "--json", "--timeout", "120"],
                               env=settings_env(settings), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        reader = threading.Thread(target=lambda: stderr.extend(cli.stderr))
        reader.start()
        try:
            wait_for(lambda: any("intake busy" in line for line in stderr), 60, "submit to be refused and wait")
        finally:
            release.set()
        stdout = cli.stdout.read()
        assert cli.wait(180) == 0, "".join(stderr)[-3000:]
        reader.join(10)
        holder.join(60)
        busy = answers["busy"]
        first = httpx.get(f"{url}{busy.json()['status_url']}", timeout=10).json()["job"]
    assert busy.status_code == 202
    summary = json.loads(stdout)
    assert summary["state"] == "completed" and summary["job_id"] != busy.json()["job_id"]
    assert first["state"] == "completed" and first["completed_at"] <= summary["completed_at"]
    text = "".join(stderr)
    assert "intake busy (503 overloaded: tier 'index' has 1 jobs waiting or running, at or past its capacity 1" in text
    assert "retrying in 2 s" in text  # the estimate clamped to intake_retry_after_max_s
    submitted = [e for e in uploads_published(settings) if e.job_id == summary["job_id"]]
    assert len(submitted) == 1 and submitted[0].submitter == "bob" and submitted[0].priority == "index"

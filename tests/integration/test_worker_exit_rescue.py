"""A worker that dies on a host that survives is rescued at once, not after its lease (issue 21 A).

One `tapeline run --role all` (two transcode workers, a 60 s lease) for the module. Each test
submits a ~21 s real video, waits until its transcode reports progress, and then:

- kill -9 of the worker under its live supervisor: `StallDetected(worker_exited)` naming SIGKILL
  and the next attempt's `AttemptStarted` come within seconds (the lease would take 60 s), the job
  completes once, and the dead attempt ends `stalled`;
- the same with the supervisor stopped, and the worker restarted by hand under the dead child's
  stable name (what systemd or Kubernetes do): the restarted worker rescues the attempt;
- a worker that is only stopped (SIGSTOP) is not rescued: it is not dead, its lease covers it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from producers.submit import publish, upload
from tapeline.holdings import process_alive
from tapeline.samples import sample_video
from tests.conftest import Pipeline, settings_env, wait_for

pytestmark = pytest.mark.integration
LEASE_S = 60.0
RESCUE_BOUND_S = 8.0
"""Kill -> next attempt started, seconds: generous for two loaded cores; the lease is 60 s."""


@pytest.fixture(scope="module")
def world(isolated, tmp_path_factory):
    settings = isolated.model_copy(update={"lease_s": LEASE_S, "no_progress_timeout_s": LEASE_S,
                                           "transcode_workers": 2, "x264_preset": "ultrafast", "heartbeat_interval_s": 1.0,
                                           "handoff_timeout_s": 600.0})
    work = tmp_path_factory.mktemp("rescue")
    video = work / "long.mp4"
    subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-stream_loop", "3", "-i", str(sample_video()), "-c", "copy",
                    "-y", str(video)], check=True)
    pipeline = Pipeline(settings, work / "run.log").start()
    try:
        yield settings, pipeline, video, work
    finally:
        pipeline.stop()
        print(pipeline.log_text()[-4000:])


def rows(settings, sql, *params):
    with psycopg.connect(settings.database_url, row_factory=psycopg.rows.dict_row) as conn:
        return conn.execute(sql, params).fetchall()


def transcoding(settings, video: Path) -> tuple[str, int]:
    """Submit `video`; once its transcode reports progress, (job_id, pid of the worker holding it)."""
    submission = upload(settings, video)
    publish(settings, submission.event)
    job = submission.job_id

    def under_way():
        found = rows(settings, "SELECT * FROM job_state WHERE job_id = %s", job)
        return found[0] if found and found[0]["state"] == "running" and found[0]["stage"] == "transcode" \
            and (found[0]["progress_frames"] or 0) > 50 else None

    row = wait_for(under_way, 180, "a transcode under way", interval_s=0.05)
    return job, int(row["worker"].rsplit(":", 1)[1])


def first(settings, job, event_type, **match) -> dict | None:
    for row in rows(settings, "SELECT * FROM lifecycle_evidence WHERE job_id = %s AND event_type = %s AND applied"
                              " ORDER BY partition, \"offset\"", job, event_type):
        if all((row[k] if k in row else row["payload"].get(k)) == v for k, v in match.items()):
            return row
    return None


def completes_once(settings, job) -> None:
    wait_for(lambda: rows(settings, "SELECT 1 FROM job_state WHERE job_id = %s AND state = 'completed'", job),
             300, "the job to complete")
    completed = rows(settings, "SELECT count(*) AS n FROM lifecycle_evidence WHERE job_id = %s"
                               " AND event_type = 'JobCompleted' AND applied", job)
    assert completed[0]["n"] == 1


def test_a_worker_killed_under_its_supervisor_is_retried_at_once(world):
    settings, pipeline, video, _ = world
    job, pid = transcoding(settings, video)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    stall = wait_for(lambda: first(settings, job, "StallDetected", kind="worker_exited"), RESCUE_BOUND_S,
                     "StallDetected(worker_exited)", interval_s=0.05)
    assert f"worker process {pid} killed by SIGKILL" in stall["payload"]["detail"]
    started = wait_for(lambda: first(settings, job, "AttemptStarted", attempt=2), RESCUE_BOUND_S,
                       "the next attempt", interval_s=0.05)
    took = started["broker_ts"].timestamp() - killed_at
    print(f"kill -9 -> next attempt started: {took:.2f} s (lease {LEASE_S:g} s)")
    assert took < RESCUE_BOUND_S
    assert first(settings, job, "StallDetected", kind="lease_expired") is None
    completes_once(settings, job)
    outcome = rows(settings, "SELECT outcome, error_class FROM attempts WHERE job_id = %s AND stage = 'transcode'"
                             " AND attempt = 1", job)
    assert outcome == [{"outcome": "stalled", "error_class": "worker_lost"}]
    assert not list((settings.home / "run" / "holdings").glob(f"{settings.app_name}.*.{pid}.json"))


def test_a_stopped_worker_is_not_rescued(world):
    settings, pipeline, video, _ = world
    job, pid = transcoding(settings, video)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(4.0)  # the supervisor polls every 0.2 s: a dead child would have been rescued by now
        assert first(settings, job, "StallDetected") is None
        assert first(settings, job, "AttemptStarted", attempt=2) is None
    finally:
        os.kill(pid, signal.SIGCONT)
    completes_once(settings, job)


def test_a_worker_restarted_under_its_stable_name_rescues_its_earlier_incarnation(world):
    settings, pipeline, video, work = world
    job, pid = transcoding(settings, video)
    name = next(p.name.split(".")[-3] for p in (settings.home / "run" / "holdings").glob(f"{settings.app_name}.*.{pid}.json"))
    supervisor = pipeline.process.pid
    os.kill(supervisor, signal.SIGSTOP)  # it must not see the death: the restarted worker has to
    restarted = None
    try:
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not process_alive(pid), 10, "the worker to die")
        log = open(work / "restarted.log", "ab")
        restarted = subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--role", "transcode"],
                                     env={**settings_env(settings), "TAPELINE_WORKER_NAME": name}, stdout=log, stderr=log,
                                     start_new_session=True)
        stall = wait_for(lambda: first(settings, job, "StallDetected", kind="worker_exited"), 30,
                         "the restarted worker's StallDetected(worker_exited)", interval_s=0.1)
        assert "found by its restarted worker" in stall["payload"]["detail"]
        assert stall["recorded_by"].endswith(f":{restarted.pid}")
        wait_for(lambda: first(settings, job, "AttemptStarted", attempt=2), 30, "the next attempt")
    finally:
        os.kill(supervisor, signal.SIGCONT)
    try:
        completes_once(settings, job)
    finally:
        if restarted is not None:
            os.killpg(restarted.pid, signal.SIGTERM)
            restarted.wait(30)

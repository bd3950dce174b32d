"""Every child of `tapeline run --role all` serves health and metrics on its own port
(`TAPELINE_HEALTH_PORT_BASE` + the role's index), and they reflect a real job."""

from __future__ import annotations

import json
import random
import re
import socket
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest

from tapeline.samples import sample_video
from tapeline.settings import Settings
from cli.supervisor import ROLES
from tests.conftest import Pipeline, tapeline_cli, wait_for

pytestmark = pytest.mark.integration


def free_port_range(count: int) -> int:
    """A base port with `count` consecutive free ports after it."""
    for _ in range(50):
        base = random.randrange(20000, 40000)
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no free port range")


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""  # not listening yet


def deep(port: int) -> dict[str, Any]:
    code, body = get(port, "/health/deep")
    assert code == 200, body
    return json.loads(body)


@pytest.fixture(scope="module")
def served(isolated: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pipeline, dict[str, int]]]:
    base = free_port_range(len(ROLES))
    running = Pipeline(isolated, tmp_path_factory.mktemp("health") / "run.log",
                       extra_env={"TAPELINE_HEALTH_PORT_BASE": str(base)}).start()
    yield running, {role: base + i for i, role in enumerate(ROLES)}
    running.stop()
    print(running.log_text()[-4000:])


def test_every_child_is_ready_and_a_job_shows_in_deep_health_and_metrics(isolated, served):
    pipeline, ports = served
    wait_for(lambda: all(get(port, "/health/ready")[0] == 200 for port in ports.values()), 90,
             f"every child's /health/ready to answer 200 ({ports})")
    for role, port in ports.items():
        assert get(port, "/health/live") == (200, '{"status": "live"}')
        doc = deep(port)
        assert doc["role"] == role and doc["ready"] is True and doc["uptime_s"] > 0
    assert "lag_records_approx" in deep(ports["projector"])

    done = tapeline_cli(isolated, "submit", str(sample_video("carphone_pristine.mp4")), "--wait", "--json",
                        "--timeout", "180")
    job = json.loads(done.stdout)
    assert job["state"] == "completed", done.stderr

    transcode = deep(ports["transcode"])
    assert transcode["jobs_processed"] >= 1 and transcode["last_job_at"], transcode
    assert transcode["current"] is None  # the attempt ended
    assert transcode["ffmpeg_version"].startswith("ffmpeg version")
    assert transcode["last_progress"]["frames"] > 0
    code, metrics = get(ports["transcode"], "/metrics")
    assert code == 200
    # One job, one attempt: exact values (this module's pipeline runs no other job).
    assert 'tapeline_attempts_total{error_class="",outcome="succeeded",stage="transcode"} 1.0' in metrics, metrics
    assert 'tapeline_stage_duration_seconds_count{outcome="succeeded",stage="transcode"} 1.0' in metrics
    duration = re.search(r'^tapeline_stage_duration_seconds_sum\{outcome="succeeded",stage="transcode"\} (\S+)$',
                         metrics, flags=re.M)
    assert duration and 0 < float(duration.group(1)) < 180
    assert 'tapeline_events_produced_total{event_type="AttemptSucceeded"} 1.0' in metrics
    assert 'tapeline_events_produced_total{event_type="AttemptStarted"} 1.0' in metrics
    assert re.search(r'^tapeline_events_consumed_total\{event_type="WorkItem",topic="[^"]+\.work\.transcode\.[a-z]+"\} 1\.0$',
                     metrics, flags=re.M), metrics
    assert re.search(r'^tapeline_ffmpeg_speed_ratio [0-9.]+', metrics, flags=re.M)
    assert 'tapeline_jobs_processed_total{role="transcode"} 1.0' in metrics
    assert "tapeline_lease_age_seconds 0.0" in metrics  # idle again

    code, watchdog_metrics = get(ports["watchdog"], "/metrics")
    assert code == 200
    for kind in ("lease_expired", "no_progress", "handoff", "expected_work_missing"):  # a clean run stalls nowhere
        assert f'tapeline_stalls_detected_total{{kind="{kind}"}} 0.0' in watchdog_metrics, watchdog_metrics
    assert re.search(r'^tapeline_watchdog_ticks_total\{result="judged"\} [1-9]', watchdog_metrics, flags=re.M)
    assert re.search(r'^tapeline_events_produced_total\{event_type="WatchdogTick"\} [1-9]', watchdog_metrics,
                     flags=re.M)

    code, intake_metrics = get(ports["intake"], "/metrics")
    assert re.search(r'^tapeline_events_consumed_total\{event_type="UploadCompleted",topic="[^"]+\.uploads"\} 1\.0$',
                     intake_metrics, flags=re.M), intake_metrics
    assert deep(ports["publish"])["jobs_processed"] >= 1
    code, projector_metrics = get(ports["projector"], "/metrics")
    assert re.search(r'^tapeline_events_consumed_total\{event_type="AttemptSucceeded",topic="[^"]+\.jobs"\} [1-9]',
                     projector_metrics, flags=re.M)
    assert_job_lines_carry_its_context(pipeline, job["job_id"])


def assert_job_lines_carry_its_context(pipeline: Pipeline, job_id: str) -> None:
    """The JSON lines the workers wrote while handling the job carry its stage, attempt, claim token
    and the work item's Kafka position, including lines whose call gave only a message."""
    records = []
    for line in pipeline.log_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # the supervisor's own lines, broker noise
    job_lines = [r for r in records if isinstance(r, dict) and r.get("job_id") and r.get("claim_token")]
    assert job_lines, pipeline.log_text()[-4000:]
    transcoded = [r for r in job_lines if r["event"] == "transcoded"]  # logged by transcode.work, no context given
    assert len(transcoded) == 1, job_lines
    line = transcoded[0]
    assert line["job_id"] == job_id
    assert line["stage"] == "transcode" and line["attempt"] == 1 and line["claim_token"]
    assert ".work.transcode." in line["topic"] and line["partition"] >= 0 and line["offset"] >= 0
    for stage in ("transcode", "publish"):
        finished = [r for r in job_lines if r["event"] == "attempt finished" and r["stage"] == stage]
        assert len(finished) == 1 and finished[0]["job_id"] == line["job_id"], job_lines
        assert finished[0]["outcome"] == "succeeded"
        claimed = [r for r in job_lines if r["event"] == "attempt claimed" and r["stage"] == stage]
        assert claimed and claimed[0]["claim_token"] == finished[0]["claim_token"]
    intake = [r for r in records if isinstance(r, dict) and r.get("event") == "intake decided"]
    assert intake and intake[0]["job_id"] == line["job_id"] and intake[0]["stage"] == "intake"
    assert intake[0]["topic"].endswith(".uploads") and "offset" in intake[0]

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
from tapeline.supervisor import ROLES
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
    _, ports = served
    wait_for(lambda: all(get(port, "/health/ready")[0] == 200 for port in ports.values()), 90,
             f"every child's /health/ready to answer 200 ({ports})")
    for role, port in ports.items():
        assert get(port, "/health/live") == (200, '{"status": "live"}')
        doc = deep(port)
        assert doc["role"] == role and doc["ready"] is True and doc["uptime_s"] > 0
    assert "lag_records_approx" in deep(ports["projector"])

    done = tapeline_cli(isolated, "submit", str(sample_video("carphone_pristine.mp4")), "--wait", "--json",
                        "--timeout", "180")
    assert json.loads(done.stdout)["state"] == "completed", done.stderr

    transcode = deep(ports["transcode"])
    assert transcode["jobs_processed"] >= 1 and transcode["last_job_at"], transcode
    assert transcode["current"] is None  # the attempt ended
    assert transcode["ffmpeg_version"].startswith("ffmpeg version")
    assert transcode["last_progress"]["frames"] > 0
    code, metrics = get(ports["transcode"], "/metrics")
    assert code == 200
    succeeded = re.search(r'^tapeline_attempts_total\{[^}]*outcome="succeeded"[^}]*stage="transcode"[^}]*\} (\S+)$',
                          metrics, flags=re.M)
    assert succeeded and float(succeeded.group(1)) >= 1, metrics
    assert re.search(r'^tapeline_events_produced_total\{event_type="AttemptSucceeded"\} [1-9]', metrics, flags=re.M)
    assert re.search(r'^tapeline_ffmpeg_speed_ratio [0-9.]+', metrics, flags=re.M)
    assert 'tapeline_jobs_processed_total{role="transcode"}' in metrics

    code, intake_metrics = get(ports["intake"], "/metrics")
    assert re.search(r'^tapeline_events_consumed_total\{topic="[^"]+\.uploads"\} [1-9]', intake_metrics, flags=re.M)
    assert deep(ports["publish"])["jobs_processed"] >= 1
    code, projector_metrics = get(ports["projector"], "/metrics")
    assert re.search(r'^tapeline_events_consumed_total\{topic="[^"]+\.jobs"\} [1-9]', projector_metrics, flags=re.M)

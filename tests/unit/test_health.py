"""`tapeline.health`: the state object, and the real HTTP server on an ephemeral port."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest

from tapeline.health import HealthServer, HealthState, ffmpeg_version
from tapeline.clock import system_clock


def get(server: HealthServer, path: str) -> tuple[int, str, str]:
    """(status, content type, body) of GET path; a 4xx/5xx answer is returned, not raised."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def get_json(server: HealthServer, path: str) -> tuple[int, dict[str, Any]]:
    code, content_type, body = get(server, path)
    assert content_type == "application/json"
    return code, json.loads(body)


@pytest.fixture
def state() -> HealthState:
    return HealthState("transcode", "box-1")


@pytest.fixture
def server(state: HealthState) -> Iterator[HealthServer]:
    running = HealthServer(state, "127.0.0.1", 0).start()
    yield running
    running.stop()


def test_readiness_moves_from_warming_to_ready_to_draining(state):
    assert state.readiness() == (False, "warming up")
    state.mark_ready()
    assert state.readiness() == (True, None) and state.is_ready
    state.mark_fenced("fenced: a newer attempt owns job j1")
    assert state.readiness() == (False, "fenced: a newer attempt owns job j1")
    state.set_attempt("j2", "transcode", 1, "tok", 120.0)  # a new claim clears fenced
    assert state.is_ready
    state.mark_draining()
    assert state.readiness() == (False, "draining: stop requested")
    state.mark_ready()  # draining wins over ready
    assert not state.is_ready


def test_deep_reports_the_attempt_its_lease_progress_and_jobs(state):
    doc = state.deep()
    assert doc["role"] == "transcode" and doc["instance"] == "box-1"
    assert doc["current"] is None and doc["jobs_processed"] == 0 and doc["last_job_at"] is None
    assert "lag_records_approx" not in doc  # only the projector has a lag

    state.set_attempt("job-1", "transcode", 2, "claim-abc", lease_s=120.0)
    state.record_progress(frames=250, out_time_s=10.0, speed=3.5)
    time.sleep(0.2)
    doc = state.deep()
    current = doc["current"]
    assert (current["job_id"], current["stage"], current["attempt"], current["claim_token"]) == \
        ("job-1", "transcode", 2, "claim-abc")
    assert 118.0 < current["lease_left_s_approx"] < 120.0
    assert "approximate" in doc["lease_clock"]
    state.lease_renewed()
    assert state.deep()["current"]["lease_left_s_approx"] == pytest.approx(120.0, abs=0.15)
    assert doc["last_progress"]["frames"] == 250 and doc["last_progress"]["out_time_s"] == 10.0
    assert doc["last_progress"]["at"].endswith("+00:00")

    state.clear_attempt()
    state.job_done()
    doc = state.deep()
    assert doc["current"] is None and doc["jobs_processed"] == 1
    assert doc["last_job_at"].endswith("+00:00") and doc["uptime_s"] >= 0.2
    assert doc["ffmpeg_version"] == ffmpeg_version()
    assert doc["ffmpeg_version"] is None or doc["ffmpeg_version"].startswith("ffmpeg version")


def test_state_is_safe_to_update_from_many_threads(state):
    def work() -> None:
        for _ in range(500):
            state.job_done()
            state.produced("Heartbeat")
            state.record_progress(1, 0.1, 1.0)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert state.deep()["jobs_processed"] == 4000
    assert 'tapeline_events_produced_total{event_type="Heartbeat"} 4000.0' in state.metrics().decode()


def test_live_answers_while_ready_is_503_until_the_loop_starts(state, server):
    assert get_json(server, "/health/live") == (200, {"status": "live"})
    assert get_json(server, "/health/ready") == (503, {"status": "not_ready", "reason": "warming up"})
    state.mark_ready()
    assert get_json(server, "/health/ready") == (200, {"status": "ready"})
    state.mark_draining()
    assert get_json(server, "/health/ready") == (503, {"status": "not_ready", "reason": "draining: stop requested"})
    assert get_json(server, "/health/live") == (200, {"status": "live"})  # still alive while draining


def test_deep_over_http(state, server):
    state.set_attempt("job-9", "transcode", 1, "tok-9", 60.0)
    code, doc = get_json(server, "/health/deep")
    assert code == 200
    for key in ("role", "instance", "pid", "ready", "reason", "current", "last_progress", "jobs_processed",
                "last_job_at", "uptime_s", "ffmpeg_version"):
        assert key in doc, key
    assert doc["current"]["job_id"] == "job-9" and doc["current"]["claim_token"] == "tok-9"


def test_projector_deep_has_a_lag_field():
    doc = HealthState("projector", "p").deep()
    assert "lag_records_approx" in doc and doc["lag_records_approx"] is None  # not observed yet


def test_metrics_exposition_names_every_metric(state, server):
    from domain import events as ev
    from domain.codec import default_codec

    class Message:  # what the consumers hand over: a topic and a value
        def __init__(self, topic: str, value: bytes) -> None:
            self._topic, self._value = topic, value

        def topic(self) -> str:
            return self._topic

        def value(self) -> bytes:
            return self._value

    item = ev.StageQueued.new(system_clock.stamp(), job_id="j1", stage="transcode", attempt=1, recorded_by="t", correlation_id="u1",
                              tier="standard", work_topic="t.work.transcode.standard")
    state.produced("AttemptStarted")
    state.consumed_messages([Message("t.jobs", default_codec().encode(item.to_record())), Message("t.jobs", b"junk")])
    state.count_attempt("transcode", "succeeded", duration_s=12.5)
    state.count_attempt("transcode", "failed", "media_corrupt", duration_s=0.3)
    state.stall_detected("no_progress")
    state.record_progress(10, 1.0, speed=2.25)
    state.job_done()
    code, content_type, body = get(server, "/metrics")
    assert code == 200 and content_type.startswith("text/plain")
    assert 'tapeline_events_produced_total{event_type="AttemptStarted"} 1.0' in body
    assert 'tapeline_events_consumed_total{event_type="StageQueued",topic="t.jobs"} 1.0' in body
    assert 'tapeline_events_consumed_total{event_type="undecodable",topic="t.jobs"} 1.0' in body
    assert 'tapeline_attempts_total{error_class="",outcome="succeeded",stage="transcode"} 1.0' in body
    assert 'tapeline_attempts_total{error_class="media_corrupt",outcome="failed",stage="transcode"} 1.0' in body
    assert 'tapeline_stage_duration_seconds_count{outcome="succeeded",stage="transcode"} 1.0' in body
    assert 'tapeline_stage_duration_seconds_sum{outcome="succeeded",stage="transcode"} 12.5' in body
    assert 'tapeline_stage_duration_seconds_bucket{le="20.0",outcome="succeeded",stage="transcode"} 1.0' in body
    assert 'tapeline_stalls_detected_total{kind="no_progress"} 1.0' in body
    assert 'tapeline_stalls_detected_total{kind="lease_expired"} 0.0' in body  # every kind exported from the start
    assert "tapeline_ffmpeg_speed_ratio 2.25" in body
    assert 'tapeline_jobs_processed_total{role="transcode"} 1.0' in body
    assert "tapeline_uptime_seconds " in body
    assert "tapeline_lease_age_seconds 0.0" in body and "tapeline_lease_remaining_seconds 0.0" in body


def test_lease_age_and_remaining_follow_the_claim_and_heartbeats(state):
    def gauge(name: str) -> float:
        return state.registry.get_sample_value(name)

    state.set_attempt("job-1", "transcode", 1, "tok", lease_s=60.0)
    time.sleep(0.2)
    assert 0.2 <= gauge("tapeline_lease_age_seconds") < 1.0
    assert 59.0 < gauge("tapeline_lease_remaining_seconds") <= 59.8
    state.lease_renewed()
    assert gauge("tapeline_lease_age_seconds") < 0.1
    state.clear_attempt()
    assert gauge("tapeline_lease_age_seconds") == 0.0 and gauge("tapeline_lease_remaining_seconds") == 0.0


def test_each_state_has_its_own_registry():
    one, two = HealthState("intake"), HealthState("intake")
    one.job_done()
    assert 'tapeline_jobs_processed_total{role="intake"} 1.0' in one.metrics().decode()
    assert 'tapeline_jobs_processed_total{role="intake"} 0.0' in two.metrics().decode()


def test_unknown_path_is_404(server):
    code, doc = get_json(server, "/nope")
    assert code == 404 and "/health/live" in doc["error"]


def test_supervisor_gives_each_child_its_own_port(monkeypatch):
    from cli.supervisor import ROLES, child_env

    monkeypatch.setenv("TAPELINE_HEALTH_PORT", "9999")
    assert ROLES[:4] == ("projector", "intake", "transcode", "publish")
    assert [child_env(role, 18000)["TAPELINE_HEALTH_PORT"] for role in ROLES] == \
        [str(18000 + i) for i in range(len(ROLES))]
    assert "TAPELINE_HEALTH_PORT" not in child_env("intake", 0)  # one inherited port would collide


def test_settings_default_to_disabled():
    from tapeline.settings import Settings

    settings = Settings()
    assert settings.health_port == 0 and settings.health_port_base == 0 and settings.health_host == "127.0.0.1"

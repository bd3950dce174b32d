"""Fault-injection fixtures: a video long enough to be mid-transcode, short leases, real processes."""

from __future__ import annotations

from domain.pipeline import STAGE_NAMES

import subprocess
from pathlib import Path
from typing import Iterator

import psycopg
import pytest

from tapeline.samples import sample_video
from tapeline.settings import Settings
from tests.conftest import Pipeline

OTHER_STAGES = tuple(s for s in STAGE_NAMES if s != "transcode")
"""The registry's stages besides transcode (thumbnails, publish): what a test that runs its own
transcode workers starts beside them so its jobs complete."""
FAULT_TIMING = {"lease_s": 4.0, "heartbeat_interval_s": 0.5, "no_progress_timeout_s": 8.0, "handoff_timeout_s": 15.0,
                "intake_timeout_s": 60.0, "tick_interval_s": 0.5, "caught_up_timeout_s": 20.0,
                "x264_preset": "ultrafast", "transaction_timeout_ms": 3000, "kafka_session_timeout_ms": 3000,
                "webhook_timeout_s": 3.0}
"""Seconds, small so faults are detected quickly; the transaction and webhook timeouts stay below the
lease (Settings refuses them otherwise), and so does the consumer session timeout (a killed and
restarted processor rejoins its group after it)."""


@pytest.fixture(scope="session")
def long_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real bigbuckbunny sample looped six times (about 32 s of 1280x720 H.264/AAC)."""
    path = tmp_path_factory.mktemp("media") / "bigbuckbunny-x6.mp4"
    subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-stream_loop", "5", "-i", str(sample_video()),
                    "-c", "copy", "-y", str(path)], check=True, timeout=120)
    return path


@pytest.fixture()
def fault_settings(isolated: Settings) -> Settings:
    """The module's isolated services with fault timings and a fresh app name per test."""
    import uuid

    return isolated.model_copy(update={**FAULT_TIMING, "app_name": f"{isolated.app_name}-{uuid.uuid4().hex[:6]}"})


@pytest.fixture()
def fault_pipeline(fault_settings: Settings, tmp_path: Path) -> Iterator[Pipeline]:
    running = Pipeline(fault_settings, tmp_path / "run.log").start()
    yield running
    running.stop()
    print(running.log_text()[-6000:])


def job_row(settings: Settings, job_id: str) -> dict | None:
    with psycopg.connect(settings.database_url, row_factory=psycopg.rows.dict_row) as conn:
        return conn.execute("SELECT * FROM job_state WHERE job_id = %s", (job_id,)).fetchone()


class Roles:
    """Processor roles as separate real processes (`tapeline run --role X`), started and stopped one by one."""

    def __init__(self, settings: Settings, log_dir: Path) -> None:
        self.settings, self.log_dir = settings, log_dir
        self.processes: list[tuple[str, "subprocess.Popen", object]] = []

    def start(self, role: str, wrapper: list[str] | None = None, env: dict[str, str] | None = None) -> "subprocess.Popen":
        import sys

        from tests.conftest import settings_env

        log = open(self.log_dir / f"{role}-{len(self.processes)}.log", "ab")
        process = subprocess.Popen([*(wrapper or []), sys.executable, "-m", "cli.main", "run", "--role", role],
                                   env={**settings_env(self.settings), **(env or {})}, stdout=log, stderr=log,
                                   start_new_session=True)
        self.processes.append((role, process, log))
        return process

    def stop_all(self) -> None:
        import os
        import signal

        for _, process, log in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGCONT)
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
            log.close()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.log_dir.glob("*.log")))


@pytest.fixture()
def roles(fault_settings: Settings, tmp_path: Path) -> Iterator[Roles]:
    running = Roles(fault_settings, tmp_path)
    yield running
    running.stop_all()
    print(running.logs())

"""Helpers for the tier, reuse and degradation tests (issue 9): tiny distinct clips, and processor
roles started one by one (so work can pile up before a worker exists)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psycopg

from producers.submit import publish, upload
from tapeline.samples import sample_video
from tapeline.settings import Settings
from tests.conftest import settings_env


def tiny_clips(directory: Path, count: int, seconds: float = 1.0, size: str = "160x90") -> list[Path]:
    """`count` distinct clips (different sha256: a `comment` tag each) of `seconds` of the real
    bigbuckbunny sample scaled to `size`, H.264 + AAC."""
    base = directory / "base.mp4"
    width, height = size.split("x")
    subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-t", f"{seconds:g}", "-i", str(sample_video()),
                    "-vf", f"scale={width}:{height}", "-c:v", "libx264", "-preset", "ultrafast", "-c:a", "aac",
                    "-y", str(base)], check=True, timeout=60)
    clips = []
    for n in range(count):
        path = directory / f"clip-{n}.mp4"
        subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-i", str(base), "-c", "copy", "-metadata",
                        f"comment=clip {n}", "-y", str(path)], check=True, timeout=60)
        clips.append(path)
    return clips


def submit_upload(settings: Settings, path: Path, priority: str = "standard", profile: str = "default") -> str:
    """Upload `path` and publish its `UploadCompleted`; returns the job id."""
    submission = upload(settings, path, priority=priority, profile=profile)
    publish(settings, submission.event)
    return submission.job_id


class Roles:
    """Processor roles as separate real processes (`tapeline run --role R`), started one at a time."""

    def __init__(self, settings: Settings, log_dir: Path, extra_env: dict[str, str] | None = None) -> None:
        self.settings, self.log_dir, self.extra_env = settings, log_dir, extra_env or {}
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, *roles: str) -> "Roles":
        for role in roles:
            log = open(self.log_dir / f"{role}.log", "ab")
            self.processes[role] = subprocess.Popen(
                [sys.executable, "-m", "cli.main", "run", "--role", role],
                env={**settings_env(self.settings), **self.extra_env}, stdout=log, stderr=log,
                start_new_session=True)
            log.close()
        return self

    def stop(self, *roles: str, timeout_s: float = 30.0) -> None:
        """SIGTERM every named role (default: all) at once, then wait for each (SIGKILL after `timeout_s`)."""
        stopping = [self.processes.pop(role) for role in roles or tuple(self.processes) if role in self.processes]
        for process in stopping:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in stopping:
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def log_text(self, role: str) -> str:
        path = self.log_dir / f"{role}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def rows(settings: Settings, sql: str, *params) -> list[dict]:
    with psycopg.connect(settings.database_url, row_factory=psycopg.rows.dict_row) as conn:
        return conn.execute(sql, params).fetchall()


def states(settings: Settings, job_ids: list[str]) -> dict[str, str]:
    return {r["job_id"]: r["state"] for r in rows(settings, "SELECT job_id, state FROM job_state WHERE job_id = ANY(%s)",
                                                  job_ids)}


def all_in_state(settings: Settings, job_ids: list[str], wanted: set[str]) -> bool:
    found = states(settings, job_ids)
    return len(found) == len(job_ids) and set(found.values()) <= wanted

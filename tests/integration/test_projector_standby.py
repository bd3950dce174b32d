"""Two projector processes on one projection (a rolling deploy's overlap, or `run --role all` next
to a foreground `run --role projector`): one applies, the other stands by, and takes over when the
first is killed with SIGKILL. Before the projector lock, both applied the same records (upload copies
counted twice, deadlocks on the evidence key, skipped dedup keys)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import psycopg
import pytest

from processors.runtime import transact
from cli.wiring import build_runtime
from tapeline.postgres import migrate
from tests.conftest import settings_env, wait_for
from tests.integration.test_projector import lifecycle

pytestmark = pytest.mark.integration


def start_projector(settings, log_path):
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "cli.main", "run", "--role", "projector"],
                                env=settings_env(settings), stdout=log, stderr=log, start_new_session=True)


def write_jobs(settings, count: int) -> list[str]:
    """`count` lifecycles (6 events each: 5 applied, one zombie's superseded), one transaction each."""
    runtime = build_runtime(settings, "test")
    producer = runtime.events.transactional_producer(f"{settings.app_name}.standby-writer-{uuid.uuid4().hex[:6]}")
    jobs = []
    for _ in range(count):
        events = lifecycle(f"u-{uuid.uuid4()}")
        transact(producer, lambda events=events: runtime.produce(producer, [(settings.jobs_topic, e) for e in events]))
        jobs.append(events[0].job_id)
    runtime.close()
    return jobs


def rows(settings, sql, params=()):
    with psycopg.connect(settings.database_url) as conn:
        return conn.execute(sql, params).fetchall()


def test_a_second_projector_stands_by_and_takes_over_after_a_kill_9(isolated, tmp_path):
    migrate(isolated.database_url)
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = start_projector(isolated, first_log)
    second = None
    try:
        wait_for(lambda: "projector assigned" in first_log.read_text(), 60, "the first projector to start")
        second = start_projector(isolated, second_log)
        wait_for(lambda: "standing by" in second_log.read_text(), 60, "the second projector to stand by")
        before = write_jobs(isolated, 20)
        wait_for(lambda: rows(isolated, "SELECT count(*) FROM job_state WHERE state = 'failed'")[0][0] == 20, 60,
                 "the first projector to apply 20 jobs")
        assert "projector assigned" not in second_log.read_text()  # it never applied anything
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        after = write_jobs(isolated, 20)
        wait_for(lambda: "took over" in second_log.read_text(), 60, "the second projector to take over")
        wait_for(lambda: rows(isolated, "SELECT count(*) FROM job_state WHERE state = 'failed'")[0][0] == 40, 60,
                 "the second projector to apply the next 20 jobs")
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
    # Every record once: 6 evidence rows a job, 5 applied, none a duplicate; each job folded once.
    assert rows(isolated, "SELECT count(*), sum(applied::int), sum(duplicate::int), sum(superseded::int) "
                          "FROM lifecycle_evidence") == [(240, 200, 0, 40)]
    assert rows(isolated, "SELECT DISTINCT events, state FROM job_state WHERE job_id = ANY(%s)",
                (before + after,)) == [(5, "failed")]
    assert rows(isolated, "SELECT count(*) FROM applied_dedup_keys")[0][0] == 200

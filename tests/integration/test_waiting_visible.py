"""A retry stays visible until a worker claims it (issue 26 item 4), against real Kafka and PostgreSQL.

Hand-made lifecycles (real event models) are committed to the module's lifecycle topic and projected
by the real projector (`tapeline run --role projector`):

- BACKOFF: transcode 1 stalled (no_progress) and its retry is scheduled an hour out;
- QUEUED: the same, and the retry's attempt 2 already queued (the backoff ended, no worker is free);
- CLAIMED: the same, and attempt 2 claimed by a worker.

Before the change `tapeline stalled` listed none of them: once the watchdog had written its
`StallDetected` + `RetryScheduled`, the stall vanished although the job had not moved again.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from domain import events as ev
from processors.runtime import transact
from cli.wiring import build_runtime
from projections import read_model as read
from tests.conftest import tapeline_cli, wait_for
from tests.integration.test_read_api import Job, job_row, projected_lifecycles

pytestmark = pytest.mark.integration


def stalled_then_retried(job: Job, due: datetime) -> list[ev.Event]:
    """Attempt 1 of `job` claimed, stalled with frozen progress, and its retry (attempt 2) scheduled for `due`."""
    return [
        job.accepted(), job.queued("transcode", 1), job.started("transcode", 1, "a1"),
        job.event(ev.StallDetected, "transcode", 1, "a1", kind="no_progress", stalled_attempt=1, since_s=121.0,
                  detail="frames stuck at 40"),
        job.event(ev.RetryScheduled, "transcode", 1, "a1", next_attempt=2, not_before=due, error_class="worker_lost"),
    ]


@pytest.fixture(scope="module")
def world(isolated, tmp_path_factory):
    """The read-API module's four jobs and this module's three, projected; yields (settings, jobs)."""
    settings = isolated
    with projected_lifecycles(settings, tmp_path_factory.mktemp("waiting")):
        backoff, queued, claimed = Job("standard"), Job("standard"), Job("standard")
        hour = datetime.now(timezone.utc) + timedelta(hours=1)
        events = stalled_then_retried(backoff, hour) + stalled_then_retried(queued, hour) + \
            [queued.queued("transcode", 2)] + stalled_then_retried(claimed, hour) + \
            [claimed.queued("transcode", 2), claimed.started("transcode", 2, "a2")]
        runtime = build_runtime(settings, "test")
        producer = runtime.events.transactional_producer(f"{settings.app_name}.test-waiting")
        transact(producer, lambda: runtime.produce(producer, [(settings.jobs_topic, e) for e in events]))
        runtime.close()
        wait_for(lambda: (job_row(settings, claimed.job_id) or {}).get("state") == "running"
                 and (job_row(settings, queued.job_id) or {}).get("attempt") == 2, 60, "the three jobs projected")
        yield settings, {"backoff": backoff, "queued": queued, "claimed": claimed}


def test_a_retry_stays_listed_as_waiting_until_a_worker_claims_it(world):
    settings, jobs = world
    listed = json.loads(tapeline_cli(settings, "stalled", "--json").stdout)
    waiting = {s["job_id"]: s for s in listed if s["kind"] == "waiting"}
    assert set(waiting) == {jobs["backoff"].job_id, jobs["queued"].job_id}, listed
    assert not any(s["job_id"] == jobs["claimed"].job_id for s in listed if s["kind"] != "recent_stall"), \
        "a claimed retry is no longer waiting"
    # Each stall stays listed after its verdict with what was done (issue 45, TAPELINE_RECENT_STALLS_S).
    recent = {s["job_id"]: s for s in listed if s["kind"] == "recent_stall"}
    assert set(recent) >= {job.job_id for job in jobs.values()}
    assert recent[jobs["claimed"].job_id]["outcome"] == "retried as attempt 2"
    assert recent[jobs["claimed"].job_id]["stall_kind"] == "no_progress"

    backoff = waiting[jobs["backoff"].job_id]
    assert (backoff["stage"], backoff["attempt"]) == ("transcode", 2)
    assert backoff["reason"] == ("retry (attempt 2) waits for its backoff; "
                                 "before: stalled (no_progress) for 121.0 s: frames stuck at 40")
    due = datetime.fromisoformat(backoff["due_at"])
    assert timedelta(minutes=59) < due - datetime.fromisoformat(backoff["last_progress_at"]) <= timedelta(hours=1)
    assert 0.0 <= backoff["since_s"] < 120.0

    queued = waiting[jobs["queued"].job_id]
    assert (queued["stage"], queued["attempt"], queued["due_at"]) == ("transcode", 2, None)
    assert queued["reason"].startswith("attempt 2 waits for a free worker; before: stalled (no_progress)")

    # The table an operator reads says the same, and the handoff list does not count them twice.
    text = tapeline_cli(settings, "stalled").stdout
    assert text.count("│ waiting ") == 2, text  # rows of kind waiting (rich wraps the long ids)
    with read.open_reader(settings) as conn:
        kinds = [(s["kind"], s["job_id"]) for s in read.stalls(conn)]
    assert kinds.count(("waiting", jobs["queued"].job_id)) == 1
    assert ("handoff", jobs["queued"].job_id) not in kinds

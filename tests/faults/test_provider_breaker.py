"""A publish provider's circuit breaker (issue 9, items 4 and 7) against the real local provider
server, which records every request (refused ones too) with the moment it arrived: a 429 opens the
breaker for exactly its Retry-After and the attempt is retried then (not the 1-minute policy); 5xx
answers open it, a half-open probe that fails reopens it for longer, and while it is open no
request reaches the provider (another job is deferred without using an attempt)."""

from __future__ import annotations

import json
from typing import Iterator

import psycopg
import pytest

from devstack.chaos import ProviderProcess
from tapeline.samples import sample_video
from tapeline.settings import Settings
from tests.conftest import Pipeline, tapeline_cli, wait_for
from tests.faults.conftest import FAULT_TIMING, job_row
from tests.faults.test_worker_faults import submit, wait_state
from tests.integration.helpers import committed_events, of_job

pytestmark = pytest.mark.integration

CLIP = "carphone_pristine.mp4"


@pytest.fixture(scope="module")
def running(isolated, tmp_path_factory) -> Iterator[tuple[Settings, ProviderProcess]]:
    """One provider server and one pipeline for the module (starting a pipeline costs seconds).

    The provider dedupes by idempotency key: a 5xx may have been processed, so the publish protocol
    lets a successor post again only at such a provider (otherwise needs_review, tested in
    test_publish_crashes)."""
    directory = tmp_path_factory.mktemp("breaker")
    provider = ProviderProcess(directory, mode="dedupe")
    settings = isolated.model_copy(update={
        **FAULT_TIMING, "webhook_url": provider.url, "webhook_dedupes": True, "webhook_cooldown_s": 5.0,
        "webhook_probe_timeout_s": 2.0})
    pipeline = Pipeline(settings, directory / "run.log").start()
    yield settings, provider
    pipeline.stop()
    provider.stop()
    print(pipeline.log_text()[-6000:])


def breaker_row(settings) -> dict | None:
    with psycopg.connect(settings.database_url, row_factory=psycopg.rows.dict_row) as conn:
        return conn.execute("SELECT * FROM provider_state WHERE provider = 'webhook'").fetchone()


def breaker_changes(events) -> list:
    """The webhook breaker's changes in version order (they are keyed by different jobs)."""
    return sorted((e for e in events if e.event_type == "ProviderBreakerChanged"), key=lambda e: e.version)


def test_a_429_opens_the_breaker_for_its_retry_after_and_the_retry_posts_once(running):
    settings, provider = running
    provider.control(fail_next=1, status=429, retry_after_s=2)
    before = (breaker_row(settings) or {}).get("version", 0)
    seen = len(provider.requests())
    job_id = submit(settings, sample_video(CLIP))
    row = wait_state(settings, job_id, timeout_s=120)
    status = tapeline_cli(settings, "status", "--json")
    text = tapeline_cli(settings, "status")
    timeline = tapeline_cli(settings, "timeline", job_id, "--json")
    events = of_job(committed_events(settings), job_id)
    opened, probing, closed = breaker_changes(events)
    assert [(c.from_state, c.to_state, c.version - before) for c in (opened, probing, closed)] == \
        [("closed", "open", 1), ("open", "half_open", 2), ("half_open", "closed", 3)]
    assert (opened.http_status, opened.failures, opened.attempt) == (429, 1, 1)
    assert 1.9 <= (opened.until - opened.occurred_at).total_seconds() <= 2.1  # Retry-After 2, on the db clock
    assert (probing.attempt, closed.attempt, closed.failures, closed.until) == (2, 2, 0, None)
    [failed] = of_job(events, job_id, "AttemptFailed")
    assert (failed.attempt, failed.error_class, failed.retryable) == (1, "provider_throttled", True)
    [retry] = of_job(events, job_id, "RetryScheduled")
    assert retry.next_attempt == 2 and 1.8 <= (retry.not_before - retry.occurred_at).total_seconds() <= 2.1
    refused, posted = provider.requests()[seen:]
    assert (refused["status"], posted["status"]) == (429, 201)
    assert posted["received_at"] - refused["received_at"] >= 2.0  # nothing was tried during the cooldown
    assert [p["idempotency_key"] for p in provider.posts(job_id)] == [f"{job_id}:publish:0:Published:webhook"]
    assert row["attempt"] == 2
    state = breaker_row(settings)
    assert (state["state"], state["failures"], state["version"], state["event_id"]) == \
        ("closed", 0, closed.version, closed.event_id)
    [webhook] = [p for p in json.loads(status.stdout)["providers"] if p["provider"] == "webhook"]
    assert (webhook["state"], webhook["posts_minute"], webhook["quota_minute"]) == ("closed", 1, None)
    assert "provider webhook: closed; posts 1/- per 60 s, 1/- per 86400 s" in text.stdout
    details = [r["detail"] for r in json.loads(timeline.stdout) if r["event_type"] == "ProviderBreakerChanged"]
    assert details[0].startswith("webhook closed->open until=") and "http=429 failures=1" in details[0]
    assert details[2] == "webhook half_open->closed until=- http=- failures=0 reason=probe succeeded"


def test_5xx_opens_a_failed_probe_reopens_longer_and_open_means_no_request(running):
    settings, provider = running
    provider.control(fail_next=2, status=503, retry_after_s=None)
    before = (breaker_row(settings) or {}).get("version", 0)
    seen = len(provider.requests())
    first = submit(settings, sample_video(CLIP))
    wait_for(lambda: (breaker_row(settings) or {}).get("state") == "open", 120, "the breaker to open")
    second = submit(settings, sample_video("carphone_distorted.mp4"))  # 7 kB: at publish while it is open
    rows = [wait_state(settings, job_id, timeout_s=120) for job_id in (first, second)]
    requests = provider.requests()[seen:]
    posts = provider.posts(first) + provider.posts(second)
    events = committed_events(settings)
    changes = [c for c in breaker_changes(events) if c.version > before]
    takeovers = [c for c in changes if (c.from_state, c.to_state) == ("half_open", "half_open")]
    assert all("lapsed" in c.reason for c in takeovers)  # a probe slower than its 2 s deadline (a loaded machine)
    changes = [c for c in changes if c not in takeovers]
    assert [(c.from_state, c.to_state, c.http_status, c.failures) for c in changes] == [
        ("closed", "open", 503, 1), ("open", "half_open", None, 1), ("half_open", "open", 503, 2),
        ("open", "half_open", None, 2), ("half_open", "closed", None, 0)]
    first_open, _, reopened, _, _ = changes
    assert 4.9 <= (first_open.until - first_open.occurred_at).total_seconds() <= 5.1  # the configured cooldown
    assert 9.9 <= (reopened.until - reopened.occurred_at).total_seconds() <= 10.1  # doubled after the failed probe
    assert reopened.reason.startswith("probe failed")
    assert [r["status"] for r in requests] == [503, 503, 201, 201]
    # Nothing reached the provider while the breaker was open.
    assert requests[1]["received_at"] >= first_open.until.timestamp()
    assert requests[2]["received_at"] >= reopened.until.timestamp()
    assert sorted(p["payload"]["job_id"] for p in posts) == sorted([first, second])
    deferred = [d for job_id in (first, second) for d in of_job(events, job_id, "PublishDeferred")]
    assert {d.wait for d in deferred} <= {"cooldown", "probe"}
    assert [d for d in deferred if d.wait == "cooldown"]  # the job that met the open breaker waited
    for d in deferred:  # each deferral failed its attempt as provider_throttled and was retried at `until`
        assert d.until in {c.until for c in changes + takeovers}  # the end of a cooldown, or a probe's deadline
        [failed] = [f for f in of_job(events, d.job_id, "AttemptFailed") if f.attempt == d.attempt]
        [retry] = [r for r in of_job(events, d.job_id, "RetryScheduled") if r.attempt == d.attempt]
        assert (failed.error_class, failed.retryable, retry.next_attempt) == ("provider_throttled", True, d.attempt + 1)
        assert abs((retry.not_before - retry.occurred_at).total_seconds()
                   - (d.until - d.occurred_at).total_seconds()) < 0.5
    assert {r["state"] for r in rows} == {"completed"}
    for job_id in (first, second):  # deferrals do not use up attempts: counted as yields, never dead-lettered
        assert job_row(settings, job_id)["yields"] == len(of_job(events, job_id, "PublishDeferred"))
        assert of_job(events, job_id, "JobDeadLettered") == [] and of_job(events, job_id, "NeedsReview") == []
    assert breaker_row(settings)["state"] == "closed"


def test_provider_state_is_rebuilt_from_the_log_by_a_replay(running):
    settings, _ = running
    done = tapeline_cli(settings, "replay", "--into", "rebuilt_providers", "--json")
    assert done.returncode == 0, done.stderr
    with psycopg.connect(settings.database_url, row_factory=psycopg.rows.dict_row) as conn:
        live = conn.execute("SELECT * FROM public.provider_state ORDER BY provider").fetchall()
        rebuilt = conn.execute("SELECT * FROM rebuilt_providers.provider_state ORDER BY provider").fetchall()
        waits = conn.execute("SELECT * FROM public.provider_waits").fetchall()
        rebuilt_waits = conn.execute("SELECT * FROM rebuilt_providers.provider_waits").fetchall()
    assert live and live == rebuilt  # the live row (written by the workers and the projector) is the log's
    assert waits and waits == rebuilt_waits


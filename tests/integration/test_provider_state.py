"""`provider_state` (migration 014) keeps the breaker change with the highest (version, event_id),
whatever order changes arrive in, and the projector's evidence trigger applies each one once."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import psycopg
import pytest

from processors.provider_guard import breaker_change_params
from tapeline.postgres import q
from projections.writes import PAYLOAD_OMITS
from domain import events as ev
from tapeline.clock import system_clock

pytestmark = pytest.mark.integration

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)


def change(version: int, to_state: str, job: str = "upload-a", provider: str = "webhook-x") -> ev.ProviderBreakerChanged:
    return ev.ProviderBreakerChanged.new(system_clock.stamp(), 
        job_id=ev.job_id_for(job), stage="publish", attempt=version, recorded_by="test", correlation_id=job,
        claim_token="tok", sequence=f"{provider}.{version}", occurred_at=T0 + timedelta(seconds=version),
        provider=provider, from_state="closed", to_state=to_state,
        until=None if to_state == "closed" else T0 + timedelta(seconds=10 * version), reason=f"change {version}",
        http_status=503 if to_state == "open" else None, failures=version, version=version)


def evidence_row(event: ev.Event, offset: int, duplicate: bool = False) -> dict:
    return {"topic": "jobs", "partition": 0, "offset": offset, "broker_ts": T0, "event_id": event.event_id,
            "event_type": event.event_type, "job_id": event.job_id, "stage": event.stage, "attempt": event.attempt,
            "claim_token": event.claim_token, "dedup_key": event.dedup_key, "occurred_at": event.occurred_at,
            "recorded_by": event.recorded_by, "causation_id": None, "applied": True, "superseded": False,
            "duplicate": duplicate, "payload": event.model_dump_json(exclude=PAYLOAD_OMITS)}


INSERT_EVIDENCE = """INSERT INTO lifecycle_evidence (topic, partition, "offset", broker_ts, event_id, event_type, job_id,
    stage, attempt, claim_token, dedup_key, occurred_at, recorded_by, causation_id, applied, superseded, duplicate,
    payload) VALUES (%(topic)s, %(partition)s, %(offset)s, %(broker_ts)s, %(event_id)s, %(event_type)s, %(job_id)s,
    %(stage)s, %(attempt)s, %(claim_token)s, %(dedup_key)s, %(occurred_at)s, %(recorded_by)s, %(causation_id)s,
    %(applied)s, %(superseded)s, %(duplicate)s, %(payload)s::jsonb)"""


def test_the_highest_version_wins_in_any_order_and_the_trigger_applies_evidence(isolated):
    with psycopg.connect(isolated.database_url, autocommit=True, row_factory=psycopg.rows.dict_row) as conn:
        conn.execute("DELETE FROM provider_state WHERE provider LIKE 'webhook-%'")
        opened, probing, closed = change(1, "open"), change(2, "half_open", job="upload-b"), change(3, "closed")
        for event in (closed, opened, probing, closed):  # out of order and repeated (a replay, a worker + projector)
            conn.execute(q("apply_provider_breaker_changed"), breaker_change_params(event))
        row = conn.execute(q("provider_breaker"), {"provider": "webhook-x"}).fetchone()
        assert (row["state"], row["version"], row["event_id"], row["until"], row["probe_job"], row["failures"]) == \
            ("closed", 3, closed.event_id, None, None, 3)
        # Through the projector's evidence rows: a duplicate copy never applies, a new change does.
        late = change(1, "open", provider="webhook-y")
        conn.execute(INSERT_EVIDENCE, evidence_row(change(2, "half_open", provider="webhook-y"), 900, duplicate=True))
        assert conn.execute(q("provider_breaker"), {"provider": "webhook-y"}).fetchone() is None
        conn.execute(INSERT_EVIDENCE, evidence_row(late, 901))
        row = conn.execute(q("provider_breaker"), {"provider": "webhook-y"}).fetchone()
        assert (row["state"], row["version"], row["until"], row["http_status"], row["job_id"], row["changed_at"]) == \
            ("open", 1, T0 + timedelta(seconds=10), 503, late.job_id, late.occurred_at)
        half = change(2, "half_open", job="upload-c", provider="webhook-y")
        conn.execute(INSERT_EVIDENCE, evidence_row(half, 902))
        row = conn.execute(q("provider_breaker"), {"provider": "webhook-y"}).fetchone()
        assert (row["state"], row["probe_job"], row["version"]) == ("half_open", half.job_id, 2)


def test_the_read_api_shows_each_providers_breaker_and_quota_use(isolated):
    from fastapi.testclient import TestClient

    from cli.wiring import build_app as create_app

    settings = isolated.model_copy(update={"webhook_quota": 30, "webhook_daily_quota": 5000})
    with psycopg.connect(isolated.database_url, autocommit=True, row_factory=psycopg.rows.dict_row) as conn:
        opened = change(7, "open", provider="webhook")
        conn.execute(q("apply_provider_breaker_changed"), breaker_change_params(opened))
        now = conn.execute("SELECT clock_timestamp() AS now").fetchone()["now"]
        for n in range(3):  # three calls: one ended 2 s ago, one in flight, one ended two minutes ago
            call = conn.execute(q("reserve_provider_call"), {"provider": "webhook", "job_id": f"job-{n}", "attempt": 1,
                                                             "claim_token": None, "now": now}).fetchone()["id"]
            if n != 1:
                conn.execute("UPDATE provider_calls SET done_at = %s WHERE id = %s",
                             (now - timedelta(seconds=2 if n == 0 else 120), call))
    with TestClient(create_app(settings), base_url="http://localhost") as client:  # a loopback Host (projections/edge.py)
        providers = client.get("/api/providers").json()
    [webhook] = [p for p in providers if p["provider"] == "webhook"]
    assert (webhook["state"], webhook["failures"], webhook["http_status"], webhook["version"]) == ("open", 7, 503, 7)
    assert webhook["until"] == (T0 + timedelta(seconds=70)).isoformat()
    assert (webhook["posts_minute"], webhook["quota_minute"], webhook["posts_day"], webhook["quota_day"]) == (2, 30, 3, 5000)


def test_a_busy_admission_lock_defers_the_attempt_at_the_clock_it_was_given(isolated, monkeypatch):
    """The lock timeout comes back through the `JobStore` port as `LockTimeout` (not a psycopg
    error) and becomes a one-second `in_flight` deferral stamped by the guard's clock."""
    from domain.errors import ProviderDeferred
    from processors import provider_guard
    from tapeline.postgres import PostgresJobStore
    from tests.fakeclock import FixedClock

    monkeypatch.setattr(provider_guard, "ADMIT_LOCK_TIMEOUT_S", 0.2)
    holder, waiter = PostgresJobStore(isolated), PostgresJobStore(isolated)
    clock = FixedClock(at=T0)
    guard = provider_guard.ProviderGuard(waiter, "webhook-busy", isolated, ev.job_id_for("upload-busy"),
                                         record=lambda events: None, make_event=lambda cls, **f: None, clock=clock)
    try:
        with holder.transaction():
            holder.one("provider_gate_lock", {"lock_class": provider_guard.PROVIDER_GATE_LOCK, "lock_id": guard.lock_id})
            with pytest.raises(ProviderDeferred, match="admission lock busy") as deferred:
                guard.admit(1, "tok")
        assert (deferred.value.wait, deferred.value.until) == ("in_flight", T0 + timedelta(seconds=1))
        assert waiter.all("provider_call_ends", {"provider": "webhook-busy", "now": T0, "stale_s": 60.0,
                                                 "since": T0 - timedelta(days=1)}) == []  # nothing reserved
        assert guard.admit(1, "tok").probe is False  # the lock is free again: admitted
    finally:
        holder.close()
        waiter.close()

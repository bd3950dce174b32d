"""`projections.api.ApiMetrics`: the API's scrape-time gauges, projection lag included, with fakes of
the pool, the projection reads and the lag cache."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from prometheus_client import generate_latest

from projections import api
from domain.errors import ServiceUnavailable


class FakePool:
    @contextmanager
    def connection(self, timeout: float = 5.0):
        yield object()


class FakeLag:
    def __init__(self, doc=None) -> None:
        self.doc = doc

    def get(self, conn):
        if self.doc is None:
            raise ServiceUnavailable("Kafka at nowhere:9092 did not answer")
        return self.doc


@pytest.fixture(autouse=True)
def projection_reads(monkeypatch):
    monkeypatch.setattr(api.read, "jobs_by_state_and_stage", lambda conn: [{"state": "running", "stage": "transcode",
                                                                            "n": 2}])
    monkeypatch.setattr(api.read, "stalls", lambda conn: [{"kind": "no_progress"}])
    monkeypatch.setattr(api.read, "suspect_attempts", lambda conn: [{"kind": "suspect", "suspect_of": "no_progress"}])
    monkeypatch.setattr(api.read, "dead_letter_counts", lambda conn: {"pending": 1})


def test_the_scrape_reports_the_projection_lag():
    metrics = api.ApiMetrics(lambda: FakePool(), FakeLag({"events": 7, "seconds": 1.5}))
    text = generate_latest(metrics.registry).decode()
    assert "tapeline_api_projection_lag_events 7.0" in text
    assert "tapeline_api_projection_lag_seconds 1.5" in text
    assert 'tapeline_jobs{stage="transcode",state="running"} 2.0' in text
    assert 'tapeline_stalls{kind="no_progress"} 1.0' in text and "tapeline_dead_letters_pending 1.0" in text
    assert 'tapeline_attempts_suspect{suspect_of="no_progress"} 1.0' in text  # issue 45: before the verdict
    assert 'tapeline_attempts_suspect{suspect_of="lease"} 0.0' in text


def test_without_kafka_the_other_gauges_still_answer():
    text = generate_latest(api.ApiMetrics(lambda: FakePool(), FakeLag(None)).registry).decode()
    assert "tapeline_api_projection_lag" not in text
    assert 'tapeline_jobs{stage="transcode",state="running"} 2.0' in text


def test_an_open_or_half_open_provider_breaker_is_1_and_a_closed_one_0():
    providers = [{"provider": "webhook", "state": "open"}, {"provider": "nodedupe", "state": "half_open"},
                 {"provider": "dedupe", "state": "closed"}]
    text = generate_latest(api.ApiMetrics(lambda: FakePool(), FakeLag(None), providers=lambda conn: providers)
                           .registry).decode()
    assert 'tapeline_provider_breaker_open{provider="webhook",state="open"} 1.0' in text
    assert 'tapeline_provider_breaker_open{provider="nodedupe",state="half_open"} 1.0' in text
    assert 'tapeline_provider_breaker_open{provider="dedupe",state="closed"} 0.0' in text
    assert 'tapeline_stalls{kind="waiting"} 0.0' in text  # every kind is exported, waiting included

"""Issue 44 item 6: a URL an event carries (a master playlist's, a rendition's) reaches a page, the
JSON API, the CLI or a customer's webhook only when it is http(s) (`domain/links.py` `web_url`): a
forged `JobCompleted` with a `javascript:` master URL was rendered as a link (only the CSP stopped
it) and would have gone to customers."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from domain.lifecycle import JOB_STATE_COLUMNS
from domain.links import web_url
from processors.notify import webhook_body
from projections.presenter import job_summary

GOOD = "https://cdn.example/published/j/master.m3u8"
BAD = ["javascript:alert(1)", "JavaScript:alert(document.domain)//http://x", " javascript:alert(1)",
       "data:text/html,<script>alert(1)</script>", "vbscript:x", "file:///etc/passwd", "//evil.example/x",
       "/published/j/master.m3u8", "http://", "http:///x", "https://ok.example/\nx", "ftp://x/y", "", "\x00"]


@pytest.mark.parametrize("url", [GOOD, "http://127.0.0.1:19000/tapeline-media/published/j/master.m3u8",
                                 "HTTPS://CDN.EXAMPLE/a.m3u8"])
def test_an_http_url_is_kept(url):
    assert web_url(url) == url


@pytest.mark.parametrize("url", BAD + [None])
def test_anything_else_is_none(url):
    assert web_url(url) is None


def row(master_url):
    return {**dict.fromkeys(JOB_STATE_COLUMNS), "updated_at": datetime(2026, 12, 7, tzinfo=timezone.utc), "job_id": "j", "state": "completed", "stage": "publish", "attempts": 1, "source_duration_s": 5.0,
            "error_class": None, "reason": None, "master_url": master_url, "reused_from": None, "ladder": [],
            "renditions": [{"name": "720p", "width": 1280, "height": 720, "url": master_url}],
            "outputs": [{"key": "work/j/thumbnails/1/thumbnails/poster.jpg", "content_type": "image/jpeg",
                         "sha256": "0" * 64, "size_bytes": 10}]}


@pytest.mark.parametrize("url", BAD)
def test_the_job_reads_hand_out_no_url_that_is_not_http(url):
    summary = job_summary(row(url))
    assert summary["master_url"] is None
    assert [o["url"] for o in summary["outputs"]] == [None]
    assert all(a["url"] is None for a in summary["artifacts"])


def test_the_job_reads_keep_an_http_url():
    summary = job_summary(row(GOOD))
    assert summary["master_url"] == GOOD and summary["outputs"][0]["url"] == GOOD


def delivery(master_url):
    return {"job_id": "j", "source_event_id": "e", "source_event_type": "JobCompleted", "source_stage": "publish",
            "source_attempt": 1, "notification_type": "job.completed",
            "source_broker_ts": datetime(2026, 12, 7, tzinfo=timezone.utc),
            "source_payload": json.dumps({"master_url": master_url, "media_duration_s": 5.0})}


@pytest.mark.parametrize("url", BAD)
def test_a_webhook_never_carries_a_url_that_is_not_http(url):
    data = json.loads(webhook_body(delivery(url)))["data"]
    assert "master_url" not in data and data["media_duration_s"] == 5.0


def test_a_webhook_carries_an_http_master_url():
    assert json.loads(webhook_body(delivery(GOOD)))["data"]["master_url"] == GOOD

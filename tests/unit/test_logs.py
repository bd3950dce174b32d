"""`tapeline.logs`: JSON lines carry the job context bound by a processor, and only while it lasts."""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
import structlog

from tapeline import logs


@pytest.fixture(autouse=True)
def clean_logging() -> Iterator[None]:
    structlog.contextvars.clear_contextvars()
    yield
    structlog.contextvars.clear_contextvars()
    structlog.reset_defaults()


def configure(log_format: str = "json") -> None:
    """Logging as `tapeline run` configures it. In the test body: the renderer writes to the
    `sys.stderr` of configure time, and capsys swaps that stream between setup and call."""
    logs.configure(log_format)


def lines(capsys) -> list[dict[str, Any]]:
    return [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.strip()]


def helper_far_from_the_worker() -> None:
    """A module that knows nothing of jobs (an object store, the media code) logging its own line."""
    structlog.get_logger("tapeline.objectstore").info("object stored", key="jobs/j-1/out.m3u8")


class FakeMessage:
    def topic(self) -> str:
        return "t.work.transcode.standard"

    def partition(self) -> int:
        return 2

    def offset(self) -> int:
        return 41


def test_a_nested_helpers_line_carries_the_job_and_the_kafka_position(capsys):
    configure()
    with logs.scope(**logs.kafka_position(FakeMessage())):  # as StageWorker.run does per record
        logs.bind(job_id="j-1", stage="transcode", attempt=2)  # as claim does once decoded
        logs.bind(claim_token="tok-1")  # and once claimed
        helper_far_from_the_worker()
    [line] = lines(capsys)
    assert line["event"] == "object stored" and line["key"] == "jobs/j-1/out.m3u8"
    assert {k: line[k] for k in (*logs.JOB_KEYS, "topic", "partition", "offset")} == {
        "job_id": "j-1", "stage": "transcode", "attempt": 2, "claim_token": "tok-1",
        "topic": "t.work.transcode.standard", "partition": 2, "offset": 41}
    assert line["level"] == "info" and line["timestamp"].endswith("Z")


def test_after_the_scope_a_line_has_no_job_context(capsys):
    configure()
    with logs.scope(**logs.kafka_position(FakeMessage())):
        logs.bind(job_id="j-1", stage="transcode", attempt=1, claim_token="tok-1")
    helper_far_from_the_worker()
    with logs.scope(topic="t.work.transcode.standard", partition=0, offset=7):  # the next record: skipped early
        structlog.get_logger("tapeline.worker").info("work item skipped", reason="unknown job")
    after, next_record = lines(capsys)
    assert not set(after) & {*logs.JOB_KEYS, "topic", "partition", "offset"}, after
    assert next_record["offset"] == 7 and "job_id" not in next_record and "claim_token" not in next_record


def test_a_scope_restores_an_outer_context(capsys):
    configure()
    logs.bind(role="transcode")
    with logs.scope(job_id="j-1"):
        pass
    helper_far_from_the_worker()
    [line] = lines(capsys)
    assert line["role"] == "transcode" and "job_id" not in line


def test_console_format_renders_the_context_too(capsys):
    configure("console")
    with logs.scope(job_id="j-1", stage="publish"):
        helper_far_from_the_worker()
    err = capsys.readouterr().err
    assert "object stored" in err and "j-1" in err and "publish" in err

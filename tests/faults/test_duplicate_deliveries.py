"""Duplicate deliveries (issue 7, item 5): the same upload event three times, the same work item
redelivered, and two transcode workers racing for one work item -> one job, one output set, one
post at a provider that does not dedupe; the late duplicate finds the original job, not an error."""

from __future__ import annotations

import json

import pytest
from confluent_kafka import Producer

from producers.submit import publish, upload
from domain import events as ev
from domain.codec import default_codec
from tapeline.samples import sample_video
from tests.conftest import Pipeline, tapeline_cli, wait_for
from tests.faults.conftest import OTHER_STAGES, job_row
from devstack.chaos import ProviderProcess as ProviderServer
from tests.faults.test_worker_faults import assert_completed_once, wait_state, wait_transcoding
from tests.integration.helpers import committed_events, committed_messages, of_job

pytestmark = pytest.mark.integration


@pytest.fixture()
def provider(tmp_path):
    server = ProviderServer(tmp_path)
    yield server
    server.stop()


def transcode_work_items(settings, job_id: str) -> list:
    """The committed transcode work-item records of a job (raw messages, every tier topic)."""
    codec, found = default_codec(), []
    for tier in ("archive", "standard", "index"):
        for message in committed_messages(settings, settings.work_topic("transcode", tier)):
            event = ev.Event.from_record(codec.decode(message.value()))
            if event.job_id == job_id:
                found.append(message)
    return found


def reproduce(settings, message, partitions: list[int]) -> None:
    """Deliver a copy of `message` (same key, same bytes) to each of `partitions` of its topic."""
    producer = Producer({"bootstrap.servers": settings.kafka_bootstrap})
    for partition in partitions:
        producer.produce(message.topic(), key=message.key(), value=message.value(), partition=partition)
    assert producer.flush(10) == 0


def test_the_same_upload_three_times_is_one_job(fault_settings, provider, tmp_path):
    settings = fault_settings.model_copy(update={"webhook_url": provider.url})
    pipeline = Pipeline(settings, tmp_path / "run.log").start()
    try:
        submission = upload(settings, sample_video("bigbuckbunny.mp4"))
        publish(settings, submission.event)
        wait_transcoding(settings, submission.job_id, min_frames=1)
        publish(settings, submission.event)  # while the first is mid-transcode
        wait_state(settings, submission.job_id)
        publish(settings, submission.event)  # after it finished
        wait_for(lambda: _copies(settings, submission.upload_id) == 3, 60, "the projector to see three copies")
        late = tapeline_cli(settings, "status", submission.job_id, "--json")
        events = assert_completed_once(settings, submission.job_id)
    finally:
        pipeline.stop()
    assert len(of_job(events, submission.job_id, "JobAccepted")) == 1  # the duplicates decided nothing
    assert [(e.stage, e.attempt) for e in of_job(events, submission.job_id, "AttemptStarted")] == [
        ("transcode", 1), ("thumbnails", 1), ("publish", 1)]
    assert len(provider.posts(submission.job_id)) == 1
    summary = json.loads(late.stdout)  # the late duplicate's view: the original job and its outputs
    assert summary["job_id"] == submission.job_id and summary["state"] == "completed"
    assert summary["master_url"] and len(summary["outputs"]) >= 1


def _copies(settings, upload_id: str) -> int:
    import psycopg

    with psycopg.connect(settings.database_url) as conn:
        row = conn.execute("SELECT copies FROM uploads WHERE upload_id = %s", (upload_id,)).fetchone()
    return row[0] if row else 0


def test_a_redelivered_work_item_is_skipped_while_running_and_after_completion(fault_settings, provider, tmp_path):
    settings = fault_settings.model_copy(update={"webhook_url": provider.url})
    pipeline = Pipeline(settings, tmp_path / "run.log").start()
    try:
        submission = upload(settings, sample_video("bigbuckbunny.mp4"))
        publish(settings, submission.event)
        wait_transcoding(settings, submission.job_id, min_frames=1)
        [item] = transcode_work_items(settings, submission.job_id)
        reproduce(settings, item, [item.partition()])  # redelivered while its attempt runs
        wait_state(settings, submission.job_id)
        reproduce(settings, item, [item.partition()])  # and again after the job completed
        wait_for(lambda: pipeline.log_text().count('"event": "work item skipped"') >= 2, 60,
                 "the transcode worker to skip both copies")
        events = assert_completed_once(settings, submission.job_id)
        log = pipeline.log_text()
    finally:
        pipeline.stop()
    assert [e.stage for e in of_job(events, submission.job_id, "AttemptStarted")] == ["transcode", "thumbnails", "publish"]
    # The busy worker left the group, so the first copy waits for it; both end up skipped, never claimed.
    assert "job already ended (completed)" in log
    assert len(provider.posts(submission.job_id)) == 1


def test_two_workers_racing_for_one_work_item_make_one_attempt(fault_settings, roles, provider):
    # A lease of 12 s, not 4 s: the race is for the claim; a heartbeat late on a loaded machine would
    # let the watchdog start a second attempt for a reason this test is not about.
    settings = fault_settings.model_copy(update={"webhook_url": provider.url, "lease_s": 12.0,
                                                 "no_progress_timeout_s": 24.0})
    roles.settings = settings
    for role in ("projector", "intake", *OTHER_STAGES, "watchdog"):
        roles.start(role)
    submission = upload(settings, sample_video("carphone_pristine.mp4"))
    publish(settings, submission.event)
    wait_for(lambda: (lambda r: r and r["state"] == "queued" and r["stage"] == "transcode")(
        job_row(settings, submission.job_id)), 60, "the transcode work item to be queued")
    [item] = transcode_work_items(settings, submission.job_id)
    reproduce(settings, item, [p for p in range(settings.work_partitions) if p != item.partition()])
    roles.start("transcode")
    roles.start("transcode")  # two workers, the same item on every partition: they race for it
    wait_state(settings, submission.job_id, timeout_s=120)
    events = assert_completed_once(settings, submission.job_id)
    started = [e for e in of_job(events, submission.job_id, "AttemptStarted") if e.stage == "transcode"]
    assert len(started) == 1 and started[0].attempt == 1
    assert [e.stage for e in of_job(events, submission.job_id, "AttemptSucceeded")] == [
        "transcode", "thumbnails", "publish"]  # once each
    assert len(provider.posts(submission.job_id)) == 1
    assert len([e for e in committed_events(settings) if isinstance(e, ev.JobCompleted)
                and e.job_id == submission.job_id]) == 1

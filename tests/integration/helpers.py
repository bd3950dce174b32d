"""Reading the committed log and the bucket, for assertions."""

from __future__ import annotations

import json
import subprocess
import time
import uuid

from confluent_kafka import KafkaError, TopicPartition

from schemas import models as ev
from schemas.codec import default_codec
from tapeline import kafka
from tapeline.objectstore import ObjectStore
from tapeline.settings import Settings


def committed_messages(settings: Settings, topic: str | None = None, timeout_s: float = 30.0) -> list:
    """Every committed record of a topic (default: the lifecycle log), from offset 0 to the end."""
    topic = topic or settings.jobs_topic
    consumer = kafka.consumer(settings, f"assert-{uuid.uuid4().hex[:8]}", **{"enable.partition.eof": True})
    partitions = kafka.partition_count(consumer, topic)
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    messages, at_end = [], set()
    deadline = time.monotonic() + timeout_s
    try:
        while len(at_end) < partitions and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None:
                continue
            if message.error():
                if message.error().code() == KafkaError._PARTITION_EOF:
                    at_end.add(message.partition())
                continue
            messages.append(message)
    finally:
        consumer.close()
    assert len(at_end) == partitions, f"did not reach the end of {topic}"
    return messages


def committed_events(settings: Settings, topic: str | None = None, timeout_s: float = 30.0) -> list[ev.Event]:
    """Every committed event of a topic (default: the lifecycle log), decoded, in partition order."""
    return [ev.Event.from_record(default_codec().decode(m.value())) for m in committed_messages(settings, topic, timeout_s)]


def of_job(events: list[ev.Event], job_id: str, event_type: str | None = None) -> list[ev.Event]:
    return [e for e in events if e.job_id == job_id and (event_type is None or e.event_type == event_type)]


def keys_under(settings: Settings, prefix: str) -> set[str]:
    store = ObjectStore(settings)
    keys, token = set(), None
    while True:
        page = store.s3.list_objects_v2(Bucket=store.bucket, Prefix=prefix,
                                        **({"ContinuationToken": token} if token else {}))
        keys |= {item["Key"] for item in page.get("Contents", [])}
        if not page.get("IsTruncated"):
            return keys
        token = page["NextContinuationToken"]


def ffprobe_duration(url_or_path: str, stream: str | None = None) -> float:
    """Duration in seconds by ffprobe (format duration, or one stream's with `stream="v:0"`)."""
    args = ["ffprobe", "-v", "error", "-of", "json"]
    args += ["-select_streams", stream, "-show_entries", "stream=duration"] if stream else ["-show_entries", "format=duration"]
    done = subprocess.run(args + [url_or_path], capture_output=True, text=True, timeout=60, check=True)
    info = json.loads(done.stdout)
    return float(info["streams"][0]["duration"] if stream else info["format"]["duration"])


def decodes(url: str) -> subprocess.CompletedProcess:
    """Decode a whole media URL with ffmpeg (no output); returncode 0 and empty stderr mean clean."""
    return subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-i", url, "-f", "null", "-"],
                          capture_output=True, text=True, timeout=120)

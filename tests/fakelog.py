"""Hand-made log records for `projections.projector.apply_batch`: real encoded events with a chosen
topic, partition, offset and broker time, so projections can be checked against exact times."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME

from domain import events as ev
from domain.codec import default_codec

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class FakeMessage:
    """The part of `confluent_kafka.Message` the projector reads."""

    _topic: str
    _partition: int
    _offset: int
    _timestamp_ms: int
    _value: bytes
    _key: bytes | None = None
    _headers: list[tuple[str, bytes]] | None = None

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def timestamp(self) -> tuple[int, int]:
        return TIMESTAMP_LOG_APPEND_TIME, self._timestamp_ms

    def value(self) -> bytes:
        return self._value

    def key(self) -> bytes | None:
        return self._key

    def headers(self) -> list[tuple[str, bytes]] | None:
        return self._headers

    def error(self) -> None:
        return None


class FakeLog:
    """Appends events to one partition of a topic with broker time `T0 + seconds`."""

    def __init__(self, topic: str = "fake.jobs", partition: int = 0) -> None:
        self.topic, self.partition = topic, partition
        self.messages: list[FakeMessage] = []

    def append(self, at_s: float, event: ev.Event | bytes) -> FakeMessage:
        value = event if isinstance(event, bytes) else default_codec().encode(event.to_record())
        key = None if isinstance(event, bytes) else event.job_id.encode()
        ts = T0 + timedelta(seconds=at_s)
        message = FakeMessage(self.topic, self.partition, len(self.messages), int(ts.timestamp() * 1000), value, key)
        self.messages.append(message)
        return message


def at(seconds: float) -> datetime:
    """Broker time `T0 + seconds` (UTC)."""
    return T0 + timedelta(seconds=seconds)

"""Logging: JSON lines through structlog by default, `console` for humans.

Job context: a processor wraps the handling of one record in `scope(topic=, partition=, offset=)`
and binds `job_id`, `stage`, `attempt`, `claim_token` as it learns them (`bind`); every line logged
meanwhile, by any module (object store, media), carries them through `merge_contextvars`. Leaving
the scope restores the context as it was before it, so nothing leaks onto the next record's lines.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import structlog

JOB_KEYS = ("job_id", "stage", "attempt", "claim_token")
"""What every line about a job carries (with the Kafka position `topic`, `partition`, `offset`)."""


def configure(log_format: str = "json", level: str = "INFO") -> None:
    """Route structlog to stderr as JSON lines (`json`) or coloured text (`console`)."""
    renderer = structlog.processors.JSONRenderer() if log_format == "json" else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True), structlog.processors.format_exc_info,
                    renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr), cache_logger_on_first_use=False)


@contextmanager
def scope(**context: Any) -> Iterator[None]:
    """Bind `context` for the duration of the block; on exit restore the whole context as it was on
    entry (keys bound inside with `bind` included: `bound_contextvars` would restore only its own)."""
    saved = structlog.contextvars.get_contextvars()
    structlog.contextvars.bind_contextvars(**context)
    try:
        yield
    finally:
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(**saved)


def bind(**context: Any) -> None:
    """Add to the current context (inside a `scope`, which removes it again)."""
    structlog.contextvars.bind_contextvars(**context)


def kafka_position(message: Any) -> dict[str, Any]:
    """The `topic`, `partition`, `offset` of a consumed Kafka message, for `scope`."""
    return {"topic": message.topic(), "partition": message.partition(), "offset": message.offset()}

"""Logging: JSON lines through structlog by default, `console` for humans."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(log_format: str = "json", level: str = "INFO") -> None:
    """Route structlog to stderr as JSON lines (`json`) or coloured text (`console`)."""
    renderer = structlog.processors.JSONRenderer() if log_format == "json" else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True), structlog.processors.format_exc_info,
                    renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr), cache_logger_on_first_use=False)

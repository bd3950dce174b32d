"""What every benchmark shares: its own topics and database on the local stack."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from projections.sql import migrate  # noqa: E402
from tapeline import stack  # noqa: E402
from tapeline.settings import Settings  # noqa: E402


def bench_settings(name: str, **overrides: Any) -> Settings:
    """Bring the local stack up and return settings with a fresh topic prefix, app name and database
    (`<name>_<tag>`), small partition counts, the topics created and the migrations applied;
    `overrides` are applied last."""
    base = Settings()
    stack.up(base)
    tag = uuid.uuid4().hex[:8]
    dbname = f"bench_{name}_{tag}"
    with psycopg.connect(base.database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{dbname}"')
    settings = base.model_copy(update={
        "topic_prefix": f"{name}{tag}", "app_name": f"bench-{name}-{tag}", "jobs_partitions": 3, "work_partitions": 2,
        "uploads_partitions": 2, "database_url": base.database_url.rsplit("/", 1)[0] + "/" + dbname,
        "reuse_results": False,  # benches resubmit one clip to measure transcodes, not result reuse
        **overrides})
    stack.ensure_topics(settings)
    migrate(settings.database_url)
    return settings


def drop_bench_database(settings: Settings) -> None:
    """Drop the database `bench_settings` created, and its topics."""
    from tapeline import stack

    stack.delete_topics(settings)
    dbname = settings.database_url.rsplit("/", 1)[1]
    with psycopg.connect(Settings().database_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')

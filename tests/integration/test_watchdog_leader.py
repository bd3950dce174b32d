"""Watchdog leadership against real PostgreSQL and Kafka: one leader per deployment, not per database.

Two deployments (their own app name, topics and projection schema) share one database. Each must
get a leading watchdog: with one advisory key for the whole database, the first deployment's
watchdog kept the second one's standing by for good, and that deployment's stalls went unseen.
Within a deployment, a second watchdog stands by until the leader's session ends.
"""

from __future__ import annotations

import threading
import uuid

import pytest

from tapeline.health import HealthState
from tapeline.postgres import migrate
from cli.wiring import build_processor
import devstack as stack
from tests.conftest import wait_for

pytestmark = pytest.mark.integration


class Running:
    """A `Watchdog` (wired as `tapeline run --role watchdog` wires it) in a thread of this process,
    stopped by `stop()`."""

    def __init__(self, settings) -> None:
        self.watchdog = build_processor("watchdog", settings, HealthState("watchdog", settings.instance_id))
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self.watchdog.run, args=(self.halt,), daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.halt.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the watchdog did not stop"


def test_each_deployment_in_one_database_has_its_own_leader_and_a_second_watchdog_stands_by(isolated):
    tag = uuid.uuid4().hex[:6]
    first = isolated.model_copy(update={"tick_interval_s": 0.3, "instance_id": "first"})
    other = first.model_copy(update={"app_name": f"{isolated.app_name}-other", "topic_prefix": f"o{tag}",
                                     "db_schema": f"other_{tag}", "instance_id": "other"})
    stack.ensure_topics(other)
    migrate(other.database_url, other.db_schema)
    running = [Running(first)]
    try:
        wait_for(lambda: running[0].watchdog.ticks > 0, 30, "the first deployment's watchdog to lead")
        running.append(Running(other))
        wait_for(lambda: running[1].watchdog.ticks > 0, 30,
                 "the other deployment's watchdog to lead while the first one's leads")
        standby = Running(first.model_copy(update={"instance_id": "standby"}))
        running.append(standby)
        ticks_before = running[0].watchdog.ticks
        wait_for(lambda: running[0].watchdog.ticks >= ticks_before + 3, 30, "the first leader to go on ticking")
        assert standby.watchdog.ticks == 0  # same deployment: it stands by
        running[0].stop()  # its session ends, and the lock with it
        wait_for(lambda: standby.watchdog.ticks > 0, 30, "the standby to take over")
    finally:
        for each in running:
            each.stop()
        stack.delete_topics(other)

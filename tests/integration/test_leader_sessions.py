"""A leader's PostgreSQL session (the watchdog's, the notifier's, the projector's: each holds a
leader lock in its session) carries the dead-peer settings on the real server, so PostgreSQL ends
it, and frees the lock, within `leader_session_timeout_s` when its host stops answering; other
sessions keep the server's defaults. A session lost under a call is `ServiceUnavailable` once and
then replaced, except a leader's, which never quietly reopens. (Cutting a host off from PostgreSQL itself is not possible
here: the shared server listens on loopback only, and tests/faults/test_network_partitions.py
reaches it through a forwarder whose own keepalive stands in.)"""

from __future__ import annotations

import psycopg
import pytest

from domain.errors import ServiceUnavailable
from tapeline.postgres import PostgresJobStore
from tests.integration.helpers import terminate_session

pytestmark = pytest.mark.integration


def shown(store: PostgresJobStore) -> dict[str, str]:
    conn = store.connection()
    return {name: conn.execute(f"SHOW {name}").fetchone()[name]
            for name in ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count", "tcp_user_timeout")}


def test_a_leader_session_gives_up_on_a_silent_peer_and_others_keep_the_defaults(base_settings):
    settings = base_settings.model_copy(update={"leader_session_timeout_s": 15.0})
    leader, plain = PostgresJobStore(settings, leader=True), PostgresJobStore(settings)
    try:
        assert shown(leader) == {"tcp_keepalives_idle": "5", "tcp_keepalives_interval": "2",
                                 "tcp_keepalives_count": "3", "tcp_user_timeout": "15000"}
        client = leader.connection().info.get_parameters()
        assert (client["keepalives"], client["keepalives_idle"], client["tcp_user_timeout"]) == ("1", "5", "15000")
        assert shown(plain)["tcp_user_timeout"] == "0"  # the server's default: untouched
        assert "keepalives_idle" not in plain.connection().info.get_parameters()
    finally:
        leader.close()
        plain.close()


def test_a_lost_session_is_unavailable_once_then_reopened_but_a_leader_never_reopens(base_settings):
    plain, leader = PostgresJobStore(base_settings), PostgresJobStore(base_settings, leader=True)
    try:
        first = plain.connection().info.backend_pid
        terminate_session(plain, base_settings)
        with pytest.raises(ServiceUnavailable, match="PostgreSQL session lost during schema_missing"):
            plain.one("schema_missing", {"schema": "public"})
        assert plain.one("schema_missing", {"schema": "public"}), "the next call runs on a new session"
        assert plain.connection().info.backend_pid != first
        terminate_session(plain, base_settings)
        with pytest.raises(ServiceUnavailable, match="during a transaction"):
            with plain.transaction():
                plain.one("schema_missing", {"schema": "public"})

        terminate_session(leader, base_settings)
        for _ in range(2):  # its leader lock went with the session: never a quiet new one
            with pytest.raises(psycopg.OperationalError):
                leader.one("schema_missing", {"schema": "public"})
    finally:
        plain.close()
        leader.close()

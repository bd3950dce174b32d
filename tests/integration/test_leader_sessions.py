"""A leader's PostgreSQL session (the watchdog's, the notifier's, the projector's: each holds a
leader lock in its session) carries the dead-peer settings on the real server, so PostgreSQL ends
it, and frees the lock, within `leader_session_timeout_s` when its host stops answering; other
sessions keep the server's defaults. (Cutting a host off from PostgreSQL itself is not possible
here: the shared server listens on loopback only, and tests/faults/test_network_partitions.py
reaches it through a forwarder whose own keepalive stands in.)"""

from __future__ import annotations

import pytest

from tapeline.postgres import PostgresJobStore

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

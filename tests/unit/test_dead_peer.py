"""`tapeline.postgres.dead_peer_settings`: a leader's session gives up on a silent peer within its
timeout, on both ends (the server's keepalive and user timeout, libpq's)."""

from __future__ import annotations

import pytest

from tapeline.postgres import dead_peer_settings, leader_session
from tapeline.settings import Settings


@pytest.mark.parametrize("timeout_s", [6.0, 15.0, 60.0, 600.0])
def test_probes_end_a_silent_session_within_the_timeout(timeout_s):
    options, params = dead_peer_settings(timeout_s)
    idle, interval, count = params["keepalives_idle"], params["keepalives_interval"], params["keepalives_count"]
    assert idle >= 1 and interval >= 1 and idle + interval * count <= timeout_s  # the last probe unanswered: ended
    assert params["tcp_user_timeout"] == int(timeout_s * 1000) and params["keepalives"] == 1
    assert options == (f" -c tcp_keepalives_idle={idle} -c tcp_keepalives_interval={interval}"
                       f" -c tcp_keepalives_count={count} -c tcp_user_timeout={int(timeout_s * 1000)}")


def test_a_timeout_below_six_seconds_is_six():
    assert dead_peer_settings(1.0) == dead_peer_settings(6.0)


def test_a_leader_session_keeps_the_deployments_schema_and_jit_off():
    session = leader_session(Settings(db_schema="tapeline_a", leader_session_timeout_s=15.0))
    assert session["options"].startswith("-c jit=off -c search_path=tapeline_a -c tcp_keepalives_idle=5 ")
    assert (session["keepalives_idle"], session["keepalives_interval"], session["tcp_user_timeout"]) == (5, 2, 15000)

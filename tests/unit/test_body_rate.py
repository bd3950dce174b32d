"""The request-body pace rule (`domain/policy/body_rate.py`)."""

from __future__ import annotations

from hypothesis import given, strategies as st

from domain.policy.body_rate import BodyRate

RATE = BodyRate(timeout_s=20.0, min_rate_bytes_s=65536.0, idle_s=30.0)


def test_a_body_that_has_sent_nothing_gets_the_base_timeout():
    assert RATE.read_deadline(started=100.0, last_chunk_at=100.0, received=0) == 120.0


def test_each_min_rate_of_bytes_earns_one_more_second():
    assert RATE.read_deadline(100.0, 100.0, 65536 * 5) == 125.0


def test_a_pause_longer_than_idle_ends_it_whatever_the_credit():
    # 100 MB in earns 1600 s of credit, but the next chunk must still come within idle_s.
    assert RATE.read_deadline(100.0, 150.0, 100 * 1024 * 1024) == 180.0


def test_a_trickle_falls_behind_within_the_timeout():
    # One byte a second: after 21 s it has 21 bytes, far below the pace; its deadline (just past 20 s) has passed.
    assert 20.0 < RATE.read_deadline(0.0, 21.0, 21) < 21.0


@given(rate=st.floats(1.0, 1e8), seconds=st.floats(0.0, 1e5), chunk_s=st.floats(0.001, 19.9))
def test_a_client_at_the_min_rate_without_long_pauses_is_never_cut_off(rate, seconds, chunk_s):
    policy = BodyRate(timeout_s=20.0, min_rate_bytes_s=rate, idle_s=30.0)
    # It has sent `rate` bytes for every second so far and its last chunk chunk_s ago: a pause
    # shorter than the base timeout, the slack a client at exactly the minimum pace has.
    now = seconds + chunk_s
    assert policy.read_deadline(0.0, seconds, int(rate * seconds) + 1) > now


def test_the_explanation_names_what_came_and_what_is_asked():
    text = RATE.explain(received=12, elapsed_s=21.04)
    assert "12 bytes in 21.0 s" in text and "65536 bytes/s" in text and "30 s" in text

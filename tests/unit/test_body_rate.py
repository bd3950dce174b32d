"""The request-body pace rule (`domain/policy/body_rate.py`)."""

from __future__ import annotations

from hypothesis import given, strategies as st

from domain.policy.body_rate import BodyRate

RATE = BodyRate(timeout_s=20.0, min_rate_bytes_s=65536.0, idle_s=30.0, window_s=2.0)


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
    policy = BodyRate(timeout_s=20.0, min_rate_bytes_s=rate, idle_s=30.0, window_s=2.0)
    # It has sent `rate` bytes for every second so far and its last chunk chunk_s ago: a pause
    # shorter than the base timeout, the slack a client at exactly the minimum pace has.
    now = seconds + chunk_s
    assert policy.read_deadline(0.0, seconds, int(rate * seconds) + 1) > now


def test_the_explanation_names_what_came_and_what_is_asked():
    text = RATE.explain(received=12, elapsed_s=21.04)
    assert "12 bytes in 21.0 s" in text and "65536 bytes/s" in text and "30 s" in text


# -- When a body starts to count against its tier (issue 44 item 3) ----------------------------------

def test_a_body_is_moving_once_a_window_holds_the_min_rate_of_bytes():
    assert RATE.window_bytes == 131072  # 64 KiB/s x 2 s
    assert not RATE.moving([(0.0, 0)], ended=False)  # headers only
    assert not RATE.moving([(0.0, 0), (0.5, 131071)], ended=False)  # one byte short
    assert RATE.moving([(0.0, 0), (0.5, 131072)], ended=False)
    assert RATE.moving([(0.0, 0), (2.0, 131072)], ended=False)  # exactly the window


def test_a_trickle_never_becomes_moving_however_much_it_has_sent_in_all():
    # 1 KiB every 0.1 s (10 KiB/s) for 60 s: 600 KiB in all, never 128 KiB within 2 s.
    arrivals = [(0.0, 0)] + [(n / 10, n * 1024) for n in range(1, 601)]
    assert not any(RATE.moving(arrivals[:i + 1], ended=False) for i in range(len(arrivals)))


def test_a_slow_start_then_a_fast_window_is_moving():
    arrivals = [(0.0, 0), (5.0, 10), (10.0, 20), (10.5, 20 + 131072)]
    assert not RATE.moving(arrivals[:3], ended=False)
    assert RATE.moving(arrivals, ended=False)


def test_a_body_that_ended_is_moving_however_small():
    assert RATE.moving([(0.0, 0), (0.1, 5)], ended=True)


def test_samples_older_than_the_window_may_be_dropped():
    full = [(0.0, 0), (1.0, 100), (5.0, 200), (6.0, 200 + 131000), (6.5, 200 + 131072)]
    assert RATE.moving(full[:4], ended=False) is False
    assert RATE.moving(full, ended=False) and RATE.moving(full[3:], ended=False) is False  # base 131200: 72 bytes
    assert RATE.moving(full[2:], ended=False)


@given(rate=st.floats(1.0, 1e7), window=st.floats(0.1, 10.0), chunk_s=st.floats(0.001, 1.0),
       chunks=st.integers(1, 200))
def test_a_body_below_the_min_rate_is_never_moving(rate, window, chunk_s, chunks):
    policy = BodyRate(timeout_s=20.0, min_rate_bytes_s=rate, idle_s=30.0, window_s=window)
    per_chunk = int(rate * chunk_s * 0.9)  # 90 % of the rate, evenly
    arrivals = [(0.0, 0)] + [(n * chunk_s, n * per_chunk) for n in range(1, chunks + 1)]
    assert not any(policy.moving(arrivals[:i + 1], ended=False) for i in range(len(arrivals)))

"""Our partitioner equals Kafka's default (murmur2), so Java clients and lookups agree."""

import pytest

from tapeline.kafka import murmur2, partition_for


def _signed(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


@pytest.mark.parametrize("text,expected", [
    # Vectors from Apache Kafka's UtilsTest.testMurmur2.
    ("21", -973932308),
    ("foobar", -790332482),
    ("a-little-bit-long-string", -985981536),
    ("a-little-bit-longer-string", -1486304829),
    ("lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
    ("abc", 479470107),
])
def test_murmur2_matches_kafka(text, expected):
    assert _signed(murmur2(text.encode())) == expected


def test_partition_is_stable_and_in_range():
    for n in (1, 3, 12):
        p = partition_for("6f218779-a355-52a7-9052-631c835364fe", n)
        assert 0 <= p < n and p == partition_for("6f218779-a355-52a7-9052-631c835364fe", n)

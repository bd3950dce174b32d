"""Kafka's default partitioner (murmur2), with no client library: every record is produced to
`partition_for(job_id, partitions)`, so Java clients, the processors (which import no Kafka client,
see pyproject.toml) and our own lookups agree on a job's partition. `tapeline.kafka` re-exports both.
"""

from __future__ import annotations


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash (org.apache.kafka.common.utils.Utils.murmur2), as an unsigned 32-bit int."""
    m, r = 0x5BD1E995, 24
    length = len(data)
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    for i in range(0, length - length % 4, 4):
        k = data[i] | (data[i + 1] << 8) | (data[i + 2] << 16) | (data[i + 3] << 24)
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    tail, index = length % 4, length & ~3
    if tail == 3:
        h ^= data[index + 2] << 16
    if tail >= 2:
        h ^= data[index + 1] << 8
    if tail >= 1:
        h ^= data[index]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


def partition_for(key: str, partitions: int) -> int:
    """The partition Kafka's default partitioner picks for `key` among `partitions`."""
    return (murmur2(key.encode()) & 0x7FFFFFFF) % partitions

"""A bounded read of the committed log reads every record below its stop offsets (real Kafka).

The reader's partition-end events come from the broker's last stable offset as one fetch saw it.
An end event below the stop offset fixed before reading (a transaction whose commit markers were
not yet written when that fetch was served) must not end the partition: `bench/replay.py --smoke`
once decoded 4,797 of the 4,801 records it had written that way.
"""

from __future__ import annotations

import threading
import uuid

from confluent_kafka import Producer, TopicPartition

from tapeline import kafka_scan
from tapeline.settings import Settings


def test_an_end_of_partition_below_the_stop_offset_does_not_end_the_read(isolated: Settings) -> None:
    topic = isolated.jobs_topic
    producer = Producer({"bootstrap.servers": isolated.kafka_bootstrap, "enable.idempotence": True,
                         "transactional.id": f"{isolated.app_name}.logread-{uuid.uuid4().hex[:6]}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for n in range(3):
        producer.produce(topic, value=f"first-{n}".encode(), partition=0)
    producer.commit_transaction(30)
    producer.begin_transaction()
    for n in range(4):
        producer.produce(topic, value=f"open-{n}".encode(), partition=0)
    producer.flush(30)

    consumer = kafka_scan.reader(isolated, "test-logread")
    try:
        span = kafka_scan.bounds(consumer, [topic], partitions={topic: [0]})
        # The stop the reader must reach: past the open transaction's records, as a stop taken
        # just after its commit would be (3 records + 1 marker + 4 records + 1 marker).
        uncommitted = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10, cached=False)
        assert span.stop[(topic, 0)] == 4, "the open transaction holds the last stable offset at 4"
        span.stop[(topic, 0)] = 9
        values: list[bytes] = []
        failure: list[BaseException] = []

        def read() -> None:
            try:
                for piece in kafka_scan.read(consumer, span, batch_size=100, stall_timeout_s=30):
                    values.extend(message.value() for message in piece.records)
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                failure.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        reader.join(3.0)  # the reader reaches offset 4 (an end event there) and must keep waiting
        assert reader.is_alive(), f"the read ended at the open transaction with {values} (failure: {failure})"
        producer.commit_transaction(30)
        reader.join(40)
        assert not reader.is_alive(), "the read did not end after the transaction committed"
        assert not failure, failure
        assert values == [f"first-{n}".encode() for n in range(3)] + [f"open-{n}".encode() for n in range(4)], (
            f"read {values}; the partition's uncommitted high watermark was {uncommitted}")
    finally:
        consumer.close()

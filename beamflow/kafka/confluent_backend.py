"""The librdkafka backend (confluent-kafka): the fast one.

Tuned from measurements on this kind of machine (../shared/research/kafka.md): with the default
``fetch.queue.backoff.ms`` librdkafka pauses between fetches and tops out near 150k msg/s; with 0 and a short
``fetch.wait.max.ms`` the same consumer reads about 800k msg/s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException
from confluent_kafka import TopicPartition as CkTopicPartition

from beamflow.kafka.client import KafkaConsumerClient
from beamflow.kafka.record import KafkaRecord, TopicPartition

__all__ = ["TUNED_DEFAULTS", "ConfluentConsumer"]

TUNED_DEFAULTS: dict[str, Any] = {
    "fetch.queue.backoff.ms": 0,
    "fetch.wait.max.ms": 10,
    "queued.min.messages": 100000,
    "queued.max.messages.kbytes": 65536,
    "fetch.max.bytes": 52428800,
    "max.partition.fetch.bytes": 4194304,
}


class ConfluentConsumer(KafkaConsumerClient):
    def __init__(self, bootstrap: str, group_id: str, config: Mapping[str, Any]) -> None:
        settings: dict[str, Any] = {
            **TUNED_DEFAULTS,
            **config,
            "bootstrap.servers": bootstrap,
            "group.id": group_id,
            # Offsets move only through commit() from a bundle finalizer; never behind beamflow's back.
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
        }
        settings.setdefault("auto.offset.reset", "earliest")
        self._consumer = Consumer(settings)
        self._assigned: dict[TopicPartition, int] = {}

    def assign(self, tp: TopicPartition, offset: int) -> None:
        self._assigned[tp] = offset
        self._consumer.assign([CkTopicPartition(t.topic, t.partition, o) for t, o in self._assigned.items()])

    def poll(self, max_records: int, timeout_s: float) -> list[KafkaRecord]:
        out: list[KafkaRecord] = []
        for msg in self._consumer.consume(num_messages=max_records, timeout=timeout_s):
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                raise KafkaException(err)
            _, ts = msg.timestamp()
            headers = msg.headers()
            out.append(
                KafkaRecord(
                    topic=msg.topic(),  # type: ignore[arg-type]  # set on every non-error message
                    partition=msg.partition(),  # type: ignore[arg-type]
                    offset=msg.offset(),  # type: ignore[arg-type]
                    timestamp_ms=ts,
                    key=msg.key(),
                    value=msg.value(),
                    headers=tuple(headers) if headers else (),  # type: ignore[arg-type]
                )
            )
        return out

    def watermarks(self, tp: TopicPartition, timeout_s: float = 10.0) -> tuple[int, int]:
        low, high = self._consumer.get_watermark_offsets(
            CkTopicPartition(tp.topic, tp.partition), timeout=timeout_s, cached=False
        )
        return int(low), int(high)

    def committed(self, tp: TopicPartition, timeout_s: float = 10.0) -> int | None:
        [result] = self._consumer.committed([CkTopicPartition(tp.topic, tp.partition)], timeout=timeout_s)
        return None if result.offset in (OFFSET_INVALID, -1) else int(result.offset)

    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        self._consumer.commit(
            offsets=[CkTopicPartition(tp.topic, tp.partition, off) for tp, off in offsets.items()],
            asynchronous=False,
        )

    def offset_for_time(self, tp: TopicPartition, timestamp_ms: int, timeout_s: float = 10.0) -> int | None:
        [result] = self._consumer.offsets_for_times(
            [CkTopicPartition(tp.topic, tp.partition, timestamp_ms)], timeout=timeout_s
        )
        return None if result.offset < 0 else int(result.offset)

    def partitions(self, topic: str, timeout_s: float = 10.0) -> list[int]:
        metadata = self._consumer.list_topics(topic, timeout=timeout_s)
        described = metadata.topics.get(topic)
        if described is None or described.error is not None:
            raise KafkaException(described.error if described else f"topic {topic} not found")
        return sorted(described.partitions)

    def close(self) -> None:
        self._consumer.close()

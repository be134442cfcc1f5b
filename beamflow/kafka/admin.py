"""Topic administration and a plain producer: used by tests, the data generator and the demo."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic

__all__ = ["add_partitions", "create_topic", "end_offsets", "produce", "topic_partition_count"]


def _admin(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap})


def create_topic(bootstrap: str, topic: str, partitions: int, config: dict[str, str] | None = None) -> None:
    """Creates ``topic`` (idempotent: an existing topic with the same partition count is accepted)."""
    admin = _admin(bootstrap)  # keep the client alive until its futures resolve
    futures = admin.create_topics(
        [NewTopic(topic, num_partitions=partitions, replication_factor=1, config=config or {})]
    )
    for future in futures.values():
        try:
            future.result(30)
        except Exception as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise
            existing = topic_partition_count(bootstrap, topic)
            if existing != partitions:
                raise ValueError(f"topic {topic} exists with {existing} partitions, not {partitions}") from exc


def add_partitions(bootstrap: str, topic: str, total: int) -> None:
    admin = _admin(bootstrap)
    for future in admin.create_partitions([NewPartitions(topic, total)]).values():
        future.result(30)


def topic_partition_count(bootstrap: str, topic: str) -> int:
    metadata = _admin(bootstrap).list_topics(topic, timeout=10)
    return len(metadata.topics[topic].partitions)


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "beamflow-admin", "enable.auto.commit": False})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in sorted(parts)}
    finally:
        consumer.close()


def produce(
    bootstrap: str,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes | None] | tuple[bytes | None, bytes | None, dict[str, Any]]],
    config: dict[str, Any] | None = None,
) -> int:
    """Produces (key, value[, {partition, timestamp_ms, headers}]) records with acks=all; returns how many were acked.

    Raises if any record failed: a test or a generator that silently loses data proves nothing.
    """
    producer = Producer(
        {"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all", "enable.idempotence": True, **(config or {})}
    )
    errors: list[str] = []
    acked = 0

    def on_delivery(err: Any, _msg: Any) -> None:
        nonlocal acked
        if err is not None:
            errors.append(str(err))
        else:
            acked += 1

    for item in records:
        key, value = item[0], item[1]
        extra: dict[str, Any] = item[2] if len(item) > 2 else {}
        kwargs: dict[str, Any] = {"key": key, "value": value, "on_delivery": on_delivery}
        if "partition" in extra:
            kwargs["partition"] = extra["partition"]
        if "timestamp_ms" in extra:
            kwargs["timestamp"] = extra["timestamp_ms"]
        if "headers" in extra:
            kwargs["headers"] = extra["headers"]
        while True:
            try:
                producer.produce(topic, **kwargs)
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
    remaining = producer.flush(60)
    if remaining or errors:
        raise RuntimeError(f"produce to {topic}: {remaining} unflushed, {len(errors)} failed: {errors[:3]}")
    return acked

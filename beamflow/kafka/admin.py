"""Topic administration, the shared connection settings, and a plain producer: for the sinks, the CLI, the data
generator, the demo and tests.

Every function takes the client's settings (``config``): only the connection and security ones are used
(``connection_config``), with secret references (``env:``/``file:``) resolved here, where the client is made. So
the admin calls of a job whose brokers require SASL_SSL go over the same listener, with the same credentials, as its
read and its sinks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic

__all__ = [
    "CONNECTION_PREFIXES",
    "TopicNotFound",
    "add_partitions",
    "committed_offsets",
    "connection_config",
    "connection_settings",
    "create_topic",
    "end_offsets",
    "produce",
    "topic_partition_count",
]

# Settings every client of a job shares (how to reach and authenticate to the brokers); an admin client, a consumer
# made beside a producer, or a dead-letter producer gets these, not the settings of one client kind.
CONNECTION_PREFIXES = ("security.", "sasl.", "ssl.", "client.", "socket.", "broker.address.")


class TopicNotFound(LookupError):
    """The topic does not exist (or its metadata says it has no partitions)."""


def connection_settings(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The connection and security settings of a client config, references left as they are (safe to carry in a
    pipeline: the secret itself is read where the client opens)."""
    return {k: v for k, v in (config or {}).items() if k.startswith(CONNECTION_PREFIXES)}


def connection_config(bootstrap: str, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``bootstrap.servers`` plus the connection and security settings of ``config``, secret references resolved."""
    from beamflow.secrets import kafka_client_config

    return kafka_client_config({"bootstrap.servers": bootstrap, **connection_settings(config)})


def _admin(bootstrap: str, config: Mapping[str, Any] | None) -> AdminClient:
    return AdminClient(connection_config(bootstrap, config))


def create_topic(
    bootstrap: str,
    topic: str,
    partitions: int,
    topic_config: dict[str, str] | None = None,
    config: Mapping[str, Any] | None = None,
) -> None:
    """Creates ``topic`` (idempotent: an existing topic with the same partition count is accepted)."""
    admin = _admin(bootstrap, config)  # keep the client alive until its futures resolve
    futures = admin.create_topics(
        [NewTopic(topic, num_partitions=partitions, replication_factor=1, config=topic_config or {})]
    )
    for future in futures.values():
        try:
            future.result(30)
        except Exception as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise
            existing = topic_partition_count(bootstrap, topic, config=config)
            if existing != partitions:
                raise ValueError(f"topic {topic} exists with {existing} partitions, not {partitions}") from exc


def add_partitions(bootstrap: str, topic: str, total: int, config: Mapping[str, Any] | None = None) -> None:
    admin = _admin(bootstrap, config)
    for future in admin.create_partitions([NewPartitions(topic, total)]).values():
        future.result(30)


def topic_partition_count(
    bootstrap: str, topic: str, timeout_s: float = 30.0, config: Mapping[str, Any] | None = None
) -> int:
    """How many partitions ``topic`` has; raises ``TopicNotFound`` if it does not exist."""
    metadata = _admin(bootstrap, config).list_topics(topic, timeout=timeout_s)
    found = metadata.topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        raise TopicNotFound(f"topic {topic} does not exist ({found.error if found else 'no metadata'})")
    return len(found.partitions)


def end_offsets(bootstrap: str, topic: str, config: Mapping[str, Any] | None = None) -> dict[int, int]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {**connection_config(bootstrap, config), "group.id": "beamflow-admin", "enable.auto.commit": False}
    )
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in sorted(parts)}
    finally:
        consumer.close()


def committed_offsets(
    bootstrap: str, topic: str, group_id: str, config: Mapping[str, Any] | None = None
) -> dict[int, int | None]:
    """The offsets ``group_id`` has committed on each partition of ``topic`` (None: nothing committed there)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({**connection_config(bootstrap, config), "group.id": group_id, "enable.auto.commit": False})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        found = consumer.committed([TopicPartition(topic, p) for p in sorted(parts)], timeout=10)
        return {tp.partition: tp.offset if tp.offset >= 0 else None for tp in found}
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
    from beamflow.secrets import kafka_client_config

    producer = Producer(
        kafka_client_config(
            {
                "bootstrap.servers": bootstrap,
                "linger.ms": 5,
                "acks": "all",
                "enable.idempotence": True,
                **(config or {}),
            }
        )
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

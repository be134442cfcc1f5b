"""A small consumer contract over two Kafka clients, so the read transform knows neither.

Only ``assign`` + ``seek`` semantics: beamflow never calls ``subscribe``, so there is no consumer-group membership and
no rebalance, whatever the parallelism. The group id is used only to store and read committed offsets.
rebalance, whatever the parallelism. The group id is used only to store and read committed offsets.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from beamflow.kafka.record import KafkaRecord, TopicPartition

__all__ = ["BACKENDS", "KafkaConsumerClient", "open_consumer"]


class KafkaConsumerClient(ABC):
    """One consumer reading explicitly assigned partitions. Not thread-safe; one per reading thread."""

    @abstractmethod
    def assign(self, tp: TopicPartition, offset: int) -> None:
        """Reads ``tp`` from ``offset`` on (replacing any earlier assignment of that partition)."""

    @abstractmethod
    def poll(self, max_records: int, timeout_s: float) -> list[KafkaRecord]: ...

    @abstractmethod
    def watermarks(self, tp: TopicPartition, timeout_s: float = 10.0) -> tuple[int, int]:
        """(low, high) offsets: first available and next to be written."""

    @abstractmethod
    def committed(self, tp: TopicPartition, timeout_s: float = 10.0) -> int | None:
        """The group's committed offset (next to read), or None if the group never committed one."""

    @abstractmethod
    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Synchronously commits ``next offset to read`` per partition for the group."""

    @abstractmethod
    def offset_for_time(self, tp: TopicPartition, timestamp_ms: int, timeout_s: float = 10.0) -> int | None:
        """The first offset whose timestamp is >= ``timestamp_ms``, or None past the end."""

    @abstractmethod
    def partitions(self, topic: str, timeout_s: float = 10.0) -> list[int]: ...

    @abstractmethod
    def close(self) -> None: ...


def open_consumer(
    backend: str, bootstrap: str, group_id: str, config: Mapping[str, Any] | None = None
) -> KafkaConsumerClient:
    """A consumer of the named backend: ``confluent`` (librdkafka, fast) or ``kafka-python`` (pure Python).

    Secret settings given as references (``sasl.password: env:NAME``, see ``beamflow.secrets``) are resolved here.
    """
    from beamflow.secrets import kafka_client_config

    config = kafka_client_config(config or {})
    if backend == "confluent":
        from beamflow.kafka.confluent_backend import ConfluentConsumer

        return ConfluentConsumer(bootstrap, group_id, config or {})
    if backend == "kafka-python":
        from beamflow.kafka.kafka_python_backend import KafkaPythonConsumer

        return KafkaPythonConsumer(bootstrap, group_id, config or {})
    raise ValueError(f"unknown Kafka backend {backend!r}; choose one of {', '.join(BACKENDS)}")


BACKENDS = ("confluent", "kafka-python")

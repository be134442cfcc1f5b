"""The pure-Python backend (kafka-python): no native dependency, about a fifth of librdkafka's speed."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from kafka import KafkaConsumer, OffsetAndMetadata
from kafka import TopicPartition as KpTopicPartition

from beamflow.kafka.client import KafkaConsumerClient
from beamflow.kafka.record import KafkaRecord, TopicPartition

__all__ = ["KafkaPythonConsumer"]


class KafkaPythonConsumer(KafkaConsumerClient):
    def __init__(self, bootstrap: str, group_id: str, config: Mapping[str, Any]) -> None:
        settings: dict[str, Any] = {
            "max_partition_fetch_bytes": 4194304,
            "fetch_max_wait_ms": 10,
            **config,
            "bootstrap_servers": bootstrap,
            "group_id": group_id,
            "enable_auto_commit": False,
        }
        settings.setdefault("auto_offset_reset", "earliest")
        self._consumer = KafkaConsumer(**settings)
        self._assigned: dict[TopicPartition, int] = {}

    @staticmethod
    def _tp(tp: TopicPartition) -> KpTopicPartition:
        return KpTopicPartition(tp.topic, tp.partition)

    def assign(self, tp: TopicPartition, offset: int) -> None:
        if tp in self._assigned and self._consumer.position(self._tp(tp)) == offset:
            return  # already reading there; a seek would throw away the fetched records
        self._assigned[tp] = offset
        self._consumer.assign([self._tp(t) for t in self._assigned])
        for t, o in self._assigned.items():
            if t == tp or self._consumer.position(self._tp(t)) is None:
                self._consumer.seek(self._tp(t), o)

    def poll(self, max_records: int, timeout_s: float) -> list[KafkaRecord]:
        batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        out: list[KafkaRecord] = []
        for records in batches.values():
            for r in records:
                out.append(
                    KafkaRecord(
                        topic=r.topic,
                        partition=r.partition,
                        offset=r.offset,
                        timestamp_ms=r.timestamp,
                        key=r.key,
                        value=r.value,
                        headers=tuple((k, v) for k, v in (r.headers or ())),
                    )
                )
        out.sort(key=lambda rec: (rec.topic, rec.partition, rec.offset))
        return out

    def watermarks(self, tp: TopicPartition, timeout_s: float = 10.0) -> tuple[int, int]:
        ktp = self._tp(tp)
        low = self._consumer.beginning_offsets([ktp], timeout_ms=int(timeout_s * 1000))[ktp]
        high = self._consumer.end_offsets([ktp], timeout_ms=int(timeout_s * 1000))[ktp]
        return int(low), int(high)

    def committed(self, tp: TopicPartition, timeout_s: float = 10.0) -> int | None:
        result = self._consumer.committed(self._tp(tp))
        return None if result is None or result < 0 else int(result)

    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        self._consumer.commit({self._tp(tp): OffsetAndMetadata(off, "", -1) for tp, off in offsets.items()})

    def offset_for_time(self, tp: TopicPartition, timestamp_ms: int, timeout_s: float = 10.0) -> int | None:
        ktp = self._tp(tp)
        result = self._consumer.offsets_for_times({ktp: timestamp_ms})
        found = result.get(ktp)
        return None if found is None else int(found.offset)

    def partitions(self, topic: str, timeout_s: float = 10.0) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while True:
            parts = self._consumer.partitions_for_topic(topic)
            if parts:
                return sorted(parts)
            if time.monotonic() > deadline:
                raise RuntimeError(f"topic {topic} not found")
            self._consumer.topics()  # forces a metadata refresh
            time.sleep(0.2)

    def close(self) -> None:
        self._consumer.close(autocommit=False)

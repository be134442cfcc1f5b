"""The Kafka service is a real broker: data in, data out with both clients, data kept across a restart."""

from __future__ import annotations

import uuid

import pytest

from beamflow.kafka.admin import create_topic, end_offsets, produce
from beamflow.kafka.client import BACKENDS, open_consumer
from beamflow.kafka.record import TopicPartition
from beamflow.services import ServiceSet, ServiceState

pytestmark = pytest.mark.services


def _consume_all(backend: str, bootstrap: str, topic: str, partitions: int) -> list[tuple[int, int, bytes]]:
    ends = end_offsets(bootstrap, topic)
    consumer = open_consumer(backend, bootstrap, f"test-{uuid.uuid4().hex[:8]}")
    try:
        for p in range(partitions):
            consumer.assign(TopicPartition(topic, p), 0)
        seen: list[tuple[int, int, bytes]] = []
        target = sum(ends.values())
        for _ in range(600):
            for rec in consumer.poll(5000, 0.5):
                assert rec.value is not None
                seen.append((rec.partition, rec.offset, rec.value))
            if len(seen) >= target:
                break
        return seen
    finally:
        consumer.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_produce_and_consume_10000_records_on_4_partitions(kafka: ServiceState, backend: str) -> None:
    bootstrap = kafka.info["bootstrap"]
    topic = f"svc-{backend}-{uuid.uuid4().hex[:6]}"
    create_topic(bootstrap, topic, 4)
    values = [f"value-{i}".encode() for i in range(10_000)]
    assert produce(bootstrap, topic, ((str(i).encode(), v) for i, v in enumerate(values))) == 10_000
    seen = _consume_all(backend, bootstrap, topic, 4)
    assert sorted(v for _, _, v in seen) == sorted(values)
    assert len({(p, o) for p, o, _ in seen}) == 10_000
    assert {p for p, _, _ in seen} == {0, 1, 2, 3}


def test_broker_keeps_its_data_across_stop_and_start(kafka: ServiceState, service_set: ServiceSet) -> None:
    bootstrap = kafka.info["bootstrap"]
    topic = f"restart-{uuid.uuid4().hex[:6]}"
    create_topic(bootstrap, topic, 2)
    produce(bootstrap, topic, ((None, f"r{i}".encode()) for i in range(500)))
    service = service_set.get("kafka")
    service.down()
    assert not service.status()["running"]
    state = service.up()
    assert state.info["bootstrap"] == bootstrap  # same ports: clients reconnect to the same broker
    seen = _consume_all("confluent", bootstrap, topic, 2)
    assert sorted(v for _, _, v in seen) == sorted(f"r{i}".encode() for i in range(500))

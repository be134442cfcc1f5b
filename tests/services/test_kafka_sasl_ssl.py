"""The local broker's second listener: SASL_SSL with SCRAM-SHA-512, the password given by reference.

Records go in and come back through the secure listener with the client settings the service hands out (the CA it
made, the user, ``sasl.password: file:...`` resolved by ``beamflow.secrets``), through beamflow's consumer (the read
path) as well. The guarantee broken: a wrong password, or plaintext to that port, gets nothing.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from beamflow.kafka.client import open_consumer
from beamflow.kafka.record import TopicPartition
from beamflow.secrets import kafka_client_config
from beamflow.services import ServiceState

pytestmark = pytest.mark.services


def _secure(kafka: ServiceState, **extra: Any) -> dict[str, Any]:
    return {"bootstrap.servers": kafka.info["secure_bootstrap"], **kafka.info["secure_client_config"], **extra}


def test_records_go_through_the_sasl_ssl_listener(kafka: ServiceState) -> None:
    topic = f"secure-{uuid.uuid4().hex[:8]}"
    assert kafka.info["secure_client_config"]["sasl.password"].startswith("file:")
    admin = AdminClient(kafka_client_config(_secure(kafka)))
    for future in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        future.result(timeout=30)
    producer = Producer(kafka_client_config(_secure(kafka)))
    for i in range(3):
        producer.produce(topic, value=f"v{i}".encode())
    assert producer.flush(30) == 0
    consumer = open_consumer(
        "confluent", kafka.info["secure_bootstrap"], f"g-{topic}", kafka.info["secure_client_config"]
    )
    try:
        consumer.assign(TopicPartition(topic, 0), 0)
        values: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(values) < 3 and time.monotonic() < deadline:
            values += [r.value for r in consumer.poll(100, 1.0) if r.value is not None]
        assert values == [b"v0", b"v1", b"v2"]
    finally:
        consumer.close()


def _errors_of(config: dict[str, Any]) -> list[KafkaError]:
    errors: list[KafkaError] = []
    consumer = Consumer({**config, "group.id": "nobody", "error_cb": errors.append})
    try:
        with pytest.raises(Exception):  # noqa: B017 - librdkafka: KafkaException or a timeout, never metadata
            consumer.list_topics(timeout=10)
    finally:
        consumer.close()
    return errors


def test_a_wrong_password_or_plaintext_gets_nothing(kafka: ServiceState) -> None:
    wrong = _errors_of(_secure(kafka, **{"sasl.password": "not-the-password"}))
    assert any(e.code() == KafkaError._AUTHENTICATION for e in wrong), wrong
    assert any("SCRAM-SHA-512" in e.str() and "credentials" in e.str() for e in wrong), wrong
    _errors_of({"bootstrap.servers": kafka.info["secure_bootstrap"], "socket.timeout.ms": 5000})

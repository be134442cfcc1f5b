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


def test_admin_calls_and_the_kafka_dead_letter_sink_go_through_the_sasl_ssl_listener(
    kafka: ServiceState, postgres: ServiceState
) -> None:
    """beamflow's own admin calls and the clicks job's Kafka dead-letter sink, built from a job config whose consumer
    settings name the secure listener's credentials by reference (``sasl.password: file:...``), reach the broker over
    SASL_SSL only: the job config carries no plaintext route (its bootstrap is the secure listener)."""
    import apache_beam as beam

    from beamflow.config import as_job_config
    from beamflow.deadletter import DeadLetter
    from beamflow.kafka.admin import create_topic, end_offsets, produce, topic_partition_count
    from pipelines.common import dead_letter_sink
    from runners.direct import local_options

    secure, client = kafka.info["secure_bootstrap"], kafka.info["secure_client_config"]
    topic = f"secure-{uuid.uuid4().hex[:8]}"
    create_topic(secure, topic, 2, config=client)
    create_topic(secure, f"{topic}-dlq", 1, config=client)
    assert topic_partition_count(secure, topic, config=client) == 2
    assert produce(secure, topic, [(b"k", b"v", {"partition": 1})], config=client) == 1
    assert end_offsets(secure, topic, config=client) == {0: 0, 1: 1}

    job = as_job_config(
        {
            "job": {"name": "secure-dlq"},
            "kafka": {"topic": topic, "group_id": f"g-{topic}", "bootstrap": secure, "consumer_config": client},
            "postgres": {"dsn": postgres.info["dsn"]},
            "dead_letters": {"sink": "kafka"},
        }
    )
    sink = dead_letter_sink(job)
    assert sink.producer_config["sasl.password"].startswith("file:")  # the name travels, not the secret
    letters = [
        DeadLetter(f"bad-{i}".encode(), "decode_avro", "not Confluent wire format", topic, 1, i) for i in range(3)
    ]
    with beam.Pipeline(options=local_options()) as p:
        _ = p | beam.Create(letters) | sink
    assert end_offsets(secure, f"{topic}-dlq", config=client) == {0: 3}

    # The same admin call without the job's settings is refused by the secure listener (no silent fallback).
    with pytest.raises(Exception):  # noqa: B017 - librdkafka: a timeout or transport failure
        topic_partition_count(secure, topic, timeout_s=5)

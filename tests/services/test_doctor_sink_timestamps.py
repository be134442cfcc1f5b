"""``beamflow doctor --kafka`` on a real broker: a backlog older than the Kafka sink topic keeps is flagged.

The rides job stamps its results with their events' times (``kafka_sink.timestamps: event-time``). Its source here
holds records stamped three hours ago, unread by the job's group; the sink topic keeps one hour. Doctor warns
(``sink-timestamps-beyond-retention``: those results would go to dead letters, since Kafka would delete them); it
does not with ``timestamps: producer``, nor once the group has read everything.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from beamflow.kafka.admin import create_topic, produce
from beamflow.services import ServiceState

pytestmark = pytest.mark.services

ROOT = Path(__file__).resolve().parents[2]
CODE = "sink-timestamps-beyond-retention"


def _doctor_codes(bootstrap: str, *settings: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-m", "beamflow", "doctor", "conf/rides.yaml", "--kafka", bootstrap, "--json"]
        + [f"--set={s}" for s in settings],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=180,
        check=False,
    )
    assert result.stdout.strip().startswith("["), result.stdout + result.stderr
    return [f["code"] for f in json.loads(result.stdout)]


def test_doctor_flags_a_backlog_older_than_the_sink_topic_keeps(kafka: ServiceState) -> None:
    bootstrap = kafka.info["bootstrap"]
    source, sink, group = (f"{name}-{uuid.uuid4().hex[:8]}" for name in ("rides", "ride-sessions", "rides-job"))
    create_topic(bootstrap, source, 2)
    three_hours_ago = int(time.time() * 1000) - 3 * 3_600_000
    produce(bootstrap, source, ((b"d1", b"x", {"partition": i % 2, "timestamp_ms": three_hours_ago}) for i in range(4)))
    create_topic(bootstrap, sink, 2, {"retention.ms": "3600000"})
    job = [f"kafka.topic={source}", f"kafka.group_id={group}", f"kafka_sink.topic={sink}"]

    assert CODE in _doctor_codes(bootstrap, *job)
    assert CODE not in _doctor_codes(bootstrap, *job, "kafka_sink.timestamps=producer")

    # The group has read everything: no backlog left to stamp with old times.
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        consumer.commit(offsets=[TopicPartition(source, p, 2) for p in range(2)], asynchronous=False)
    finally:
        consumer.close()
    assert CODE not in _doctor_codes(bootstrap, *job)

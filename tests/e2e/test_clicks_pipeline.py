"""The whole clicks job on the real services, with every kind of generated trouble switched on."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from beamflow.demo import run_demo
from beamflow.generate import TrafficSpec
from beamflow.kafka.admin import end_offsets
from beamflow.kafka.client import open_consumer
from beamflow.kafka.record import TopicPartition
from beamflow.services import ServiceSet, ServiceState

pytestmark = pytest.mark.services

CONF = str(Path(__file__).resolve().parents[2] / "conf" / "clicks.yaml")


def test_every_record_is_accounted_for_exactly_once(
    kafka: ServiceState, postgres: ServiceState, registry: ServiceState, service_set: ServiceSet
) -> None:
    run = uuid.uuid4().hex[:6]
    overrides = (
        f"kafka.topic=clicks-{run}",
        f"kafka.group_id=clicks-{run}",
        f"iceberg.table=beamflow.impressions_{run}",
        f"postgres.sessions_table=sessions_{run}",
        f"postgres.dead_letters_table=dead_{run}",
        f"postgres.quarantine_table=quarantine_{run}",
    )
    spec = TrafficSpec(events=3000, users=300, duplicate_share=0.05, bad_per_kind=4, seed=11)
    summary = run_demo(CONF, overrides, spec, services=service_set, progress=lambda _: None)
    produced = summary.produced_counts
    assert summary.produced == produced["records"] == 3000 + produced["duplicate_sends"] + produced["bad_records"]
    assert summary.read == summary.produced
    assert summary.dead_letters == produced["bad_records"] == 20
    assert summary.quarantined == produced["duplicate_sends"] > 0
    assert summary.iceberg_rows == summary.iceberg_distinct_ids == 3000
    assert summary.iceberg_duplicate_ids == 0
    assert summary.postgres_duplicate_ids == 0
    assert summary.balanced
    assert summary.session_rows > 0
    # Committed after the sinks finished (CommitOffsetsAfter): exactly the end of what was produced.
    topic = f"clicks-{run}"
    ends = end_offsets(kafka.info["bootstrap"], topic)
    client = open_consumer("confluent", kafka.info["bootstrap"], f"clicks-{run}")
    try:
        assert {p: client.committed(TopicPartition(topic, p)) for p in ends} == ends
    finally:
        client.close()

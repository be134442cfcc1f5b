"""The whole rides job (seed 002) on the real services with every kind of generated trouble, audited from the outside:
the result topic by a plain confluent-kafka read_committed consumer, the cell store by its newest cells, the dead
letters by cause, and all of it against what the generated traffic says must come out. Then a replay of everything
(a new consumer group, as after a crash before the offset commit) must leave both sinks exactly as they were."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

import pipelines.rides as rides
from beamflow.config import load_job_config, resolve_auto
from beamflow.generate import RideTrafficSpec
from beamflow.kafka.admin import end_offsets
from beamflow.kafka.client import open_consumer
from beamflow.kafka.record import TopicPartition
from beamflow.services import ServiceSet, ServiceState
from pipelines.rides_demo import audit_cells, audit_results, dead_letters_by_cause, run_demo

pytestmark = pytest.mark.services

CONF = str(Path(__file__).resolve().parents[2] / "conf" / "rides.yaml")


def test_every_ride_is_in_one_result_once_or_accounted_for(
    kafka: ServiceState, postgres: ServiceState, registry: ServiceState, service_set: ServiceSet
) -> None:
    run = uuid.uuid4().hex[:6]
    overrides = (
        f"kafka.topic=rides-{run}",
        f"kafka.group_id=rides-{run}",
        f"registry.subject=rides-{run}-value",
        f"postgres.dead_letters_table=ride_dead_{run}",
        f"postgres.quarantine_table=ride_dups_{run}",
        f"lookups.drivers.table=drivers_{run}",
        f"lookups.zones.table=zones_{run}",
        f"kafka_sink.topic=ride-sessions-{run}",
        f"kafka_sink.sink_group=ride-sessions-{run}",
        f"kafka_sink.ledger_table=ride_ledger_{run}",
        f"cells.table=ride_cells_{run}",
    )
    spec = RideTrafficSpec(
        events=3000,
        users=200,
        zones=30,
        duplicate_share=0.05,
        late_share=0.03,
        too_late_share=0.01,
        unknown_driver_share=0.02,
        unknown_zone_share=0.03,
        bad_per_kind=4,
        seed=12,
    )
    # Two batches, the job run after each (the second reads only the second batch: offsets committed after the sinks).
    summary = run_demo(CONF, overrides, spec, services=service_set, progress=lambda _: None, runs=2)
    produced, expected = summary.produced_counts, summary.expected
    assert summary.produced == produced["records"] == 3000 + produced["duplicate_sends"] + produced["bad_records"]
    assert summary.read == summary.produced
    # Every kind of trouble was there.
    for kind in ("duplicate_sends", "late_events", "too_late_events", "unknown_driver_events", "unknown_zone_events"):
        assert produced[kind] > 0, kind
    # Duplicates quarantined; bad records, unknown drivers (policy dead_letter) and too-late rides dead-lettered,
    # exactly those; unknown zones (policy pass) in the sessions with null zone columns, exactly those.
    assert summary.quarantined == produced["duplicate_sends"]
    assert produced["bad_records"] == 40
    assert summary.dead_letters == {
        "undecodable": 40,
        "unknown_driver": expected["unknown_driver_rides"],
        "too_late": expected["too_late_rides"],
    }
    assert expected["unknown_driver_rides"] == produced["unknown_driver_events"]
    assert summary.topic.unknown_zone_rides == summary.cells.unknown_zone_rides == expected["unknown_zone_rides"] > 0
    # Each result once in the topic (read_committed), each ride in one result, in the topic and in the cells.
    assert summary.topic.results == summary.topic.distinct_ids == len(expected["sessions"])
    assert summary.topic.rides == summary.topic.distinct_rides == expected["session_rides"]
    assert summary.cells.results == len(expected["sessions"])
    assert summary.cells.rides == summary.cells.distinct_rides == expected["session_rides"]
    assert summary.topic.sessions == summary.cells.sessions == expected["sessions"]
    assert summary.balanced and summary.ok
    assert summary.produced == expected["session_rides"] + summary.dead_total + summary.quarantined

    # Offsets committed after the sinks: exactly the end of what was produced.
    topic = f"rides-{run}"
    ends = end_offsets(kafka.info["bootstrap"], topic)
    client = open_consumer("confluent", kafka.info["bootstrap"], f"rides-{run}")
    try:
        assert {p: client.committed(TopicPartition(topic, p)) for p in ends} == ends
    finally:
        client.close()

    # A replay of the whole topic by a new group into the same sinks (fresh dedup, quarantine and dead-letter
    # tables, so every ride reaches the sinks again): the ledger skips every result, the cells are idempotent.
    before_topic, before_cells = summary.topic, summary.cells
    replay = (
        *overrides,
        f"kafka.group_id=rides-{run}-replay",
        f"postgres.dead_letters_table=ride_dead_{run}_replay",
        f"postgres.quarantine_table=ride_dups_{run}_replay",
    )
    config = resolve_auto(rides.for_runner(load_job_config(CONF, replay), "DirectRunner"), service_set)
    rides.run_with_config(config)
    after_topic, after_cells = audit_results(config), audit_cells(config)
    # The replay's single run sees sessions spanning both batches' rides only where the batches were two gaps
    # apart: none. So its results are the same results, and none is written twice.
    assert after_topic == before_topic and after_cells == before_cells
    assert dead_letters_by_cause(config) == summary.dead_letters

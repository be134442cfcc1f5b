"""The whole clicks job on the real services, with every kind of generated trouble switched on, run twice on continuing
traffic (as bounded runs are repeated in practice) and audited against one run over everything on fresh tables."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.runners.runner import PipelineResult
from psycopg import sql

import pipelines.clicks as clicks
from beamflow.config import load_config, resolve_auto
from beamflow.generate import TrafficSpec
from beamflow.kafka.admin import end_offsets
from beamflow.kafka.client import open_consumer
from beamflow.kafka.record import TopicPartition
from beamflow.services import ServiceSet, ServiceState
from pipelines.clicks_demo import audit_job, run_demo
from pipelines.common import ProcessesResult, RunsResult

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
    # Two batches of 1,500 events, the second's event time continuing a minute after the first's (its late events
    # reach back into the first batch's sessions); the job runs after each.
    summary = run_demo(CONF, overrides, spec, services=service_set, progress=lambda _: None, runs=2)
    produced = summary.produced_counts
    assert summary.produced == produced["records"] == 3000 + produced["duplicate_sends"] + produced["bad_records"]
    assert summary.read == summary.produced
    assert summary.dead_letters == produced["bad_records"] == 40
    assert summary.quarantined == produced["duplicate_sends"] > 0
    assert summary.iceberg_rows == summary.iceberg_distinct_ids == 3000
    assert summary.iceberg_duplicate_ids == 0
    assert summary.postgres_duplicate_ids == 0
    assert summary.balanced
    assert summary.session_rows > 0
    # Sessions across the two runs = the sessions of one pass over every distinct event (computed from the traffic).
    assert summary.sessions_match
    assert summary.session_rows == summary.expected_sessions
    assert summary.session_events == summary.iceberg_distinct_ids == 3000
    # Committed after the sinks finished (CommitOffsetsAfter): exactly the end of what was produced.
    topic = f"clicks-{run}"
    ends = end_offsets(kafka.info["bootstrap"], topic)
    client = open_consumer("confluent", kafka.info["bootstrap"], f"clicks-{run}")
    try:
        assert {p: client.committed(TopicPartition(topic, p)) for p in ends} == ends
    finally:
        client.close()

    # And the same as one run of the job over everything on fresh tables (a new group reads the topic from the start):
    # row for row, and the same events counted (the sessions' events ledger).
    fresh = (
        *overrides[:1],
        f"kafka.group_id=clicks-{run}-once",
        f"iceberg.table=beamflow.impressions_{run}_once",
        f"postgres.sessions_table=sessions_{run}_once",
        f"postgres.dead_letters_table=dead_{run}_once",
        f"postgres.quarantine_table=quarantine_{run}_once",
    )
    config = load_config(CONF, fresh)
    config.pop("flink", None)  # the local runner's job: no Flink endpoint to resolve
    config = resolve_auto(config, service_set)
    clicks.run_with_config(config)
    assert _sessions(postgres.info["dsn"], f"sessions_{run}") == _sessions(postgres.info["dsn"], f"sessions_{run}_once")

    # And in pieces (kafka.run_records_per_partition: the local runner's bound on its memory): runs of at most 300
    # records per partition, one after the other on fresh tables, write what the one run wrote.
    once = audit_job(resolve_auto(_without_flink(load_config(CONF, fresh)), service_set))
    result, config = _run_variant(fresh, "pieces", ["kafka.run_records_per_partition=300"], service_set)
    assert isinstance(result, RunsResult)
    assert len(result.results) == -(-max(ends.values()) // 300)  # the largest partition's records, 300 a run
    _assert_as_once(result, config, summary.produced, ends, once, postgres.info["dsn"], run, "pieces")

    # And split over two processes (kafka.local_processes), each reading its own partitions in pieces of 300 records,
    # both writing the same tables at once: the same rows again. A process that read a partition it does not own
    # would send its records a second time through the dedup (quarantined twice, an audit that differs).
    split = ["kafka.run_records_per_partition=300", "kafka.local_processes=2", "kafka.local_process_records=1"]
    result, config = _run_variant(fresh, "split", split, service_set)
    assert isinstance(result, ProcessesResult)
    assert [o.state for o in result.outcomes] == ["DONE", "DONE"]
    _assert_as_once(result, config, summary.produced, ends, once, postgres.info["dsn"], run, "split")


def _run_variant(
    fresh: tuple[str, ...], name: str, extra: list[str], service_set: ServiceSet
) -> tuple[PipelineResult, dict[str, Any]]:
    """The job over the same topic on fresh tables and group (``fresh`` with ``_once`` renamed ``_<name>``)."""
    overrides = tuple(o.replace("_once", f"_{name}").replace("-once", f"-{name}") for o in fresh)
    config = resolve_auto(_without_flink(load_config(CONF, (*overrides, *extra))), service_set)
    return clicks.run_with_config(config), config


def _assert_as_once(
    result: PipelineResult,
    config: dict[str, Any],
    produced: int,
    ends: dict[int, int],
    once: dict[str, Any],
    dsn: str,
    run: str,
    name: str,
) -> None:
    """Every record read once (all runs' metrics summed), the group committed to the end, and the same sinks, sessions
    and events ledger as the one run over everything."""
    counters = result.metrics().query(MetricsFilter().with_name("records_read"))["counters"]
    assert sum(c.committed or 0 for c in counters) == produced
    topic = config["kafka"]["topic"]
    client = open_consumer("confluent", config["kafka"]["bootstrap"], config["kafka"]["group_id"])
    try:
        assert {p: client.committed(TopicPartition(topic, p)) for p in ends} == ends
    finally:
        client.close()
    assert audit_job(config) == once
    assert _sessions(dsn, f"sessions_{run}_{name}") == _sessions(dsn, f"sessions_{run}_once")


def _without_flink(config: dict[str, Any]) -> dict[str, Any]:
    config.pop("flink", None)
    return config


def _sessions(dsn: str, table: str) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    """The session rows, and the Kafka coordinates their events ledger holds (which events the counts are of)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            sql.SQL(
                "SELECT user_id, session_start, session_end, impressions, clicks, first_event, last_event, events, "
                "pane_index, is_final FROM {} ORDER BY user_id, session_start"
            ).format(sql.Identifier(table))
        ).fetchall()
        ledger = conn.execute(
            sql.SQL("SELECT kafka_partition, kafka_offset, user_id FROM {} ORDER BY 1, 2").format(
                sql.Identifier(f"{table}_events")
            )
        ).fetchall()
        return rows, ledger

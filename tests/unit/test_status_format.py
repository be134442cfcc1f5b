"""``beamflow status`` formatting and Flink metric-id parsing (no services)."""

from __future__ import annotations

import dataclasses

import pytest

from beamflow.cli.status import JobStatus, _metric_name, format_status

pytestmark = pytest.mark.unit


def test_beam_metric_names_are_cut_out_of_flink_metric_ids() -> None:
    assert _metric_name("0.[13]{ReadClicks__DecodeAvro}.beamflow_kafka_records_read") == "beamflow_kafka_records_read"
    assert _metric_name("1.Source: Impulse -> [4]a.b.beamflow_kafka_committed_offset.t/0") == (
        "beamflow_kafka_committed_offset.t/0"
    )
    assert _metric_name("0.[13]{ReadClicks}.numRecordsIn") is None


def test_table_shows_metrics_late_drops_lag_and_checkpoints() -> None:
    status = JobStatus(
        job_id="abc",
        name="clicks",
        state="RUNNING",
        metrics={
            "beamflow_kafka_records_read": 1578.0,
            "beamflow_deduplicate_duplicates": 68.0,
            "beamflow_hot_key_aggregate_input_elements": 100.0,
            "beamflow_hot_key_aggregate_aggregated_elements": 97.0,
            "beamflow_something_new": 5.0,
        },
        checkpoints={"completed": 7, "failed": 1, "in_progress": 0, "restored": 1, "latest_id": 9,
                     "latest_age_s": 1.5, "latest_duration_ms": 120, "latest_size_bytes": 2048},
        kafka_lag={0: 3, 1: 0},
    )  # fmt: skip
    text = format_status(status)
    assert "records read from Kafka" in text and "1,578" in text
    assert "duplicates quarantined" in text
    assert status.late_dropped == 3
    # After a failover the two stages' counters restart at different points: unknown, never a negative count.
    restarted = dataclasses.replace(
        status, metrics={**status.metrics, "beamflow_hot_key_aggregate_input_elements": 50.0}
    )
    assert restarted.late_dropped is None and "dropped as too late" not in format_status(restarted)
    assert "beamflow_something_new" in text  # unknown metrics are listed, not dropped
    assert "7 / 1 / 0" in text and "#9" in text
    assert "not advanced (-inf)" in text
    assert "partition 0" in text


def test_table_says_why_a_running_job_shows_no_beam_metric() -> None:
    gap = "the JobManager holds no Beam metric of this running job (...): Read (RUNNING): 0 metric ids"
    status = JobStatus(job_id="abc", name="clicks", state="RUNNING", metrics={}, metrics_gap=gap,
                       checkpoints={"completed": 0, "failed": 0, "in_progress": 0, "restored": 0})  # fmt: skip
    text = format_status(status)
    assert "no Beam metric" in text and "0 metric ids" in text
    assert "no Beam metric" not in format_status(dataclasses.replace(status, metrics_gap=None))

"""Each of doctor's static rules on its own: the settings that make it speak, and the same config without them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from beamflow.config import JobConfig, load_job_config
from beamflow.doctor import RULES, Job, rule_code

pytestmark = pytest.mark.unit

CONF = Path(__file__).resolve().parents[2] / "conf" / "clicks.yaml"
NO_FLINK = ["flink=null"]
BATCH = "flink.streaming=false"  # the backlog-stall rules apply to Flink streams only

# rule code -> (overrides that make it speak, overrides of the same config that keep it quiet, severity)
CASES: dict[str, tuple[list[str], list[str], str]] = {
    "no-flink-section": (NO_FLINK, [], "info"),
    "parallelism-above-partitions": (["flink.parallelism=8"], ["flink.parallelism=4"], "warning"),
    "partitions-uneven-over-readers": (["flink.parallelism=3"], ["flink.parallelism=2"], "info"),
    "checkpointing-off": (["flink.checkpointing_interval_ms=null"], [], "error"),
    "checkpoint-timeout-far-above-interval": (["flink.checkpoint_timeout_ms=1800000"], [], "warning"),
    "no-min-pause": (["flink.min_pause_between_checkpoints_ms=null"], [], "warning"),
    "min-pause-below-commit-round": (["flink.min_pause_between_checkpoints_ms=500"], [], "warning"),
    "non-incremental-state": (["flink.incremental=false"], [], "warning"),
    "rocksdb-manifest-grows": (
        ["flink.rocksdb_max_manifest_bytes=null"],
        ["flink.rocksdb_max_manifest_bytes=8192"],
        "warning",
    ),
    "heap-state-for-sessions": (["flink.state_backend=hashmap"], [], "info"),
    "aligned-checkpoints-under-backpressure": (["flink.unaligned_checkpoints=null"], [], "info"),
    "offsets-ahead-of-sinks": (["flink.finish_bundle_before_checkpointing=false"], [], "error"),
    "timed-flush-cuts-elements": (
        ["flink.experiments=[data_buffer_time_limit_ms=20]"],
        ["flink.experiments=[data_buffer_size_limit=65536, data_buffer_time_limit_ms=0]"],
        "error",
    ),
    "bundle-swallows-backlog": (["flink.max_bundle_size=100000"], ["flink.max_bundle_size=100000", BATCH], "error"),
    "read-call-swallows-backlog": (["kafka.max_bundle_records=20000"], [], "warning"),
    "read-polls-too-rarely": (["flink.max_bundle_time_ms=10000"], [], "warning"),
    "loopback-workers": (["flink.environment=LOOPBACK"], [], "warning"),
    "per-event-state-round-trips": (["dedup.strategy=state"], ["dedup.strategy=state", BATCH], "warning"),
    "no-tolerated-checkpoint-failures": (
        ["flink.tolerable_failed_checkpoints=null"],
        ["flink.tolerable_failed_checkpoints=null", "flink.fail_on_checkpointing_errors=false"],
        "warning",
    ),
    "iceberg-commit-per-bundle": ([], ["flink.max_bundle_time_ms=10000"], "info"),
    "known-keys-bound-small": (["iceberg.known_keys_max=1000"], ["iceberg.known_keys_max=100000"], "warning"),
    "kafka-auto-commit": (
        ["kafka.consumer_config={enable.auto.commit: 'true'}"],
        ["kafka.consumer_config={fetch.min.bytes: 1}"],
        "error",
    ),
    "consumer-fetch-spins": (
        ["kafka.consumer_config={fetch.queue.backoff.ms: 0}"],
        ["kafka.consumer_config={fetch.queue.backoff.ms: 5}"],
        "warning",
    ),
    "local-processes-beyond-cores": (["kafka.local_processes=4096"], ["kafka.local_processes=1"], "warning"),
    "split-run-with-runner-state-dedup": (
        ["dedup.strategy=grouped"],
        ["dedup.strategy=grouped", "kafka.local_processes=1"],
        "warning",
    ),
    "idleness-off": (["kafka.idle_timeout_ms=null"], [], "warning"),
    "no-stable-sink-id": (["iceberg.sink_id=null"], [], "error"),
    "unstable-sink-id": (["iceberg.sink_id=clicks-run-20261129"], [], "error"),
    "inline-password": (
        ["postgres.dsn=postgresql://app:s3cret@db.internal:5432/beamflow"],
        ["postgres.dsn=postgresql://app@db.internal:5432/beamflow?password=env:PGPASSWORD"],
        "warning",
    ),
    "plaintext-kafka": (
        ["kafka.bootstrap=kafka-1.internal:9092,kafka-2.internal:9092"],
        [
            "kafka.bootstrap=kafka-1.internal:9093",
            "kafka.consumer_config={security.protocol: SASL_SSL, sasl.password: 'env:KAFKA_PASSWORD'}",
        ],
        "warning",
    ),
}


def _job(overrides: list[str]) -> Job:
    config: JobConfig = load_job_config(CONF, overrides)
    return Job(config, config.kafka.partitions if config.kafka else None)


def test_every_rule_has_a_case_and_is_named_after_its_code() -> None:
    assert [rule_code(r) for r in RULES] == list(CASES)  # report order is the list's order


@pytest.mark.parametrize("rule", RULES, ids=rule_code)
def test_rule(rule: Any) -> None:
    speak, quiet, severity = CASES[rule_code(rule)]
    finding = rule(_job(speak))
    assert finding is not None and finding.code == rule_code(rule) and finding.severity == severity
    assert finding.why and finding.fix
    assert rule(_job(quiet)) is None

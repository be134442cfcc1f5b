"""beamflow doctor finds the seeds' misconfigurations, and stays quiet on the shipped config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from beamflow.config import apply_overrides, load_config
from beamflow.doctor import check_config, check_record_gaps, check_sink_timestamps, check_unstable_names

pytestmark = pytest.mark.unit

CONF = Path(__file__).resolve().parents[2] / "conf" / "clicks.yaml"


def _codes(config: dict[str, Any], partitions: int | None = None) -> set[str]:
    return {f.code for f in check_config(config, partitions)}


def test_shipped_config_has_no_errors_or_warnings() -> None:
    findings = check_config(load_config(CONF))
    assert [f for f in findings if f.severity in ("error", "warning")] == []


def test_seed_000_parallelism_above_partitions() -> None:
    config = load_config(CONF, ["flink.parallelism=96"])
    assert "parallelism-above-partitions" in _codes(config, partitions=48)
    assert "parallelism-above-partitions" not in _codes(config, partitions=96)


def test_seed_002_timeout_raised_to_30_minutes_and_full_snapshots() -> None:
    config = load_config(
        CONF,
        [
            "flink.checkpointing_interval_ms=300000",
            "flink.checkpoint_timeout_ms=1800000",
            "flink.min_pause_between_checkpoints_ms=0",
            "flink.incremental=false",
            "flink.state_backend=rocksdb",
        ],
    )
    codes = _codes(config)
    assert {"checkpoint-timeout-far-above-interval", "no-min-pause", "non-incremental-state"} <= codes
    # With the 5-minute checkpoint interval, the shipped 1 s bundles commit Iceberg far more often than that.
    assert "iceberg-commit-per-bundle" in codes


def test_issue_13_settings_that_bring_the_backlog_stall_back() -> None:
    shipped = _codes(load_config(CONF))
    stall = {
        "bundle-swallows-backlog",
        "read-call-swallows-backlog",
        "read-polls-too-rarely",
        "loopback-workers",
        "per-event-state-round-trips",
        "no-tolerated-checkpoint-failures",
    }
    assert not stall & shipped
    # What the first wave shipped: 100,000-element / 10 s bundles, 20,000 records per read call, LOOPBACK at
    # parallelism 2, per-key dedup state, no tolerated checkpoint failure.
    before = load_config(
        CONF,
        [
            "flink.max_bundle_size=100000",
            "flink.max_bundle_time_ms=10000",
            "kafka.max_bundle_records=20000",
            "flink.environment=LOOPBACK",
            "dedup.strategy=state",
            "flink.tolerable_failed_checkpoints=null",
        ],
    )
    findings = {f.code: f for f in check_config(before)}
    assert stall <= set(findings)
    assert findings["bundle-swallows-backlog"].severity == "error"
    assert findings["loopback-workers"].severity == "warning"  # parallelism 2 in one interpreter


def test_bundles_left_open_across_checkpoints_let_offsets_run_ahead_of_the_sinks() -> None:
    assert "offsets-ahead-of-sinks" not in _codes(load_config(CONF))
    findings = {f.code: f for f in check_config(load_config(CONF, ["flink.finish_bundle_before_checkpointing=false"]))}
    assert findings["offsets-ahead-of-sinks"].severity == "error"
    assert "min-pause-below-commit-round" in _codes(load_config(CONF, ["flink.min_pause_between_checkpoints_ms=500"]))


def test_source_and_sink_traps() -> None:
    config = apply_overrides(
        load_config(CONF),
        ["kafka.consumer_config.enable.auto.commit=true", "kafka.idle_timeout_ms=null", "iceberg.sink_id=run-20261129"],
    )
    # the override path splits on dots, so set the Kafka property explicitly
    config["kafka"]["consumer_config"] = {"enable.auto.commit": "true"}
    findings = {f.code: f for f in check_config(config)}
    assert findings["kafka-auto-commit"].severity == "error"
    assert "idleness-off" in findings
    assert findings["unstable-sink-id"].severity == "error"
    config["flink"] = {}
    assert "checkpointing-off" not in _codes(config)  # an empty section is "no Flink"
    config["flink"] = {"parallelism": 2}
    assert "checkpointing-off" in _codes(config)


def test_idle_timeout_against_the_normal_gap() -> None:
    assert check_record_gaps({0: 1000, 1: 90_000}, idle_timeout_ms=60_000)[0].code == "idleness-shorter-than-gap"
    assert check_record_gaps({0: 1000, 1: 50_000}, idle_timeout_ms=60_000) == []


def test_generated_transform_labels_are_flagged() -> None:
    assert check_unstable_names(["ReadClicks", "Map(<lambda at clicks.py:12>)"])[0].code == "unstable-operator-names"
    assert check_unstable_names(["ReadClicks", "WriteSessions"]) == []


def test_clicks_pipeline_labels_are_all_stable() -> None:
    import pipelines.clicks as clicks
    from beamflow.doctor import pipeline_labels

    config = load_config(CONF)
    labels = pipeline_labels(lambda p: clicks.build_pipeline(p, config))
    assert "ReadClicks" in labels and "WriteSessions" in labels
    assert check_unstable_names(labels) == []


def test_a_cluster_without_the_sdf_residual_fix_is_flagged() -> None:
    from beamflow.doctor import check_flink_classpath

    lib = "/opt/flink/lib/"
    runner = lib + "beam-runners-flink-1.19-2.62.0.jar"
    fix = lib + "0-beamflow-sdf-residuals.jar"
    unpatched = check_flink_classpath([lib + "flink-dist-1.19.3.jar", runner], 4)
    assert [(f.code, f.severity) for f in unpatched] == [("sdf-residual-state-grows", "warning")]
    assert "1,843 MB a day at 4 partitions" in unpatched[0].message
    assert "missing" in unpatched[0].message
    behind = check_flink_classpath([runner, fix], 4)
    assert [f.code for f in behind] == ["sdf-residual-state-grows"] and "comes after" in behind[0].message
    assert check_flink_classpath([fix, runner], 4) == []
    assert check_flink_classpath([lib + "flink-dist-1.19.3.jar"], 4) == []  # Beam shipped by the job: not seen here


def test_a_rocksdb_cluster_without_a_manifest_bound_is_flagged() -> None:
    from beamflow.doctor import check_flink_state_config

    rocksdb = {"state.backend.type": "rocksdb", "state.backend.incremental": "true"}
    unbounded = check_flink_state_config(rocksdb, 10_000)
    assert [(f.code, f.severity) for f in unbounded] == [("rocksdb-manifest-grows", "warning")]
    assert "about 12 MB a day" in unbounded[0].message  # 1.4 KB x 8,640 checkpoints
    bounded = {**rocksdb, "state.backend.rocksdb.options-factory": "beamflow.flink.BoundedManifestOptionsFactory"}
    assert check_flink_state_config(bounded, 10_000) == []
    assert check_flink_state_config({"state.backend.type": "hashmap"}, 10_000) == []


def test_sink_timestamps_beyond_the_sink_topics_retention_are_flagged() -> None:
    hour = 3_600_000
    now = 1_800_000_000_000
    keeps_a_day = {
        "max.message.bytes": "1048588",  # as the broker describes every topic
        "message.timestamp.type": "CreateTime",
        "retention.ms": str(24 * hour),
        "cleanup.policy": "delete",
    }

    def codes(settings: dict[str, str], timestamps: str, backlog_age: int | None) -> list[str]:
        oldest = None if backlog_age is None else now - backlog_age
        return [f.code for f in check_sink_timestamps("out", settings, timestamps, oldest, now)]

    assert codes(keeps_a_day, "event-time", 48 * hour) == ["sink-timestamps-beyond-retention"]
    assert codes(keeps_a_day, "event-time", 2 * hour) == []  # the backlog is younger than the retention
    assert codes(keeps_a_day, "event-time", None) == []  # nothing left to read
    assert codes(keeps_a_day, "producer", 48 * hour) == []  # stamped when written
    assert codes({**keeps_a_day, "retention.ms": "-1"}, "event-time", 48 * hour) == []
    assert codes({**keeps_a_day, "cleanup.policy": "compact"}, "event-time", 48 * hour) == []
    assert codes({**keeps_a_day, "message.timestamp.type": "LogAppendTime"}, "event-time", 48 * hour) == []

"""The typed job configuration (beamflow/config.py): conf/*.yaml as frozen dataclasses, unknown keys refused by name
with the nearest valid one, typed overrides, and how the clicks job's configuration meets each runner."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from beamflow.config import (
    ConfigError,
    FlinkConfig,
    JobConfig,
    auto_services,
    load_config,
    load_job_config,
    resolve_auto,
)
from beamflow.services import ServiceSet
from pipelines.clicks import for_runner
from pipelines.common import reads_in_one_run
from runners.flink import _KNOWN
from transforms.commit_offsets_after import CommitOffsetsAfter

pytestmark = pytest.mark.unit

CONF = Path(__file__).resolve().parents[2] / "conf" / "clicks.yaml"


def test_the_shipped_conf_loads_into_frozen_sections_with_the_files_values() -> None:
    config = load_job_config(CONF)
    assert config.kafka is not None and config.kafka.topic == "clicks" and config.kafka.max_bundle_records == 5000
    assert config.flink is not None and config.flink.parallelism == 2  # from flink.yaml (extends)
    assert config.sessions.hot_keys == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.kafka.topic = "other"  # type: ignore[misc]
    # The dict form and the typed form are the same configuration, both ways.
    assert JobConfig.from_dict(config.to_dict()) == config
    assert JobConfig.from_dict(load_config(CONF)) == config


def test_an_unknown_key_is_refused_with_its_name_and_the_nearest_valid_one() -> None:
    with pytest.raises(ConfigError, match=r"kafka\.partiton: unknown key; did you mean 'partitions'\?"):
        load_job_config(CONF, ["kafka.partiton=8"])
    with pytest.raises(ConfigError, match=r"flink\.checkpoint_intervall_ms: unknown key; did you mean"):
        load_job_config(CONF, ["flink.checkpoint_intervall_ms=5000"])
    with pytest.raises(ConfigError, match=r"sesions: unknown section; did you mean 'sessions'\?"):
        load_job_config(CONF, ["sesions.gap_s=60"])
    with pytest.raises(ConfigError, match=r"kafka\.partiton"):
        load_config(CONF, ["kafka.partiton=8"])  # the dict form is validated the same way


def test_overrides_are_typed() -> None:
    config = load_job_config(CONF, ["kafka.partitions=8", "sessions.hot_keys=[u1, u2]", "job.name=123"])
    assert config.kafka is not None and config.kafka.partitions == 8
    assert config.sessions.hot_keys == ("u1", "u2")
    assert config.job.name == "123"
    with pytest.raises(ConfigError, match=r"kafka\.partitions must be an integer, got 'eight'"):
        load_job_config(CONF, ["kafka.partitions=eight"])
    with pytest.raises(ConfigError, match=r"kafka\.bounded must be true or false"):
        load_job_config(CONF, ["kafka.bounded=maybe"])
    with pytest.raises(ConfigError, match=r"kafka\.topic is required"):
        JobConfig.from_dict({"kafka": {"group_id": "g"}})


def test_defaults_live_in_the_dataclasses() -> None:
    config = JobConfig.from_dict({"kafka": {"topic": "t", "group_id": "g"}, "postgres": {"quarantine_table": "q"}})
    assert config.kafka is not None and config.kafka.bootstrap == "auto" and config.kafka.idle_timeout_ms is None
    assert config.postgres is not None and config.postgres.first_copies == "q_first_copies"
    assert config.dedup.strategy == "auto" and config.sessions.gap_s == 600
    assert config.flink is None and JobConfig.from_dict({"flink": {}}).flink is None  # an empty section is no Flink


def test_every_flink_key_goes_somewhere_in_runners_flink() -> None:
    assert {f.name for f in dataclasses.fields(FlinkConfig)} == _KNOWN


def test_resolve_auto_starts_nothing_and_names_the_command(tmp_path: Path) -> None:
    config = load_job_config(CONF)
    assert auto_services(config) == ["kafka", "postgres", "registry", "flink"]
    assert auto_services(for_runner(config, "DirectRunner")) == ["kafka", "postgres", "registry"]
    services = ServiceSet(data=tmp_path / "data", cache=tmp_path / "cache")
    with pytest.raises(ConfigError, match=r"kafka\.bootstrap is auto .* `beamflow services up kafka`"):
        resolve_auto(config, services)
    assert not (tmp_path / "data" / "kafka").exists()  # nothing was installed or started
    explicit = load_job_config(
        CONF,
        [
            "kafka.bootstrap=127.0.0.1:9",
            "registry.url=http://127.0.0.1:9",
            "postgres.dsn=postgresql://x@127.0.0.1:9/x",
        ],
    )
    resolved = resolve_auto(for_runner(explicit, "DirectRunner"), services)
    assert resolved.iceberg is not None and resolved.iceberg.catalog.uri.startswith("sqlite:///")


def test_a_streaming_flink_run_reads_the_topic_as_a_stream() -> None:
    assert load_config(CONF)["kafka"]["bounded"] is True  # the local demo's bounded run
    streaming = for_runner(load_job_config(CONF), "FlinkRunner")
    assert streaming.kafka is not None and streaming.kafka.bounded is False
    batch = for_runner(load_job_config(CONF, ["flink.streaming=false"]), "FlinkRunner")
    assert batch.kafka is not None and batch.kafka.bounded is True
    local = for_runner(load_job_config(CONF), "DirectRunner")
    assert local.kafka is not None and local.kafka.bounded is True and local.flink is None


def test_only_the_local_runner_runs_in_pieces() -> None:
    # A Flink job, stream or batch, reads to the end in one job: the cap would stop a batch job early.
    local = for_runner(load_job_config(CONF), "DirectRunner")
    assert local.kafka is not None and local.kafka.run_records_per_partition == 50_000
    for flink in ([], ["flink.streaming=false"]):
        job = for_runner(load_job_config(CONF, flink), "FlinkRunner")
        assert job.kafka is not None and job.kafka.run_records_per_partition is None
    # run_with_config(runner="FlinkRunner") applies the same, for callers that skip for_runner.
    one = reads_in_one_run(load_job_config(CONF))
    assert one.kafka is not None and one.kafka.run_records_per_partition is None


def test_commit_after_sinks_refuses_a_streaming_pipeline() -> None:
    p = beam.Pipeline(options=PipelineOptions(["--streaming"]))
    records = p | beam.Create([1])
    with pytest.raises(ValueError, match="batch pipeline"):
        records | CommitOffsetsAfter("127.0.0.1:1", "g", after=[records])

"""How the clicks job's configuration meets each runner, and the batch-only commit after the sinks."""

from __future__ import annotations

from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from beamflow.config import load_config
from pipelines.clicks import for_runner
from transforms.commit_offsets_after import CommitOffsetsAfter

pytestmark = pytest.mark.unit

CONF = Path(__file__).resolve().parents[2] / "conf" / "clicks.yaml"


def test_a_streaming_flink_run_reads_the_topic_as_a_stream() -> None:
    assert load_config(CONF)["kafka"]["bounded"] is True  # the local demo's bounded run
    assert for_runner(load_config(CONF), "FlinkRunner")["kafka"]["bounded"] is False
    batch = for_runner(load_config(CONF, ["flink.streaming=false"]), "FlinkRunner")
    assert batch["kafka"]["bounded"] is True
    local = for_runner(load_config(CONF), "DirectRunner")
    assert local["kafka"]["bounded"] is True and "flink" not in local


def test_commit_after_sinks_refuses_a_streaming_pipeline() -> None:
    p = beam.Pipeline(options=PipelineOptions(["--streaming"]))
    records = p | beam.Create([1])
    with pytest.raises(ValueError, match="batch pipeline"):
        records | CommitOffsetsAfter("127.0.0.1:1", "g", after=[records])

"""A bounded read's offsets are committed only after the sinks finished (CommitOffsetsAfter), on the local runner."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import apache_beam as beam
import pytest

from beamflow.kafka.admin import create_topic, end_offsets, produce
from beamflow.kafka.client import open_consumer
from beamflow.kafka.record import TopicPartition
from beamflow.services import ServiceState
from runners.direct import local_options
from transforms.commit_offsets_after import CommitOffsetsAfter
from transforms.read_from_kafka import ReadFromKafka, StopPolicy

pytestmark = pytest.mark.services


class SinkFailure(RuntimeError):
    pass


def _committed(bootstrap: str, group: str, topic: str) -> dict[int, int | None]:
    client = open_consumer("confluent", bootstrap, group)
    try:
        return {p: client.committed(TopicPartition(topic, p)) for p in range(2)}
    finally:
        client.close()


def _sink(fail: bool) -> Callable[[tuple[int, list[int]]], int]:
    def write(batch: tuple[int, list[int]]) -> int:
        if fail:
            raise SinkFailure("the sink failed after the read's stage had finished")
        return len(batch[1])

    return write


def _run(bootstrap: str, topic: str, group: str, after_sinks: bool, fail: bool) -> None:
    with beam.Pipeline(options=local_options()) as p:
        records = p | ReadFromKafka(
            bootstrap, [topic], group, stop=StopPolicy(at_end_offsets=True), commit_offsets=not after_sinks
        )
        # A shuffle puts the sink in a later stage than the read, as every real sink stage is.
        written = (
            records | beam.Map(lambda r: (r.partition, r.offset)) | beam.GroupByKey() | "Sink" >> beam.Map(_sink(fail))
        )
        if after_sinks:
            records | CommitOffsetsAfter(bootstrap, group, after=[written])


def _topic_with_records(kafka: ServiceState) -> tuple[str, str, dict[int, int]]:
    bootstrap = kafka.info["bootstrap"]
    topic = f"after-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic, 2)
    produce(bootstrap, topic, ((None, f"v{i}".encode(), {"partition": i % 2}) for i in range(500)))
    return bootstrap, topic, end_offsets(bootstrap, topic)


def test_a_failed_sink_leaves_the_offsets_where_they_were(kafka: ServiceState) -> None:
    bootstrap, topic, ends = _topic_with_records(kafka)
    group = f"g-{uuid.uuid4().hex[:6]}"
    with pytest.raises(Exception, match="the sink failed"):
        _run(bootstrap, topic, group, after_sinks=True, fail=True)
    assert _committed(bootstrap, group, topic) == {0: None, 1: None}

    _run(bootstrap, topic, group, after_sinks=True, fail=False)
    assert _committed(bootstrap, group, topic) == ends


def test_finalizer_commits_of_a_bounded_read_run_ahead_of_a_failed_sink(kafka: ServiceState) -> None:
    """Why clicks commits bounded runs after its sinks: the local runner finalizes the read before the sinks run."""
    bootstrap, topic, ends = _topic_with_records(kafka)
    group = f"g-{uuid.uuid4().hex[:6]}"
    with pytest.raises(Exception, match="the sink failed"):
        _run(bootstrap, topic, group, after_sinks=False, fail=True)
    assert _committed(bootstrap, group, topic) == ends  # committed, yet no sink holds a record


def test_needs_sinks_to_wait_for() -> None:
    with pytest.raises(ValueError, match="after"):
        CommitOffsetsAfter("127.0.0.1:1", "g", after=[])

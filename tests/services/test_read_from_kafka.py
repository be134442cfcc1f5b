"""ReadFromKafka against the real broker on the pinned local runner (FnApiRunner, one worker)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import apache_beam as beam
import pytest
from apache_beam.testing.util import assert_that, equal_to

from beamflow.kafka.admin import add_partitions, create_topic, end_offsets, produce
from beamflow.kafka.client import BACKENDS, open_consumer
from beamflow.kafka.record import KafkaRecord, TopicPartition
from beamflow.services import ServiceState
from runners.direct import local_options
from transforms.read_from_kafka import ReadFromKafka, StopPolicy

pytestmark = pytest.mark.services


def _topic(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _committed(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int | None]:
    client = open_consumer("confluent", bootstrap, group)
    try:
        return {p: client.committed(TopicPartition(topic, p)) for p in range(partitions)}
    finally:
        client.close()


def _coords(r: KafkaRecord) -> tuple[int, int, bytes | None]:
    return (r.partition, r.offset, r.value)


def _run(read: ReadFromKafka, check: Callable[[Any], None] | None = None, mid: Any = None) -> None:
    with beam.Pipeline(options=local_options()) as p:
        records = p | read
        if mid is not None:
            records = records | "Downstream" >> beam.Map(mid)
        if check is not None:
            check(records)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounded_read_emits_exactly_the_produced_set_and_commits_end_offsets(kafka: ServiceState, backend: str) -> None:
    bootstrap = kafka.info["bootstrap"]
    topic, group = _topic("read"), _topic("group")
    create_topic(bootstrap, topic, 4)
    produce(bootstrap, topic, ((str(i).encode(), f"v{i}".encode()) for i in range(20_000)))
    ends = end_offsets(bootstrap, topic)
    expected: list[tuple[int, int, bytes | None]] = []
    client = open_consumer("confluent", bootstrap, _topic("probe"))
    for p in range(4):
        client.assign(TopicPartition(topic, p), 0)
    while len(expected) < 20_000:
        expected.extend(_coords(r) for r in client.poll(5000, 1.0))
    client.close()

    _run(
        ReadFromKafka(bootstrap, [topic], group, backend=backend, stop=StopPolicy(at_end_offsets=True)),
        check=lambda pc: assert_that(pc | beam.Map(_coords), equal_to(expected)),
    )
    assert _committed(bootstrap, group, topic, 4) == ends


def test_failure_before_finalization_does_not_commit_and_rerun_completes(kafka: ServiceState, tmp_path: Path) -> None:
    bootstrap = kafka.info["bootstrap"]
    topic, group = _topic("fail"), _topic("group")
    create_topic(bootstrap, topic, 2)
    produce(bootstrap, topic, ((None, f"v{i}".encode(), {"partition": i % 2}) for i in range(2_000)))
    ends = end_offsets(bootstrap, topic)
    handled_log = tmp_path / "handled"  # offsets the downstream step handled (a file: the DoFn is pickled)

    def explode(record: KafkaRecord) -> KafkaRecord:
        if record.partition == 1 and record.offset == 500:
            raise RuntimeError("downstream failure before finalization")
        with handled_log.open("a") as out:
            out.write(f"{record.partition}:{record.offset}\n")
        return record

    # Small bundles: the bundles before the failing one finalize (and commit) first.
    read = ReadFromKafka(bootstrap, [topic], group, stop=StopPolicy(at_end_offsets=True), max_bundle_records=100)
    with pytest.raises(Exception, match="downstream failure"):
        _run(read, mid=explode)
    after_failure = _committed(bootstrap, group, topic, 2)
    handled = {tuple(map(int, line.split(":"))) for line in handled_log.read_text().split()}
    # Committed offsets follow processing: every offset below a committed one went through the downstream step, and
    # partition 1 is never committed past the record whose bundle failed.
    assert any(after_failure.values()), after_failure  # bundles before the failure did finalize
    for partition, committed in after_failure.items():
        assert {(partition, o) for o in range(committed or 0)} <= handled
    assert (after_failure[1] or 0) <= 500

    # The rerun starts from whatever was committed and, together with what was committed, covers everything.
    start = {p: after_failure[p] or 0 for p in (0, 1)}
    expected = [(p, o) for p in (0, 1) for o in range(start[p], ends[p])]
    _run(
        ReadFromKafka(bootstrap, [topic], group, stop=StopPolicy(at_end_offsets=True)),
        check=lambda pc: assert_that(pc | beam.Map(lambda r: (r.partition, r.offset)), equal_to(expected)),
    )
    assert _committed(bootstrap, group, topic, 2) == ends


@pytest.mark.parametrize("backend", BACKENDS)
def test_odd_records_come_through_as_bytes(kafka: ServiceState, backend: str) -> None:
    bootstrap = kafka.info["bootstrap"]
    topic = _topic("odd")
    create_topic(bootstrap, topic, 1)
    big = bytes(range(256)) * 7000  # ~1.8 MB, near the broker's 2 MB maximum
    records = [
        (None, b"null key"),
        (b"k-empty", b""),
        (b"\xff\xfe\x00not-utf8", b"binary key"),
        (b"big", big),
        (b"tomb", None),
    ]
    produce(bootstrap, topic, records, config={"message.max.bytes": 2_000_000})
    expected = [(k, v) for k, v in records]
    _run(
        ReadFromKafka(
            bootstrap,
            [topic],
            _topic("g"),
            backend=backend,
            stop=StopPolicy(at_end_offsets=True),
            consumer_config={"fetch_max_bytes": 4_000_000} if backend == "kafka-python" else None,
        ),
        check=lambda pc: assert_that(pc | beam.Map(lambda r: (r.key, r.value)), equal_to(expected)),
    )


def test_a_partition_added_while_reading_is_read(kafka: ServiceState) -> None:
    bootstrap = kafka.info["bootstrap"]
    topic = _topic("grow")
    create_topic(bootstrap, topic, 2)
    produce(bootstrap, topic, ((None, f"old{i}".encode(), {"partition": i % 2}) for i in range(100)))

    def grow() -> None:
        time.sleep(2)
        add_partitions(bootstrap, topic, 3)
        produce(bootstrap, topic, ((None, f"new{i}".encode(), {"partition": 2}) for i in range(50)))

    grower = threading.Thread(target=grow)
    grower.start()
    expected = [f"old{i}".encode() for i in range(100)] + [f"new{i}".encode() for i in range(50)]
    try:
        _run(
            ReadFromKafka(
                bootstrap,
                [topic],
                _topic("g"),
                stop=StopPolicy(until_ms=int(time.time() * 1000) + 8_000),
                partition_poll_interval_s=0.5,
            ),
            check=lambda pc: assert_that(pc | beam.Map(lambda r: r.value), equal_to(expected)),
        )
    finally:
        grower.join()


def test_per_partition_metrics_report_records_and_lag(kafka: ServiceState) -> None:
    from apache_beam.metrics.metric import MetricsFilter

    bootstrap = kafka.info["bootstrap"]
    topic = _topic("metrics")
    create_topic(bootstrap, topic, 2)
    produce(bootstrap, topic, ((None, f"v{i}".encode(), {"partition": i % 2}) for i in range(300)))
    p = beam.Pipeline(options=local_options())
    _ = p | ReadFromKafka(bootstrap, [topic], _topic("g"), stop=StopPolicy(at_end_offsets=True))
    result = p.run()
    result.wait_until_finish()
    metrics = result.metrics()
    per_partition = {
        r.key.metric.name: r.committed
        for r in metrics.query(MetricsFilter().with_namespace("beamflow.kafka"))["counters"]
        if r.key.metric.name.startswith("records_read.")
    }
    assert per_partition == {f"records_read.{topic}-0": 150, f"records_read.{topic}-1": 150}
    lags = {
        r.key.metric.name: r.committed.value
        for r in metrics.query(MetricsFilter().with_namespace("beamflow.kafka"))["gauges"]
        if r.key.metric.name.startswith("lag.")
    }
    assert lags == {f"lag.{topic}-0": 0, f"lag.{topic}-1": 0}  # read to the end

"""The read transform's parts that need no broker: the duplicate-reader guard and the idle-aware watermark."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
from apache_beam.coders import FastPrimitivesCoder
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.pipeline import PipelineVisitor

from beamflow.kafka.guard import DuplicateReaderError, exclusive_reader
from beamflow.kafka.record import TopicPartition
from beamflow.kafka.watermark import MIN_WATERMARK_MS, PartitionWatermark

pytestmark = pytest.mark.unit


def test_a_second_live_reader_of_a_partition_is_refused() -> None:
    entered = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []

    def first() -> None:
        with exclusive_reader("b", "g", "t", 0):
            entered.set()
            release.wait(10)

    holder = threading.Thread(target=first)
    holder.start()
    assert entered.wait(10)
    try:
        with pytest.raises(DuplicateReaderError, match="t-0 of group g"), exclusive_reader("b", "g", "t", 0):
            pass
        # Another partition, another group or another cluster is not a duplicate.
        for args in (("b", "g", "t", 1), ("b", "g2", "t", 0), ("b2", "g", "t", 0)):
            with exclusive_reader(*args):
                pass
    except BaseException as exc:  # pragma: no cover - re-raised below after cleanup
        errors.append(exc)
    finally:
        release.set()
        holder.join()
    assert not errors
    with exclusive_reader("b", "g", "t", 0):  # released when the first reader finished
        pass


def test_watermark_trails_records_and_never_moves_back() -> None:
    wm = PartitionWatermark(max_delay_ms=1000, idle_timeout_ms=None)
    assert wm.watermark_ms == MIN_WATERMARK_MS
    assert wm.observe_record(10_000, now_ms=0) is False
    assert wm.watermark_ms == 9_000
    assert wm.observe_record(8_000, now_ms=1) is True  # older than the published watermark: late, counted
    assert wm.watermark_ms == 9_000
    assert wm.observe_caught_up(now_ms=10**9) is False  # idleness off: a silent partition holds the watermark
    assert wm.watermark_ms == 9_000


def test_idle_partition_advances_to_now_minus_delay_even_without_any_record() -> None:
    wm = PartitionWatermark(max_delay_ms=5_000, idle_timeout_ms=60_000)
    assert wm.observe_caught_up(now_ms=1_000_000) is False  # idle clock starts
    assert wm.watermark_ms == MIN_WATERMARK_MS
    assert wm.observe_caught_up(now_ms=1_059_999) is False
    assert wm.observe_caught_up(now_ms=1_060_000) is True
    assert wm.watermark_ms == 1_055_000
    # A record after the idle stretch restarts the clock; an older record is late.
    assert wm.observe_record(1_000_000, now_ms=1_070_000) is True
    assert wm.observe_caught_up(now_ms=1_080_000) is False
    # State round-trips through the runner's checkpoint as a tuple.
    restored = PartitionWatermark(5_000, 60_000, *wm.as_state())
    assert restored == wm


def test_streaming_commits_wait_one_finalization_round() -> None:
    """Round k's offsets are committed only when round k+1 begins (a later checkpoint completed)."""
    from beamflow.kafka.commits import RoundDelayedCommits

    now = [0.0]
    committed: list[tuple[int, int]] = []
    rounds = RoundDelayedCommits(lambda tp, off: committed.append((tp.partition, off)), 1.0, clock=lambda: now[0])
    p0, p1 = TopicPartition("t", 0), TopicPartition("t", 1)
    # Round 1 (checkpoint 1 completed): three bundles of partition 0, one of partition 1, a few ms apart.
    for off in (10, 20, 30):
        assert rounds.finalized(p0, off) is None
        now[0] += 0.01
    rounds.finalized(p1, 5)
    assert committed == []  # bundles finished after checkpoint 1's barrier may be among them: nothing yet
    now[0] += 3.0  # round 2: checkpoint 2 completed, so everything finalized in round 1 is in the sinks
    assert rounds.finalized(p0, 45) == 30
    assert rounds.finalized(p1, 9) == 5
    now[0] += 0.2
    assert rounds.finalized(p0, 50) is None  # same round
    now[0] += 3.0
    assert rounds.finalized(p0, 60) == 50
    assert committed == [(0, 30), (1, 5), (0, 50)]


def _subtasks(spread: Any, descriptors: list[TopicPartition]) -> list[int]:
    return [spread.subtask_of(d) for d in descriptors]


def test_a_flink_job_spreads_partitions_round_robin_over_the_read_subtasks() -> None:
    """Without the salt, the runner's key hash decides: for this topic (the one of a measured p2 run) it put
    partitions 0, 1 and 3 on one subtask. With it, each subtask reads two."""
    from transforms.read_from_kafka import _ReaderSpread

    topic = "drill-fsp2_8dafb7"
    spread = _ReaderSpread.for_options(PipelineOptions(["--runner=FlinkRunner", "--parallelism=2"]))
    assert spread == _ReaderSpread(parallelism=2, max_parallelism=128)
    plain = _subtasks(spread, [TopicPartition(topic, p) for p in range(4)])
    assert sorted(Counter(plain).values()) == [1, 3]
    routed = [spread.descriptor(topic, p) for p in range(4)]
    assert [(d.topic, d.partition) for d in routed] == [(topic, p) for p in range(4)]
    placed = _subtasks(spread, routed)
    assert Counter(placed) == {0: 2, 1: 2}
    assert placed[0] != placed[1] and placed[0] == placed[2]  # round robin
    three = _ReaderSpread(parallelism=3, max_parallelism=256)
    assert sorted(Counter(_subtasks(three, [three.descriptor("t", p) for p in range(9)])).values()) == [3, 3, 3]


def test_spread_only_on_flink_at_parallelism_two_or_more() -> None:
    from transforms.read_from_kafka import _ReaderSpread

    assert _ReaderSpread.for_options(PipelineOptions(["--runner=DirectRunner", "--parallelism=2"])) is None
    assert _ReaderSpread.for_options(PipelineOptions(["--runner=FlinkRunner", "--parallelism=1"])) is None
    explicit = _ReaderSpread.for_options(
        PipelineOptions(["--runner=FlinkRunner", "--parallelism=4", "--max_parallelism=64"])
    )
    assert explicit == _ReaderSpread(parallelism=4, max_parallelism=64)
    # A job submitted to a Flink job server with the PortableRunner: Flink's --parallelism says where it runs.
    portable = ["--runner=PortableRunner", "--job_endpoint=127.0.0.1:8099"]
    assert _ReaderSpread.for_options(PipelineOptions([*portable, "--parallelism=2"])) == _ReaderSpread(2, 128)
    assert _ReaderSpread.for_options(PipelineOptions(portable)) is None


def test_the_reads_input_is_encoded_by_the_coder_the_spread_assumes() -> None:
    """The spread hashes ``FastPrimitivesCoder`` bytes: that is the coder of the read's input PCollection."""
    import apache_beam as beam

    from transforms.read_from_kafka import ReadFromKafka

    pipeline = beam.Pipeline(options=PipelineOptions(["--runner=FlinkRunner", "--parallelism=2", "--streaming"]))
    pipeline | ReadFromKafka("127.0.0.1:1", ["t"], group_id="g")
    inputs = [
        applied.inputs[0]
        for applied in _applied_transforms(pipeline)
        if applied.full_label.endswith("ReadPartitions") and applied.inputs
    ]
    assert inputs, "no ReadPartitions step found"
    assert isinstance(beam.coders.registry.get_coder(inputs[0].element_type), FastPrimitivesCoder)


def _applied_transforms(pipeline: Any) -> list[Any]:
    found: list[Any] = []

    class Visitor(PipelineVisitor):
        def visit_transform(self, node: Any) -> None:
            found.append(node)

        def enter_composite_transform(self, node: Any) -> None:
            found.append(node)

    pipeline.visit(Visitor())
    return found

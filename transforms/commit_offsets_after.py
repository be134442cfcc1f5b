"""``CommitOffsetsAfter``: a bounded Kafka read's offsets, committed only once the sinks have finished writing.

Why: a runner finalizes a bundle once it holds the bundle's output, not once later stages have consumed it. The
pinned local runner (FnApiRunner) runs stage after stage, so a bounded read's finalizers commit the group's offsets
before the sinks' stages even start; a crash in a sink stage would then leave the group past records no sink holds,
and a rerun would skip them. This transform commits after the sinks instead: each sink's output PCollection becomes
a side input of the commit, and a runner computes a side input completely before the step that reads it.

The commit is one request for every partition read (the highest offsets gathered into one element first), so a crash
or failure at commit time leaves the group either where it was for every partition or past the whole run: never
some partitions committed and others not, which a rerun would read as a run cut in two.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.transforms.window import GlobalWindows
from apache_beam.utils.timestamp import MIN_TIMESTAMP
from apache_beam.utils.windowed_value import WindowedValue

from beamflow.kafka.client import open_consumer
from beamflow.kafka.commits import ForwardOnlyCommitter
from beamflow.kafka.record import KafkaRecord, TopicPartition
from transforms._global_window import in_global_window
from transforms._run_mode import is_streaming
from transforms.sink_base import SinkResult

__all__ = ["CommitOffsetsAfter"]


class _HighestPerBundle(beam.DoFn):
    """((topic, partition), highest offset) of each partition in a bundle: one output per partition, not per record.

    In the global window, whatever windows the records came in: the commit waits for every record of the read.
    """

    def start_bundle(self) -> None:
        self._highest: dict[tuple[str, int], int] = {}

    def process(self, record: KafkaRecord) -> Iterator[WindowedValue]:
        partition = (record.topic, record.partition)
        if record.offset > self._highest.get(partition, -1):
            self._highest[partition] = record.offset
        yield from ()  # outputs come from finish_bundle; a generator keeps Beam from warning about a missing iterator

    def finish_bundle(self) -> Iterator[WindowedValue]:
        for partition, offset in self._highest.items():
            yield in_global_window((partition, offset), MIN_TIMESTAMP)


def _nothing(_: Any) -> tuple[()]:
    return ()


class _HighestOffsets(beam.CombineFn):
    """((topic, partition), offset) pairs -> {(topic, partition): highest offset}: every partition in one element."""

    def create_accumulator(self) -> dict[tuple[str, int], int]:
        return {}

    def add_input(self, highest: dict[tuple[str, int], int], position: tuple[tuple[str, int], int]) -> Any:
        partition, offset = position
        if offset > highest.get(partition, -1):
            highest[partition] = offset
        return highest

    def merge_accumulators(self, accumulators: Iterable[dict[tuple[str, int], int]]) -> dict[tuple[str, int], int]:
        merged: dict[tuple[str, int], int] = {}
        for highest in accumulators:
            for partition, offset in highest.items():
                if offset > merged.get(partition, -1):
                    merged[partition] = offset
        return merged

    def extract_output(self, highest: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
        return highest


class _CommitFn(beam.DoFn):
    def __init__(self, bootstrap: str, group_id: str, backend: str) -> None:
        self._bootstrap = bootstrap
        self._group_id = group_id
        self._backend = backend

    def setup(self) -> None:
        # One client per worker, not one per partition.
        self._consumer = open_consumer(self._backend, self._bootstrap, self._group_id)
        self._committer = ForwardOnlyCommitter(self._consumer)

    def teardown(self) -> None:
        self._consumer.close()

    def process(self, highest: Mapping[tuple[str, int], int], *sinks_done: Iterable[int]) -> Iterator[None]:
        # One request for every partition of the run: all of them committed, or none.
        committed = self._committer.commit_all({TopicPartition(t, p): last + 1 for (t, p), last in highest.items()})
        for tp, offset in committed.items():
            Metrics.gauge("beamflow.kafka", f"committed_offset.{tp.topic}-{tp.partition}").set(offset)
        yield from ()  # outputs nothing; a generator keeps Beam from warning about a missing iterator


class CommitOffsetsAfter(beam.PTransform):
    """Commits the highest offset read per partition (+1) to the group, after every PCollection in ``after``.

    Guarantee: the group's committed offsets never run ahead of what the sinks hold, on any runner, for bounded
    reads: the commit step reads each of ``after`` as a side input, so it runs only when those are complete. All
    partitions are committed in one request (``ForwardOnlyCommitter.commit_all``): a run is committed whole or not at
    all. Pass
    every sink's ``SinkResult`` (or the outputs of the last step of every sink; an empty PCollection still counts as
    complete). Commits only forward. Read with ``ReadFromKafka(..., commit_offsets=False)`` so the read's
    own finalizers do not commit earlier.

    Example::

        import apache_beam as beam
        from beamflow.postgres.table import TableSpec
        from runners.direct import local_options
        from transforms import CommitOffsetsAfter, ReadFromKafka, StopPolicy, WriteToPostgres

        offsets = TableSpec("example_offsets", key=("kafka_partition", "kafka_offset"),
                            columns={"kafka_partition": "integer", "kafka_offset": "bigint"})
        with beam.Pipeline(options=local_options()) as p:
            records = p | ReadFromKafka("127.0.0.1:9092", ["clicks"], "clicks-job", commit_offsets=False,
                                        stop=StopPolicy(at_end_offsets=True))
            rows = records | beam.Map(lambda r: {"kafka_partition": r.partition, "kafka_offset": r.offset})
            written = rows | WriteToPostgres("postgresql://postgres@127.0.0.1:5432/beamflow", offsets, create=True)
            records | CommitOffsetsAfter("127.0.0.1:9092", "clicks-job", after=[written])

    Needs: bounded input in a batch pipeline (on unbounded input a global side input never completes, and a
    streaming Flink job cannot checkpoint the side-input steps; streaming reads commit on finalization instead).
    """

    def __init__(
        self,
        bootstrap: str,
        group_id: str,
        after: Sequence[beam.PCollection | SinkResult],
        backend: str = "confluent",
    ):
        super().__init__()
        if not after:
            raise ValueError("CommitOffsetsAfter needs the sinks' outputs to wait for (after=[...])")
        self._bootstrap = bootstrap
        self._group_id = group_id
        # A SinkResult waits for both of its outputs.
        self._after = [pc for out in after for pc in (out if isinstance(out, SinkResult) else (out,))]
        self._backend = backend

    def expand(self, records: beam.PCollection) -> beam.PCollection:
        if not records.is_bounded:
            raise ValueError("CommitOffsetsAfter needs a bounded read; a streaming read commits on finalization")
        if is_streaming(records):
            # Beam 2.62's Flink runner declines checkpoints of the side-input steps this needs (ClassCastException
            # in the snapshot), so a streaming job would fail over forever; its read commits on finalization instead.
            raise ValueError(
                "CommitOffsetsAfter needs a batch pipeline (not --streaming); streaming reads commit on finalization"
            )
        positions = (
            records
            | "HighestPerBundle" >> beam.ParDo(_HighestPerBundle())
            # Every partition's highest offset in ONE element, so the commit is one request for the whole run.
            | "HighestPerPartition" >> beam.CombineGlobally(_HighestOffsets())
        )
        # Only each sink output's completion matters, not its elements: an empty PCollection fused into the sink's
        # last stage, in the global window whatever windows the sink's output had (session windows cannot be side
        # inputs). A side input is complete only when the stage producing it is, even when it holds nothing.
        done = [
            beam.pvalue.AsList(
                pc
                | f"SinkFinished{i}" >> beam.FlatMap(_nothing)
                | f"SinkFinishedGlobal{i}" >> beam.WindowInto(GlobalWindows())
            )
            for i, pc in enumerate(self._after)
        ]
        return positions | "Commit" >> beam.ParDo(_CommitFn(self._bootstrap, self._group_id, self._backend), *done)

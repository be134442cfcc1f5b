"""A deliberately broken clicks job, for the drill that shows the holdings check can fail (issue 15).

The streaming read commits each finalized bundle's offsets at once, without ``RoundDelayedCommits``' one-round delay.
Beam's portable Flink runner finalizes every bundle finished so far when a checkpoint completes, including read
bundles that ran after that checkpoint's barrier, whose records are still on their way to the sinks: this variant
therefore commits offsets the sinks do not hold yet, which the drills' holdings check must catch.

Its Iceberg sink also holds each commit for ``SINK_DELAY_S``. Without that, on a quiet machine the records read after
a barrier reach the sinks within a fraction of a second of the early commit, and a sampler sees the commit ahead only
by luck (13 of 248 samples ahead in one loaded run, none in a quiet CI-shaped run). The delay stands for a slow sink (a
loaded machine, a slow catalog), which is when the early commit loses data on a crash; it makes the window the broken
read opens as long as the delay, whatever the machine's load. The holdings check itself is unchanged, and
``tests.flink.slow_sink_clicks`` (the same slow sink, the correct read) is the control it must pass.

Run exactly like ``python -m pipelines.clicks``: ``python -m tests.flink.broken_clicks --runner=FlinkRunner ...``.
The broken DoFn lives in this importable module (the project root is on the Python workers' path), so it travels to
the TaskManagers' workers by reference; nothing in ``transforms`` or ``conf`` can switch it on.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from beamflow.kafka.record import TopicPartition
from tests.flink.slow_sink_clicks import use_slow_sink
from transforms import read_from_kafka

__all__ = ["CommitOnFinalizeReadFn", "main"]


class CommitOnFinalizeReadFn(read_from_kafka._UnboundedReadPartitionFn):
    """The streaming read, minus the round delay: commits in the finalizer what the bundle read."""

    def _finalized(self, tp: TopicPartition, next_offset: int) -> None:
        self._commit(tp, next_offset)


def main(argv: Sequence[str] | None = None) -> int:
    from pipelines.clicks import main as clicks_main

    # ReadFromKafka.expand looks its DoFn class up in its module when the pipeline is built.
    read_from_kafka._UnboundedReadPartitionFn = CommitOnFinalizeReadFn  # type: ignore[misc]
    use_slow_sink()
    return clicks_main(argv)


if __name__ == "__main__":
    # The importable module's class, not this __main__ copy's, so workers unpickle it by reference.
    from tests.flink.broken_clicks import main as _main

    sys.exit(_main())

"""A deliberately broken clicks job, for the drill that shows the holdings check can fail (issue 15).

The streaming read commits each finalized bundle's offsets at once, without ``RoundDelayedCommits``' one-round delay.
Beam's portable Flink runner finalizes every bundle finished so far when a checkpoint completes, including read
bundles that ran after that checkpoint's barrier, whose records are still on their way to the sinks: this variant
therefore commits offsets the sinks do not hold yet, which the drills' holdings check must catch.

Run exactly like ``python -m pipelines.clicks``: ``python -m tests.flink.broken_clicks --runner=FlinkRunner ...``.
The broken DoFn lives in this importable module (the project root is on the Python workers' path), so it travels to
the TaskManagers' workers by reference; nothing in ``transforms`` or ``conf`` can switch it on.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from beamflow.kafka.record import TopicPartition
from transforms import read_from_kafka

__all__ = ["CommitOnFinalizeReadFn", "main"]


class CommitOnFinalizeReadFn(read_from_kafka._UnboundedReadPartitionFn):
    """The streaming read, minus the round delay: commits in the finalizer what the bundle read."""

    def _finalized(self, tp: TopicPartition, next_offset: int) -> None:
        self._commit(tp, next_offset)


def main(argv: Sequence[str] | None = None) -> int:
    from pipelines.clicks import main as clicks_main

    # ReadFromKafka.expand looks the streaming DoFn class up in its module when the pipeline is built.
    read_from_kafka._UnboundedReadPartitionFn = CommitOnFinalizeReadFn  # type: ignore[misc]
    return clicks_main(argv)


if __name__ == "__main__":
    # The importable module's class, not this __main__ copy's, so workers unpickle it by reference.
    from tests.flink.broken_clicks import main as _main

    sys.exit(_main())

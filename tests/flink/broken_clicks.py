"""A deliberately broken clicks job, for the drill that shows the holdings check can fail (issue 15).

The streaming read commits each read call's offsets as soon as the call returns: before the bundle is durable and
before its records have gone downstream, which is what a consumer with ``enable.auto.commit`` does. Every such commit
runs ahead of the sinks until the records reach them, so the drills' holdings check must catch it, whatever the
machine's timing.

Why not the subtler bug this variant first had (committing in the bundle finalizer without ``RoundDelayedCommits``'
one-round delay): its early commits showed only in the bursts after a fault, in 4 to 18 of about 230 samples on a
good day and in none once the Python workers' bundle ends got faster (the 20 ms state sampler, ``runners/
worker_settings.py``), so a check resting on it could pass without proving anything. The round delay's own logic is
tested in ``tests/unit/test_kafka_reader_parts.py``.

Its Iceberg sink also holds each commit for ``SINK_DELAY_S`` (a slow sink: a loaded machine, a slow catalog), so the
window an early commit opens is at least that long; ``tests.flink.slow_sink_clicks`` (the same slow sink, the
correct read) is the control the check must pass.

Run exactly like ``python -m pipelines.clicks``: ``python -m tests.flink.broken_clicks --runner=FlinkRunner ...``.
The broken DoFn lives in this importable module (the project root is on the Python workers' path), so it travels to
the TaskManagers' workers by reference; nothing in ``transforms`` or ``conf`` can switch it on.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from beamflow.kafka.record import TopicPartition
from tests.flink.slow_sink_clicks import use_slow_sink
from transforms import read_from_kafka

__all__ = ["CommitOnReadFn", "main"]


class _CallAtOnce:
    """Stands in for Beam's bundle finalizer: runs what is registered immediately instead of after a checkpoint."""

    def register(self, callback: Callable[[], Any]) -> None:
        callback()


class CommitOnReadFn(read_from_kafka._UnboundedReadPartitionFn):
    """The streaming read, committing each call's offsets when the call returns (no finalization, no round delay)."""

    def _read(self, tp: TopicPartition, bundle_finalizer: Any, tracker: Any, watermark_estimator: Any) -> Iterator[Any]:
        yield from super()._read(tp, _CallAtOnce(), tracker, watermark_estimator)

    def _finalized(self, tp: TopicPartition, next_offset: int) -> None:
        self._commit(tp, next_offset)


def main(argv: Sequence[str] | None = None) -> int:
    from pipelines.clicks import main as clicks_main

    # ReadFromKafka.expand looks its DoFn class up in its module when the pipeline is built.
    read_from_kafka._UnboundedReadPartitionFn = CommitOnReadFn  # type: ignore[misc]
    use_slow_sink()
    return clicks_main(argv)


if __name__ == "__main__":
    # The importable module's class, not this __main__ copy's, so workers unpickle it by reference.
    from tests.flink.broken_clicks import main as _main

    sys.exit(_main())

"""The clicks job with a slow Iceberg sink and the correct read: the control of the holdings check (issue 15).

``tests.flink.broken_clicks`` commits offsets without the round delay *and* holds each Iceberg commit for
``SINK_DELAY_S``; the drills' holdings check must catch it. This variant keeps the sink just as slow but reads
correctly, so the check must stay clean on it: together they show the check fails because of the early commit, not
because of the slow sink.

Run exactly like ``python -m pipelines.clicks``: ``python -m tests.flink.slow_sink_clicks --runner=FlinkRunner ...``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from transforms import write_to_iceberg

__all__ = ["SINK_DELAY_S", "SlowIcebergCommitFn", "main"]

# A slow sink (a loaded machine, a slow catalog): long enough that an early commit stays visible to a 0.5 s sampler.
SINK_DELAY_S = 2.0


class SlowIcebergCommitFn(write_to_iceberg._CommitPerBundle):
    """The streaming Iceberg sink, holding each commit for ``SINK_DELAY_S`` first (a slow sink)."""

    def flush(self) -> list[Any]:
        if self._staged:
            time.sleep(SINK_DELAY_S)
        return super().flush()


def use_slow_sink() -> None:
    # WriteToIceberg.expand looks its DoFn class up in its module when the pipeline is built.
    write_to_iceberg._CommitPerBundle = SlowIcebergCommitFn  # type: ignore[misc]


def main(argv: Sequence[str] | None = None) -> int:
    from pipelines.clicks import main as clicks_main

    use_slow_sink()
    return clicks_main(argv)


if __name__ == "__main__":
    # The importable module's class, not this __main__ copy's, so workers unpickle it by reference.
    from tests.flink.slow_sink_clicks import main as _main

    sys.exit(_main())

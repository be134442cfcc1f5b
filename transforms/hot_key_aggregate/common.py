"""What every strategy shares: the result row, the counting CombineFn wrapper, stable hashing, the late-data count."""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from apache_beam.metrics.metric import MetricResults, MetricsFilter
from apache_beam.transforms.core import CombineFn
from apache_beam.transforms.window import (
    TimestampedValue,
)
from apache_beam.utils.timestamp import Timestamp

__all__ = ["METRICS_NAMESPACE", "WindowedAggregate", "late_dropped"]

METRICS_NAMESPACE = "beamflow.hot_key_aggregate"


@dataclass(frozen=True)
class WindowedAggregate:
    """One pane of one key's aggregate in one window.

    ``pane_index`` is Beam's pane index for the (key, window): a later pane replaces an earlier one, so a versioned
    upsert sink keyed by (key, window_start, window_end) with version ``pane_index`` keeps the newest. Panes are
    accumulating: each carries the whole aggregate so far. ``input_count`` is how many inputs it covers.
    With Sessions, a late event can merge sessions into a wider one; ``supersedes`` then lists the earlier
    (start, end) windows of this key that the row replaces (the sink should delete them), and the pane index of the
    merged window starts again at 0 (Beam does not carry pane indexes across merges).
    """

    key: Any
    window_start: Timestamp
    window_end: Timestamp
    value: Any
    input_count: int
    pane_index: int
    is_first: bool
    is_last: bool
    timing: str
    supersedes: tuple[tuple[Timestamp, Timestamp], ...] = ()


def _stable_hash(value: Any) -> int:
    """A hash that is the same in every process and run (Python's ``hash`` of str is salted per process)."""
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, str):
        data = value.encode("utf-8")
    else:
        data = repr(value).encode("utf-8")
    return zlib.crc32(data)


class _CountingCombineFn(CombineFn):
    """Wraps a CombineFn: accumulator (inner accumulator, number of inputs).

    ``stage="direct"`` adds inputs and extracts (output, count); ``"partial"`` adds inputs and extracts the
    accumulator itself (stage 1 of the hot path); ``"final"`` takes partial accumulators, or None for the
    session-extent markers, merges them and extracts (output, count) (stage 2).
    """

    def __init__(self, inner: CombineFn, stage: str) -> None:
        self.inner = inner
        self.stage = stage

    def setup(self, *args: Any, **kwargs: Any) -> None:
        self.inner.setup(*args, **kwargs)

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        self.inner.teardown(*args, **kwargs)

    def create_accumulator(self) -> tuple[Any, int]:
        return self.inner.create_accumulator(), 0

    def add_input(self, accumulator: tuple[Any, int], element: Any) -> tuple[Any, int]:
        if self.stage == "final":
            if element is None:
                return accumulator
            return self.merge_accumulators([accumulator, element])
        inner, n = accumulator
        return self.inner.add_input(inner, element), n + 1

    def add_inputs(self, accumulator: tuple[Any, int], elements: Iterable[Any]) -> tuple[Any, int]:
        """Many inputs at once through the inner fn's ``add_inputs`` (which a fn may do faster than one by one)."""
        if self.stage == "final":
            return super().add_inputs(accumulator, elements)  # Beam's: add_input one by one
        values = list(elements)
        inner, n = accumulator
        return self.inner.add_inputs(inner, values), n + len(values)

    def merge_accumulators(self, accumulators: Iterable[tuple[Any, int]]) -> tuple[Any, int]:
        inners, total = [], 0
        for inner, n in accumulators:
            inners.append(inner)
            total += n
        return self.inner.merge_accumulators(inners), total

    def compact(self, accumulator: tuple[Any, int]) -> tuple[Any, int]:
        inner, n = accumulator
        return self.inner.compact(inner), n

    def extract_output(self, accumulator: tuple[Any, int]) -> Any:
        if self.stage == "partial":
            return accumulator
        inner, n = accumulator
        return self.inner.extract_output(inner), n


def _session_row(key: Any, start_micros: int, end_micros: int, value: Any, count: int, timing: str) -> Any:
    """A session's one row (index 0, first, not marked last), at the window's last timestamp as the runners' coders
    carry it (millis): what the windowed path's rows have after their shuffles, and Java's
    ``IntervalWindow.maxTimestamp()``."""
    return TimestampedValue(
        WindowedAggregate(
            key=key,
            window_start=Timestamp(micros=start_micros),
            window_end=Timestamp(micros=end_micros),
            value=value,
            input_count=count,
            pane_index=0,
            is_first=True,
            is_last=False,
            timing=timing,
        ),
        Timestamp(micros=(end_micros - 1) // 1000 * 1000),
    )


def late_dropped(metrics: MetricResults, step: str | None = None) -> int:
    """Inputs dropped as later than the allowed lateness: ``input_elements - aggregated_elements``.

    ``metrics`` is ``PipelineResult.metrics()``. With several HotKeyAggregate in one pipeline, pass the label of
    one (``step``) to count only its steps.
    """

    def total(name: str) -> int:
        query = MetricsFilter().with_namespace(METRICS_NAMESPACE).with_name(name)
        if step is not None:
            query = query.with_step(step)
        found = metrics.query(query)["counters"]
        return int(sum(c.committed or 0 for c in found))

    return total("input_elements") - total("aggregated_elements")

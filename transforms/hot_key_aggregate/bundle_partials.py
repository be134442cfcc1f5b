"""Strategy ``bundle_partials``: each bundle's partial sessions as rows, unmerged, for a sink that merges them."""

from __future__ import annotations

from typing import Any

import apache_beam as beam
from apache_beam.transforms.core import CombineFn
from apache_beam.utils.timestamp import Duration

from transforms.hot_key_aggregate.common import _session_row
from transforms.hot_key_aggregate.lifted import _MergePartialSessions, _PartialSessionsPerBundle

__all__ = ["bundle_partials"]


class _PartialRows(_MergePartialSessions):
    """``bundle_partials``: each (key, (start, end, accumulator)) partial as a ``WindowedAggregate`` row (timing
    ``PARTIAL``), unmerged: the sink merges partials of one session."""

    def process(self, element: tuple[Any, tuple[int, int, Any]]) -> Any:  # type: ignore[override]
        key, (start_micros, end_micros, accumulator) = element
        value, count = self._fn.extract_output(accumulator)
        yield _session_row(key, start_micros, end_micros, value, count, "PARTIAL")


def bundle_partials(pairs: beam.PCollection, combine_fn: CombineFn, gap: Duration) -> beam.PCollection:
    """Each bundle's partial sessions per key as rows (timing ``PARTIAL``): no shuffle, state, timers or ledger."""
    return (
        pairs
        | "PartialSessions" >> beam.ParDo(_PartialSessionsPerBundle(combine_fn, gap))
        | "PartialRows" >> beam.ParDo(_PartialRows(combine_fn))
    )

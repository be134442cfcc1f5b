"""Strategy ``windowed``: per-key windows where hot keys fan out over shards in two stages, and the pane ledger."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.metrics import Metrics
from apache_beam.transforms.core import CombineFn
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.trigger import AccumulationMode, AfterCount, AfterWatermark, DefaultTrigger
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec, TimerSpec, on_timer
from apache_beam.transforms.window import (
    GlobalWindows,
    Sessions,
    TimestampCombiner,
    TimestampedValue,
    WindowFn,
)
from apache_beam.utils.timestamp import Duration, Timestamp
from apache_beam.utils.windowed_value import PaneInfoTiming

from transforms.hot_key_aggregate.common import METRICS_NAMESPACE, WindowedAggregate, _CountingCombineFn, _stable_hash
from transforms.hot_key_aggregate.detection import HotKeyDetection, _FrequentKeysFn, _key_of, _SampleKeys

__all__ = ["windowed_aggregate"]

_HOT = "hot"
_MILLI = Duration(micros=1000)


class _RouteByHotness(beam.DoFn):
    """Cold keys pass as (key, value); hot keys go to the ``hot`` output as ((key, shard), value)."""

    def __init__(self, hot_keys: frozenset[Any], fanout: int, shard_by: Callable[[Any], Any] | None) -> None:
        self._hot_keys = hot_keys
        self._fanout = fanout
        self._shard_by = shard_by
        self._next_shard: dict[Any, int] = {}
        self._inputs = Metrics.counter(METRICS_NAMESPACE, "input_elements")
        self._hot = Metrics.counter(METRICS_NAMESPACE, "hot_elements")

    def start_bundle(self) -> None:
        self._next_shard = {}

    def process(
        self,
        element: tuple[Any, Any],
        windowed: Any = beam.DoFn.WindowedValueParam,  # its int micros: no Timestamp built per element
        detected: frozenset[Any] = frozenset(),
    ) -> Any:
        self._inputs.inc()
        key, value = element
        if key not in self._hot_keys and key not in detected:
            yield element
            return
        self._hot.inc()
        if self._shard_by is not None:
            # Deterministic across retries and runners: the same event always lands on the same shard.
            shard = _stable_hash(self._shard_by(value)) % self._fanout
        else:
            # Round-robin within the bundle, started at a stable point so one-element bundles still spread;
            # the same bundle replayed gets the same shards.
            start = self._next_shard.get(key)
            if start is None:
                start = _stable_hash(windowed.timestamp_micros)
            shard = start % self._fanout
            self._next_shard[key] = start + 1
        yield beam.pvalue.TaggedOutput(_HOT, ((key, shard), value))


class _StripShard(beam.DoFn):
    """((key, shard), partial) -> (key, partial), re-timestamped so the second stage rebuilds the true windows.

    With Sessions, a shard's partial session is the window [first, last + gap) of the events it saw; the true
    sessions are the connected components of the union of every event's [t, t + gap). Re-windowing a single element
    per partial with Sessions(gap) would give [t, t + gap) only, narrower than the partial. So each partial is
    emitted as markers at first, first + step, ..., last (step = gap - 1 ms, so their [p, p + gap) windows overlap, also
    in the millisecond precision the runners carry timestamps in, and
    their union is exactly [first, last + gap)); the accumulator rides on the last marker, the others carry None
    (the identity for the final combine). Sessions(gap) over the markers of all shards then merges into exactly the
    sessions a one-stage CombinePerKey forms. Markers are never earlier than the first event, which is the stage-1
    output timestamp (OUTPUT_AT_EARLIEST holds the watermark there), so on-time markers are never late.
    """

    def __init__(self, gap: Duration | None) -> None:
        self._gap = gap

    def process(
        self,
        element: tuple[tuple[Any, int], Any],
        window: Any = beam.DoFn.WindowParam,
    ) -> Any:
        (key, _shard), partial = element
        if self._gap is None:
            yield key, partial
            return
        first = window.start
        last = window.end - self._gap
        # One millisecond short of the gap, not one microsecond: the runners' coders carry timestamps in millis, so a
        # marker at first + k * (gap - 1 us) reaches the merge truncated to first + k * gap - 1 ms, where its window
        # only touches the previous one (Sessions merges overlaps, not touching windows) and the session breaks.
        step = self._gap - _MILLI if self._gap > _MILLI else self._gap - Duration(micros=1)
        at = first
        while at < last:
            yield TimestampedValue((key, None), at)
            at = at + step
        yield TimestampedValue((key, partial), last)


class _ToRow(beam.DoFn):
    def process(
        self,
        element: tuple[Any, tuple[Any, int]],
        window: Any = beam.DoFn.WindowParam,
        pane: Any = beam.DoFn.PaneInfoParam,
    ) -> Any:
        key, (value, count) = element
        yield (
            key,
            WindowedAggregate(
                key=key,
                window_start=window.start,
                window_end=window.end,
                value=value,
                input_count=count,
                pane_index=pane.index,
                is_first=pane.is_first,
                is_last=pane.is_last,
                timing=PaneInfoTiming.to_string(pane.timing),
            ),
        )


class _PaneLedger(beam.DoFn):
    """Per key, the input count of each window's latest pane: counts newly aggregated inputs, finds superseded windows.

    ``aggregated_elements`` grows by each pane's new inputs (panes are accumulating, so new = this pane's count minus
    what earlier panes of this window, or of the sessions it merged, already covered). Compared with
    ``input_elements`` this accounts for every input: what is not aggregated was dropped as too late.
    State expires by an event-time timer at the last window's end + allowed lateness.
    """

    COUNTS = ReadModifyWriteStateSpec("counts", PickleCoder())
    EXPIRY = TimerSpec("expiry", TimeDomain.WATERMARK)

    def __init__(self, allowed_lateness: Duration) -> None:
        self._lateness = allowed_lateness
        self._aggregated = Metrics.counter(METRICS_NAMESPACE, "aggregated_elements")

    def process(
        self,
        element: tuple[Any, WindowedAggregate],
        counts_state: Any = beam.DoFn.StateParam(COUNTS),
        expiry: Any = beam.DoFn.TimerParam(EXPIRY),
    ) -> Any:
        _key, row = element
        stored = counts_state.read()
        counts: dict[tuple[Timestamp, Timestamp], int] = stored[0] if stored else {}
        expires: Timestamp | None = stored[1] if stored else None
        this = (row.window_start, row.window_end)
        covered = {w: n for w, n in counts.items() if w[0] < this[1] and this[0] < w[1]}
        self._aggregated.inc(row.input_count - sum(covered.values()))
        for window in covered:
            del counts[window]
        counts[this] = row.input_count
        window_expiry = row.window_end + self._lateness
        if expires is None or window_expiry > expires:
            expires = window_expiry
            expiry.set(expires)
        counts_state.write((counts, expires))
        superseded = tuple(sorted(w for w in covered if w != this))
        yield dataclasses.replace(row, supersedes=superseded) if superseded else row

    @on_timer(EXPIRY)
    def expire(self, counts_state: Any = beam.DoFn.StateParam(COUNTS)) -> None:
        counts_state.clear()


def _window(
    windowfn: WindowFn,
    lateness: Duration,
    accumulation: Any,
    timestamp_combiner: Any = TimestampCombiner.OUTPUT_AT_EOW,
) -> beam.WindowInto:
    # Without allowed lateness a window fires exactly once, and Beam's default trigger takes its faster path.
    trigger = AfterWatermark(late=AfterCount(1)) if lateness > Duration(0) else DefaultTrigger()
    return beam.WindowInto(
        windowfn,
        trigger=trigger,
        accumulation_mode=accumulation,
        allowed_lateness=lateness,
        timestamp_combiner=timestamp_combiner,
    )


def windowed_aggregate(
    pairs: beam.PCollection,
    combine_fn: CombineFn,
    windowfn: WindowFn,
    *,
    hot_keys: frozenset[Any],
    detect: HotKeyDetection | None,
    fanout: int,
    allowed_lateness: Duration,
    shard_by: Callable[[Any], Any] | None,
) -> beam.PCollection:
    """Cold keys: WindowInto -> CombinePerKey. Hot keys: (key, shard) -> CombinePerKey of accumulators -> strip shard
    -> re-window -> merge. Then rows, and the pane ledger (counts aggregated inputs, marks superseded sessions)."""
    side_inputs: dict[str, Any] = {}
    if detect is not None:
        if isinstance(windowfn, Sessions):
            if not pairs.is_bounded:
                raise ValueError(
                    "HotKeyDetection with Sessions needs bounded input (a session has no fixed detection "
                    "window); on a stream, configure hot_keys instead"
                )
            detection_windows: WindowFn = GlobalWindows()
        else:
            detection_windows = windowfn
        if not (isinstance(detection_windows, GlobalWindows) and pairs.windowing.is_default()):
            pairs = pairs | "DetectionWindows" >> beam.WindowInto(detection_windows)
        hot_view = (
            pairs
            # Every key when not sampling: a plain Map, without the timestamp a sample needs (per-element cost).
            | "SampleKeys"
            >> (beam.Map(_key_of) if detect.sample_every == 1 else beam.ParDo(_SampleKeys(detect.sample_every)))
            | "FrequentKeys" >> beam.CombineGlobally(_FrequentKeysFn(detect)).as_singleton_view()
        )
        side_inputs["detected"] = hot_view
    routed = pairs | "RouteByHotness" >> beam.ParDo(
        _RouteByHotness(hot_keys, fanout, shard_by), **side_inputs
    ).with_outputs(_HOT, main="cold")

    cold = (
        routed.cold
        | "ColdWindows" >> _window(windowfn, allowed_lateness, AccumulationMode.ACCUMULATING)
        | "CombineCold" >> beam.CombinePerKey(_CountingCombineFn(combine_fn, "direct"))
    )
    gap = windowfn.gap_size if isinstance(windowfn, Sessions) else None
    hot = (
        routed[_HOT]
        | "ShardWindows"
        >> _window(windowfn, allowed_lateness, AccumulationMode.DISCARDING, TimestampCombiner.OUTPUT_AT_EARLIEST)
        | "CombineShards" >> beam.CombinePerKey(_CountingCombineFn(combine_fn, "partial"))
        | "StripShard" >> beam.ParDo(_StripShard(gap))
        | "HotWindows" >> _window(windowfn, allowed_lateness, AccumulationMode.ACCUMULATING)
        | "MergeShards" >> beam.CombinePerKey(_CountingCombineFn(combine_fn, "final"))
    )
    return (
        (cold, hot)
        | "Union" >> beam.Flatten()
        | "ToRows" >> beam.ParDo(_ToRow())
        | "LedgerWindow" >> beam.WindowInto(GlobalWindows())
        | "PaneLedger" >> beam.ParDo(_PaneLedger(allowed_lateness))
    )

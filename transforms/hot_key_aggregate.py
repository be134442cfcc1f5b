"""``HotKeyAggregate``: per-key windowed aggregation that spreads only the hot keys over shards (two stages).

Why not ``CombinePerKey(...).with_hot_key_fanout(n)``: Beam's fanout applies to every key (an extra shuffle of all
data, measured 4-5x slower locally), and it is defined for non-merging windows only. Here cold keys take one plain
``CombinePerKey``; hot keys (configured and/or detected) are combined in two stages whose result equals the one-stage
result for Fixed and Sessions windows (see ``tests/unit/test_hot_key_aggregate.py`` for the property tests). Bounded
Sessions in a batch run need no choice of keys: every key is pre-aggregated per bundle there (lifting).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import zlib
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricResults, MetricsFilter
from apache_beam.transforms.core import CombineFn
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.trigger import AccumulationMode, AfterCount, AfterWatermark, DefaultTrigger
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec, TimerSpec, on_timer
from apache_beam.transforms.window import (
    FixedWindows,
    GlobalWindows,
    Sessions,
    TimestampCombiner,
    TimestampedValue,
    WindowFn,
)
from apache_beam.utils.timestamp import Duration, Timestamp
from apache_beam.utils.windowed_value import PaneInfoTiming

from transforms._global_window import in_global_window
from transforms._run_mode import is_batch_bounded

__all__ = ["METRICS_NAMESPACE", "HotKeyAggregate", "HotKeyDetection", "WindowedAggregate", "late_dropped"]

METRICS_NAMESPACE = "beamflow.hot_key_aggregate"
_HOT = "hot"


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


@dataclass(frozen=True)
class HotKeyDetection:
    """Detect hot keys from the stream: keys holding at least ``min_share`` of the (sampled) events of a window.

    Approach: a Misra-Gries frequent-items summary with ``capacity`` counters (mergeable, so Beam combines it
    per bundle and then globally) over a deterministic 1-in-``sample_every`` sample, computed per detection window
    and given to the routing step as a side input. Every key with a true share >= ``min_share`` of the sample is
    found; keys down to ``min_share - 1/(capacity+1)`` may be flagged too (flagging a cold key as hot costs only a
    shard step, never correctness).

    Windowing: with ``FixedWindows`` the detection window is the aggregation window itself, so every key is routed
    the same way for a whole window (required: one (key, window) must not be split between the paths). In a
    stream, the side input for a window is ready when the watermark passes the window's end, so routing waits for
    it: detection adds up to one window of latency. With ``Sessions`` no fixed detection window can contain every
    session, so detection is over the whole input and is only allowed on bounded input; for unbounded sessions,
    configure ``hot_keys``.
    """

    min_share: float = 0.01
    sample_every: int = 1
    capacity: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.min_share < 1:
            raise ValueError(f"min_share must be in (0, 1), got {self.min_share}")
        if self.sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {self.sample_every}")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")

    @property
    def counters(self) -> int:
        return self.capacity if self.capacity is not None else math.ceil(2 / self.min_share)


def _stable_hash(value: Any) -> int:
    """A hash that is the same in every process and run (Python's ``hash`` of str is salted per process)."""
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, str):
        data = value.encode("utf-8")
    else:
        data = repr(value).encode("utf-8")
    return zlib.crc32(data)


class _FrequentKeysFn(CombineFn):
    """Misra-Gries frequent items (mergeable summary, Agarwal et al. 2012) -> frozenset of hot keys."""

    def __init__(self, detection: HotKeyDetection) -> None:
        self._k = detection.counters
        self._min_share = detection.min_share

    def create_accumulator(self) -> tuple[int, dict[Any, int]]:
        return 0, {}

    def _prune(self, counts: dict[Any, int]) -> dict[Any, int]:
        # Subtract the (k+1)-th largest count from all; keeps at most k counters, and each key's estimate stays
        # within n/(k+1) below its true count. Pruning lazily (at 2k) keeps that bound and amortises the sort.
        if len(counts) <= 2 * self._k:
            return counts
        cut = sorted(counts.values(), reverse=True)[self._k]
        return {key: c - cut for key, c in counts.items() if c > cut}

    def add_input(self, accumulator: tuple[int, dict[Any, int]], key: Any) -> tuple[int, dict[Any, int]]:
        n, counts = accumulator
        counts[key] = counts.get(key, 0) + 1
        return n + 1, self._prune(counts)

    def merge_accumulators(self, accumulators: Iterable[tuple[int, dict[Any, int]]]) -> tuple[int, dict[Any, int]]:
        total, merged = 0, {}  # type: tuple[int, dict[Any, int]]
        for n, counts in accumulators:
            total += n
            for key, c in counts.items():
                merged[key] = merged.get(key, 0) + c
            merged = self._prune(merged)
        return total, merged

    def extract_output(self, accumulator: tuple[int, dict[Any, int]]) -> frozenset[Any]:
        n, counts = accumulator
        threshold = max(1.0, (self._min_share - 1 / (self._k + 1)) * n)
        return frozenset(key for key, c in counts.items() if c >= threshold)


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
        timestamp: Any = beam.DoFn.TimestampParam,
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
                start = _stable_hash(timestamp.micros)
            shard = start % self._fanout
            self._next_shard[key] = start + 1
        yield beam.pvalue.TaggedOutput(_HOT, ((key, shard), value))


class _SampleKeys(beam.DoFn):
    def __init__(self, sample_every: int) -> None:
        self._every = sample_every

    def process(self, element: tuple[Any, Any], timestamp: Any = beam.DoFn.TimestampParam) -> Any:
        key = element[0]
        if _stable_hash(f"{timestamp.micros}|{key!r}") % self._every == 0:
            yield key


def _key_of(element: tuple[Any, Any]) -> Any:
    return element[0]


class _StripShard(beam.DoFn):
    """((key, shard), partial) -> (key, partial), re-timestamped so the second stage rebuilds the true windows.

    With Sessions, a shard's partial session is the window [first, last + gap) of the events it saw; the true
    sessions are the connected components of the union of every event's [t, t + gap). Re-windowing a single element
    per partial with Sessions(gap) would give [t, t + gap) only, narrower than the partial. So each partial is
    emitted as markers at first, first + step, ..., last (step < gap, so their [p, p + gap) windows overlap and
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
        step = self._gap - Duration(micros=1)
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


def _merge_spans(spans: list[tuple[int, int, Any]]) -> list[tuple[int, int, list[Any]]]:
    """Merges [start, end) spans (int micros) that overlap, exactly as ``Sessions.merge`` merges windows
    (``end > next.start``)."""
    spans.sort(key=_span_start)  # stable
    merged: list[tuple[int, int, list[Any]]] = []
    for start, end, item in spans:
        if merged and merged[-1][1] > start:
            first, last, items = merged[-1]
            items.append(item)
            if end > last:
                merged[-1] = (first, end, items)
        else:
            merged.append((start, end, [item]))
    return merged


def _span_start(span: tuple[int, int, Any]) -> int:
    return span[0]


# Inputs a bundle of the lifted sessions path holds at most before it emits the partial sessions so far.
MAX_BUFFERED_INPUTS = 100_000


def _partial_sessions(fn: _CountingCombineFn, gap: int, timed: list[tuple[int, Any]]) -> list[tuple[int, int, Any]]:
    """(start, end, accumulator) of each session formed by ``timed`` (event time in int micros, value) alone."""
    sessions = []
    for start, end, values in _merge_spans([(t, t + gap, value) for t, value in timed]):
        accumulator = fn.create_accumulator()
        for value in values:
            accumulator = fn.add_input(accumulator, value)
        sessions.append((start, end, accumulator))
    return sessions


class _PartialSessionsPerBundle(beam.DoFn):
    """Bounded Sessions, stage 1 (combiner lifting): each key's partial sessions among the inputs of one bundle.

    Only (key, (start, end, accumulator)) crosses the shuffle, not every input, so a skewed key costs the shuffle
    a few partials per bundle: what fanout achieves on a stream, without choosing hot keys first. A bundle holds at
    most ``MAX_BUFFERED_INPUTS`` inputs; then the partials so far are emitted and buffering starts again (the merge
    joins partials of one session whatever bundle or flush they came from). Times are int micros until rows are
    made: Timestamp arithmetic costs per input.
    """

    def __init__(self, combine_fn: CombineFn, gap: Duration) -> None:
        self._fn = _CountingCombineFn(combine_fn, "direct")
        self._gap = gap.micros
        self._inputs = Metrics.counter(METRICS_NAMESPACE, "input_elements")

    def setup(self) -> None:
        self._fn.setup()

    def teardown(self) -> None:
        self._fn.teardown()

    def start_bundle(self) -> None:
        self._buffer: dict[Any, list[tuple[int, Any]]] = {}
        self._buffered = 0

    def process(self, element: tuple[Any, Any], timestamp: Any = beam.DoFn.TimestampParam) -> Any:
        key, value = element
        timed = self._buffer.get(key)
        if timed is None:
            timed = self._buffer[key] = []
        # Millisecond precision: the runners' coders carry timestamps and windows in millis, so a session formed
        # after any shuffle has millisecond bounds (and so do the windowed path's).
        timed.append((timestamp.micros // 1000 * 1000, value))
        self._buffered += 1
        if self._buffered >= MAX_BUFFERED_INPUTS:
            yield from self._flush()

    def finish_bundle(self) -> Any:
        yield from self._flush()

    def _flush(self) -> Any:
        buffer, self._buffer = self._buffer, {}
        self._inputs.inc(self._buffered)
        self._buffered = 0
        for key, timed in buffer.items():
            for start, end, accumulator in _partial_sessions(self._fn, self._gap, timed):
                # Whole windowed values: finish_bundle outputs need one, and the merge groups in the global window.
                yield in_global_window((key, (start, end, accumulator)), Timestamp(micros=start))


class _MergePartialSessions(beam.DoFn):
    """Bounded Sessions, stage 2: one key's partial sessions -> one ``WindowedAggregate`` row per session.

    Partials that overlap are merged as ``Sessions`` merges windows, so the sessions are the connected components
    of the inputs' [t, t + gap) windows. Each row is the one pane a batch run of the windowed ``CombinePerKey``
    emits (index 0, first, on time, not marked last), at the window's end, in the global window (where the pane
    ledger would leave it).
    """

    def __init__(self, combine_fn: CombineFn) -> None:
        self._fn = _CountingCombineFn(combine_fn, "direct")

    def setup(self) -> None:
        self._fn.setup()

    def teardown(self) -> None:
        self._fn.teardown()

    def process(self, element: tuple[Any, Iterable[tuple[int, int, Any]]]) -> Any:
        key, partials = element
        for start_micros, end_micros, accumulators in _merge_spans(list(partials)):
            value, count = self._fn.extract_output(self._fn.merge_accumulators(accumulators))
            yield _session_row(key, start_micros, end_micros, value, count, "ON_TIME")


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


class _PartialRows(_MergePartialSessions):
    """``bundle_partials``: each (key, (start, end, accumulator)) partial as a ``WindowedAggregate`` row (timing
    ``PARTIAL``), unmerged: the sink merges partials of one session."""

    def process(self, element: tuple[Any, tuple[int, int, Any]]) -> Any:  # type: ignore[override]
        key, (start_micros, end_micros, accumulator) = element
        value, count = self._fn.extract_output(accumulator)
        yield _session_row(key, start_micros, end_micros, value, count, "PARTIAL")


STRATEGIES = ("auto", "windowed", "lifted", "bundle_partials")


class HotKeyAggregate(beam.PTransform):
    """Windowed CombinePerKey that fans out only hot keys over ``fanout`` shards, in two stages.

    ::

        rows = (
            clicks                                    # (user_id, event), timestamped by event time
            | HotKeyAggregate(
                SessionClicksFn(),
                windowfn=Sessions(600),
                hot_keys={"user-1", "user-7"},        # and/or detect=HotKeyDetection(min_share=0.01)
                fanout=16,
                allowed_lateness=Duration(seconds=300),
                shard_by=lambda event: event["event_id"],
            )
        )                                             # WindowedAggregate rows
        rows | UpsertSink(key=("key", "window_start", "window_end"), version="pane_index")

    Input: (key, value) pairs with event-time timestamps (in any windowing; this transform applies ``windowfn``).
    Output: ``WindowedAggregate`` rows, one per key, window and pane (accumulating panes: on time, then one per
    late firing). Supported ``windowfn``: ``FixedWindows`` and ``Sessions``.

    Paths: cold keys -> WindowInto -> CombinePerKey (one shuffle). Hot keys -> (key, shard) -> CombinePerKey of
    accumulators (stage 1, discarding panes, timestamp at the earliest event) -> strip shard -> re-window ->
    CombinePerKey merging accumulators and extracting (stage 2, accumulating panes). Equal to a plain
    ``CombinePerKey`` for any combine_fn whose merge is commutative and associative (the CombineFn contract).
    Shards: ``shard_by(value)`` hashed stably when given (deterministic across retries), otherwise round-robin within
    a bundle.

    Late data: panes fire at the watermark and then for every late input within ``allowed_lateness``; later inputs
    are dropped by the runner and accounted for: counters ``input_elements`` (all inputs) and
    ``aggregated_elements`` (inputs covered by emitted panes) in namespace ``beamflow.hot_key_aggregate``; their
    difference, ``late_dropped(result.metrics())``, is the number dropped as too late (exact once the pipeline has
    drained; while running it also includes inputs still in flight).

    Guarantee: deterministic, idempotent results per (key, window, pane): with an exactly-once runner (Flink with
    checkpoints) each pane is emitted once; replays give the same rows, so a versioned upsert sink is exactly-once.

    Bounded Sessions in a batch run (``pairs.is_bounded``, not ``--streaming``): no input can be late there (the
    watermark passes the windows only once all input is in), so each session fires exactly one pane, and the
    aggregation is lifted instead of fanned out: each bundle turns its inputs into partial sessions per key
    (combiner lifting, as Beam does for combines in non-merging windows), one ``GroupByKey`` brings a key's partials
    together, and overlapping partials merge as ``Sessions`` merges windows. Only partials cross the shuffle, so a
    skewed key costs a few elements per bundle instead of all its inputs: every key gets what fanout gives a hot
    one, without choosing hot keys (``hot_keys``, ``detect`` and ``fanout`` are not used on this path, and
    ``hot_elements`` is not counted). No merging-window trigger machinery and no pane ledger either. Same keys,
    windows, values, counts, pane fields and timestamps as the windowed path (``tests/unit/test_hot_key_aggregate.py``
    compares the two, with partials flushed after every input too). Streaming runs (where late panes happen) and
    ``FixedWindows`` keep the windowed path with fanout.

    Strategy ``bundle_partials`` (Sessions only, any run, chosen explicitly): each bundle's partial sessions per key,
    emitted as rows (pane index 0, timing ``PARTIAL``) without merging across bundles: no shuffle, window state,
    timers or ledger. The rows are partial sessions, not sessions: use it only in front of a sink that merges
    overlapping partials itself and counts each input once, e.g. ``WriteSessions`` (merging by the inputs' Kafka
    coordinates in one transaction). Nothing is ever too late there (``allowed_lateness``, ``hot_keys``,
    ``detect`` and ``fanout`` have no effect). Why: on a Flink stream the windowed path keeps every input in
    merging-window state and fires sessions in bursts when the watermark moves, which holds checkpoint barriers
    back on a backlog (issue 13); partials cost one pass per bundle.

    Strategies: ``auto`` (bounded Sessions in a batch run: lifted; otherwise windowed), ``windowed``, ``lifted``
    (bounded Sessions in a batch run only), ``bundle_partials``.

    Needs: the windowing given here (not upstream triggers); a keyed stateful step over result rows (the pane
    ledger, one shuffle of rows, not of events), except on the bounded Sessions path and ``bundle_partials``.
    """

    def __init__(
        self,
        combine_fn: CombineFn,
        windowfn: WindowFn,
        hot_keys: Iterable[Hashable] = (),
        detect: HotKeyDetection | bool | None = None,
        fanout: int = 16,
        allowed_lateness: Duration | int | float = 0,
        shard_by: Callable[[Any], Any] | None = None,
        label: str | None = None,
        strategy: str = "auto",
    ) -> None:
        super().__init__(label)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if strategy in ("lifted", "bundle_partials") and not isinstance(windowfn, Sessions):
            raise ValueError(f"strategy {strategy!r} needs Sessions windows")
        if strategy == "bundle_partials" and (hot_keys or detect):
            warnings.warn(
                "HotKeyAggregate: hot_keys and detect have no effect with strategy bundle_partials", stacklevel=2
            )
        self._strategy = strategy
        if not isinstance(combine_fn, CombineFn):
            raise TypeError(f"combine_fn must be a CombineFn (two stages need its accumulators), got {combine_fn!r}")
        if not isinstance(windowfn, FixedWindows | Sessions):
            raise ValueError(f"windowfn must be FixedWindows or Sessions, got {type(windowfn).__name__}")
        if fanout < 2:
            raise ValueError(f"fanout must be >= 2, got {fanout}")
        self._combine_fn = combine_fn
        self._windowfn = windowfn
        self._hot_keys = frozenset(hot_keys)
        self._detect = HotKeyDetection() if detect is True else (detect or None)
        self._fanout = fanout
        self._lateness = allowed_lateness if isinstance(allowed_lateness, Duration) else Duration.of(allowed_lateness)
        if self._lateness < Duration(0):
            raise ValueError(f"allowed_lateness must be >= 0, got {self._lateness}")
        self._shard_by = shard_by

    def _window(self, accumulation: Any, timestamp_combiner: Any = TimestampCombiner.OUTPUT_AT_EOW) -> beam.WindowInto:
        # Without allowed lateness a window fires exactly once, and Beam's default trigger takes its faster path.
        trigger = AfterWatermark(late=AfterCount(1)) if self._lateness > Duration(0) else DefaultTrigger()
        return beam.WindowInto(
            self._windowfn,
            trigger=trigger,
            accumulation_mode=accumulation,
            allowed_lateness=self._lateness,
            timestamp_combiner=timestamp_combiner,
        )

    def expand(self, pairs: beam.PCollection) -> beam.PCollection:
        if self._strategy == "bundle_partials":
            assert isinstance(self._windowfn, Sessions)
            if not pairs.windowing.is_default():
                pairs = pairs | "SessionInputsGlobal" >> beam.WindowInto(GlobalWindows())
            return (
                pairs
                | "PartialSessions" >> beam.ParDo(_PartialSessionsPerBundle(self._combine_fn, self._windowfn.gap_size))
                | "PartialRows" >> beam.ParDo(_PartialRows(self._combine_fn))
            )
        sessions = self._windowfn if isinstance(self._windowfn, Sessions) else None
        lifted = sessions is not None and is_batch_bounded(pairs)
        if self._strategy == "lifted" and not lifted:
            raise ValueError("strategy 'lifted' needs bounded input in a batch run")
        if sessions is not None and lifted and self._strategy != "windowed":
            return self._lifted_sessions(pairs, sessions.gap_size)
        side_inputs: dict[str, Any] = {}
        if self._detect is not None:
            if isinstance(self._windowfn, Sessions):
                if not pairs.is_bounded:
                    raise ValueError(
                        "HotKeyDetection with Sessions needs bounded input (a session has no fixed detection "
                        "window); on a stream, configure hot_keys instead"
                    )
                detection_windows: WindowFn = GlobalWindows()
            else:
                detection_windows = self._windowfn
            if not (isinstance(detection_windows, GlobalWindows) and pairs.windowing.is_default()):
                pairs = pairs | "DetectionWindows" >> beam.WindowInto(detection_windows)
            hot_view = (
                pairs
                # Every key when not sampling: a plain Map, without the timestamp a sample needs (per-element cost).
                | "SampleKeys"
                >> (
                    beam.Map(_key_of)
                    if self._detect.sample_every == 1
                    else beam.ParDo(_SampleKeys(self._detect.sample_every))
                )
                | "FrequentKeys" >> beam.CombineGlobally(_FrequentKeysFn(self._detect)).as_singleton_view()
            )
            side_inputs["detected"] = hot_view
        routed = pairs | "RouteByHotness" >> beam.ParDo(
            _RouteByHotness(self._hot_keys, self._fanout, self._shard_by), **side_inputs
        ).with_outputs(_HOT, main="cold")

        cold = (
            routed.cold
            | "ColdWindows" >> self._window(AccumulationMode.ACCUMULATING)
            | "CombineCold" >> beam.CombinePerKey(_CountingCombineFn(self._combine_fn, "direct"))
        )
        gap = self._windowfn.gap_size if isinstance(self._windowfn, Sessions) else None
        hot = (
            routed[_HOT]
            | "ShardWindows" >> self._window(AccumulationMode.DISCARDING, TimestampCombiner.OUTPUT_AT_EARLIEST)
            | "CombineShards" >> beam.CombinePerKey(_CountingCombineFn(self._combine_fn, "partial"))
            | "StripShard" >> beam.ParDo(_StripShard(gap))
            | "HotWindows" >> self._window(AccumulationMode.ACCUMULATING)
            | "MergeShards" >> beam.CombinePerKey(_CountingCombineFn(self._combine_fn, "final"))
        )
        return (
            (cold, hot)
            | "Union" >> beam.Flatten()
            | "ToRows" >> beam.ParDo(_ToRow())
            | "LedgerWindow" >> beam.WindowInto(GlobalWindows())
            | "PaneLedger" >> beam.ParDo(_PaneLedger(self._lateness))
        )

    def _lifted_sessions(self, pairs: beam.PCollection, gap: Duration) -> beam.PCollection:
        if not pairs.windowing.is_default():  # the merge needs every partial of a key in one (global) window
            pairs = pairs | "SessionInputsGlobal" >> beam.WindowInto(GlobalWindows())
        return (
            pairs
            | "PartialSessions" >> beam.ParDo(_PartialSessionsPerBundle(self._combine_fn, gap))
            | "PartialsPerKey" >> beam.GroupByKey()
            | "MergePartials" >> beam.ParDo(_MergePartialSessions(self._combine_fn))
            | "CountAggregated" >> beam.ParDo(_CountAggregated())
        )


class _CountAggregated(beam.DoFn):
    """The lifted path's stand-in for the pane ledger's counter: one pane per session, so every input counts once."""

    def __init__(self) -> None:
        self._aggregated = Metrics.counter(METRICS_NAMESPACE, "aggregated_elements")

    def process(self, row: WindowedAggregate) -> Any:
        self._aggregated.inc(row.input_count)
        yield row


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

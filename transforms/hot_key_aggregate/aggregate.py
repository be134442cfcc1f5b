"""``HotKeyAggregate``: the transform, and the rule that picks one of its strategies."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import apache_beam as beam
from apache_beam.transforms.core import CombineFn
from apache_beam.transforms.window import FixedWindows, GlobalWindows, Sessions, WindowFn
from apache_beam.utils.timestamp import Duration

from transforms._run_mode import is_batch_bounded
from transforms.hot_key_aggregate.bundle_partials import bundle_partials
from transforms.hot_key_aggregate.detection import HotKeyDetection
from transforms.hot_key_aggregate.fanout import windowed_aggregate
from transforms.hot_key_aggregate.lifted import lifted_sessions

__all__ = ["DEFAULT_FANOUT", "STRATEGIES", "HotKeyAggregate"]

log = logging.getLogger(__name__)

STRATEGIES = ("auto", "windowed", "lifted", "bundle_partials")
DEFAULT_FANOUT = 16
# Arguments only the windowed strategy uses.
WINDOWED_ONLY = ("hot_keys", "detect", "fanout", "shard_by", "allowed_lateness")


class HotKeyAggregate(beam.PTransform):
    """Windowed CombinePerKey that fans out only hot keys over ``fanout`` shards, in two stages.

    ::

        import apache_beam as beam
        from apache_beam.transforms.window import Sessions, TimestampedValue
        from beamflow.aggregates import SessionClicksFn
        from runners.direct import local_options
        from transforms import HotKeyAggregate

        clicks = [("user-1", {"event_type": "impression", "event_time": t, "event_id": f"e{t}"}) for t in (0, 60, 900)]
        with beam.Pipeline(options=local_options()) as p:
            rows = (
                p
                | beam.Create(clicks)
                | beam.Map(lambda kv: TimestampedValue(kv, kv[1]["event_time"]))  # (user_id, event) by event time
                | HotKeyAggregate(
                    SessionClicksFn(),
                    windowfn=Sessions(600),
                    hot_keys={"user-1", "user-7"},        # and/or detect=HotKeyDetection(min_share=0.01)
                    fanout=16,
                    allowed_lateness=300,
                    shard_by=lambda event: event["event_id"],
                    strategy="windowed",
                )
            )
            rows | beam.Map(print)   # WindowedAggregate rows: user-1's sessions [0, 660) and [900, 1500)

    A versioned upsert sink keeps the newest pane of each row: ``WriteToPostgres`` with
    ``key=("key", "window_start", "window_end")`` and ``version=("pane_index",)``.

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
    back on a backlog (issue 13); partials cost one pass per bundle. ``route_by_key=True`` (``bundle_partials``
    only) first passes the inputs through one keyed step that holds no state (``bundle_partials.py``), so at
    parallelism p each key's inputs meet on one instance: one partial per key per bundle instead of up to p, and
    the sink instances fused after it write disjoint keys (no two merging, or waiting for the other's lock on, one
    key's sessions). It costs one network exchange of the inputs.

    Strategy (``strategy=``, one module each under ``transforms/hot_key_aggregate/``):

    - ``auto`` (the default): ``lifted`` for ``Sessions`` on bounded input in a batch run, otherwise ``windowed``.
      The choice is logged (INFO) when the pipeline is built, with the arguments it leaves unused.
    - ``windowed`` (``fanout.py``): Fixed or Sessions, any run; hot keys (``hot_keys``, ``detect``) fan out over
      ``fanout`` shards (``shard_by``), late panes within ``allowed_lateness``.
    - ``lifted`` (``lifted.py``): Sessions on bounded input in a batch run only (refused otherwise).
    - ``bundle_partials`` (``bundle_partials.py``): Sessions, any run, partial rows for a merging sink.

    ``hot_keys``, ``detect``, ``fanout``, ``shard_by`` and ``allowed_lateness`` act on the ``windowed`` strategy
    only: given with ``lifted`` or ``bundle_partials`` they have no effect, and the constructor warns
    (``UserWarning``) naming them.

    Needs: the windowing given here (not upstream triggers); a keyed stateful step over result rows (the pane
    ledger, one shuffle of rows, not of events), except on the bounded Sessions path and ``bundle_partials``.
    """

    def __init__(
        self,
        combine_fn: CombineFn,
        windowfn: WindowFn,
        hot_keys: Iterable[Hashable] = (),
        detect: HotKeyDetection | bool | None = None,
        fanout: int | None = None,
        allowed_lateness: Duration | int | float = 0,
        shard_by: Callable[[Any], Any] | None = None,
        label: str | None = None,
        strategy: str = "auto",
        route_by_key: bool = False,
    ) -> None:
        super().__init__(label)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if strategy in ("lifted", "bundle_partials") and not isinstance(windowfn, Sessions):
            raise ValueError(f"strategy {strategy!r} needs Sessions windows")
        if not isinstance(combine_fn, CombineFn):
            raise TypeError(f"combine_fn must be a CombineFn (two stages need its accumulators), got {combine_fn!r}")
        if not isinstance(windowfn, FixedWindows | Sessions):
            raise ValueError(f"windowfn must be FixedWindows or Sessions, got {type(windowfn).__name__}")
        if fanout is not None and fanout < 2:
            raise ValueError(f"fanout must be >= 2, got {fanout}")
        if route_by_key and strategy != "bundle_partials":
            raise ValueError("route_by_key acts on strategy 'bundle_partials' only")
        self._route_by_key = route_by_key
        self._strategy = strategy
        self._combine_fn = combine_fn
        self._windowfn = windowfn
        self._hot_keys = frozenset(hot_keys)
        self._detect = HotKeyDetection() if detect is True else (detect or None)
        self._fanout = DEFAULT_FANOUT if fanout is None else fanout
        self._lateness = allowed_lateness if isinstance(allowed_lateness, Duration) else Duration.of(allowed_lateness)
        if self._lateness < Duration(0):
            raise ValueError(f"allowed_lateness must be >= 0, got {self._lateness}")
        self._shard_by = shard_by
        given = {
            "hot_keys": bool(self._hot_keys),
            "detect": self._detect is not None,
            "fanout": fanout is not None,
            "shard_by": shard_by is not None,
            "allowed_lateness": self._lateness > Duration(0),
        }
        self._windowed_args = tuple(name for name in WINDOWED_ONLY if given[name])
        if strategy in ("lifted", "bundle_partials") and self._windowed_args:
            warnings.warn(
                f"HotKeyAggregate: {', '.join(self._windowed_args)} have no effect with strategy {strategy!r} "
                "(they act on the windowed strategy only)",
                UserWarning,
                stacklevel=2,
            )

    def chosen_strategy(self, pairs: beam.PCollection) -> str:
        """The strategy this transform takes on ``pairs``: ``auto`` resolved by the rule in the docstring."""
        if self._strategy != "auto":
            return self._strategy
        return "lifted" if isinstance(self._windowfn, Sessions) and is_batch_bounded(pairs) else "windowed"

    def expand(self, pairs: beam.PCollection) -> beam.PCollection:
        strategy = self.chosen_strategy(pairs)
        if self._strategy == "auto":
            unused = self._windowed_args if strategy != "windowed" else ()
            log.info("HotKeyAggregate %s: strategy auto -> %s; unused: %s", self.label, strategy, unused or "none")
        if strategy == "windowed":
            return windowed_aggregate(
                pairs,
                self._combine_fn,
                self._windowfn,
                hot_keys=self._hot_keys,
                detect=self._detect,
                fanout=self._fanout,
                allowed_lateness=self._lateness,
                shard_by=self._shard_by,
            )
        assert isinstance(self._windowfn, Sessions)
        if strategy == "lifted" and not is_batch_bounded(pairs):
            raise ValueError("strategy 'lifted' needs bounded input in a batch run")
        if not pairs.windowing.is_default():  # partials of a key meet in one (global) window
            pairs = pairs | "SessionInputsGlobal" >> beam.WindowInto(GlobalWindows())
        if strategy == "lifted":
            return lifted_sessions(pairs, self._combine_fn, self._windowfn.gap_size)
        return bundle_partials(pairs, self._combine_fn, self._windowfn.gap_size, self._route_by_key)

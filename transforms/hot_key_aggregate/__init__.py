"""``HotKeyAggregate``: per-key windowed aggregation that spreads only the hot keys over shards (two stages).

Why not ``CombinePerKey(...).with_hot_key_fanout(n)``: Beam's fanout applies to every key (an extra shuffle of all
data, measured 4-5x slower locally), and it is defined for non-merging windows only. Here cold keys take one plain
``CombinePerKey``; hot keys (configured and/or detected) are combined in two stages whose result equals the one-stage
result for Fixed and Sessions windows (see ``tests/unit/test_hot_key_aggregate.py`` for the property tests). Bounded
Sessions in a batch run need no choice of keys: every key is pre-aggregated per bundle there (lifting).

One module per algorithm: ``aggregate`` (the transform and the strategy rule), ``fanout`` (strategy ``windowed``:
hot keys over shards, the pane ledger), ``detection`` (hot keys found in the stream), ``lifted`` (strategy
``lifted``: partial sessions per bundle merged per key), ``bundle_partials`` (strategy ``bundle_partials``), and
``common`` (the result row and what the strategies share).
"""

from transforms.hot_key_aggregate.aggregate import DEFAULT_FANOUT, STRATEGIES, HotKeyAggregate
from transforms.hot_key_aggregate.common import METRICS_NAMESPACE, WindowedAggregate, late_dropped
from transforms.hot_key_aggregate.detection import HotKeyDetection
from transforms.hot_key_aggregate.lifted import MAX_BUFFERED_INPUTS

__all__ = [
    "DEFAULT_FANOUT",
    "MAX_BUFFERED_INPUTS",
    "METRICS_NAMESPACE",
    "STRATEGIES",
    "HotKeyAggregate",
    "HotKeyDetection",
    "WindowedAggregate",
    "late_dropped",
]

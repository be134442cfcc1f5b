"""Hot keys detected from the stream: a mergeable frequent-items summary per detection window (``HotKeyDetection``)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
from apache_beam.transforms.core import CombineFn

from transforms.hot_key_aggregate.common import _stable_hash

__all__ = ["HotKeyDetection"]


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


class _SampleKeys(beam.DoFn):
    def __init__(self, sample_every: int) -> None:
        self._every = sample_every

    # The windowed value's int micros, not TimestampParam: no Timestamp built per element.
    def process(self, element: tuple[Any, Any], windowed: Any = beam.DoFn.WindowedValueParam) -> Any:
        key = element[0]
        if _stable_hash(f"{windowed.timestamp_micros}|{key!r}") % self._every == 0:
            yield key


def _key_of(element: tuple[Any, Any]) -> Any:
    return element[0]

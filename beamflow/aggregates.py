"""Aggregates for the clicks pipeline: per-session impressions, clicks and first/last event time.

The aggregate itself (``SessionClicks`` and its ``add``/``merge``) is plain Python; ``SessionClicksFn`` adapts it to
Beam's ``CombineFn`` contract so it can run per key per session window, directly or in two stages
(``transforms.hot_key_aggregate.HotKeyAggregate``: accumulators from shards merged, then extracted).

Events that carry Kafka coordinates (``kafka_partition``/``kafka_offset``) are also remembered by coordinate, per
type, as offset ranges (``beamflow.kafka.offset_ranges.OffsetRanges``): a session then knows which records it counts,
so ``SessionClicks.union`` can merge it with a stored session that may count some of the same records (a rerun after
a crash, a restored stream) and still count each record once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from apache_beam.transforms.core import CombineFn

from beamflow.kafka.offset_ranges import OffsetRanges

__all__ = ["CLICK", "IMPRESSION", "SessionClicks", "SessionClicksFn"]

IMPRESSION = "impression"
CLICK = "click"
_NONE = OffsetRanges()


@dataclass(frozen=True)
class SessionClicks:
    """What one user did in one session. Event times are in the unit the events carry (beamflow: epoch millis).

    The empty value (no events) has ``first_event_time``/``last_event_time`` of None. ``impression_offsets`` and
    ``click_offsets`` are the Kafka coordinates of the events counted, when the events carried them: ``exact`` says
    every counted event has its coordinates there (what ``union`` needs).
    """

    impressions: int = 0
    clicks: int = 0
    first_event_time: int | float | None = None
    last_event_time: int | float | None = None
    impression_offsets: OffsetRanges = _NONE
    click_offsets: OffsetRanges = _NONE

    @property
    def events(self) -> int:
        return self.impressions + self.clicks

    @property
    def click_through_rate(self) -> float | None:
        """clicks / impressions, None without impressions (a rate over nothing is not zero)."""
        return self.clicks / self.impressions if self.impressions else None

    @property
    def exact(self) -> bool:
        """Whether every counted event is known by its Kafka coordinates (so ``union`` can count each once)."""
        return len(self.impression_offsets) == self.impressions and len(self.click_offsets) == self.clicks

    def add(
        self, event_type: str, event_time: int | float, partition: int | None = None, offset: int | None = None
    ) -> SessionClicks:
        impression_offsets, click_offsets = self.impression_offsets, self.click_offsets
        if event_type == IMPRESSION:
            impressions, clicks = self.impressions + 1, self.clicks
            if offset is not None and partition is not None:
                impression_offsets = impression_offsets.add(partition, offset)
        elif event_type == CLICK:
            impressions, clicks = self.impressions, self.clicks + 1
            if offset is not None and partition is not None:
                click_offsets = click_offsets.add(partition, offset)
        else:
            raise ValueError(f"unknown event type {event_type!r}: expected {IMPRESSION!r} or {CLICK!r}")
        return SessionClicks(
            impressions,
            clicks,
            event_time if self.first_event_time is None else min(self.first_event_time, event_time),
            event_time if self.last_event_time is None else max(self.last_event_time, event_time),
            impression_offsets,
            click_offsets,
        )

    def merge(self, other: SessionClicks) -> SessionClicks:
        """The aggregate of two disjoint sets of events (what Beam combines: each input is in one accumulator)."""
        firsts = [t for t in (self.first_event_time, other.first_event_time) if t is not None]
        lasts = [t for t in (self.last_event_time, other.last_event_time) if t is not None]
        return SessionClicks(
            self.impressions + other.impressions,
            self.clicks + other.clicks,
            min(firsts) if firsts else None,
            max(lasts) if lasts else None,
            self.impression_offsets | other.impression_offsets,
            self.click_offsets | other.click_offsets,
        )

    def union(self, other: SessionClicks) -> SessionClicks:
        """The aggregate of two sets of events that may share events (a stored session and a replay of some of its
        events): counts come from the union of the offsets, so a shared event counts once. Idempotent, commutative
        and associative. Both sides must be ``exact``; a ValueError says which is not."""
        for side in (self, other):
            if not side.exact:
                raise ValueError(
                    f"cannot merge sessions by event without every event's Kafka coordinates: {side.impressions} "
                    f"impressions/{side.clicks} clicks but {len(side.impression_offsets)}/{len(side.click_offsets)} "
                    "offsets"
                )
        merged = self.merge(other)
        return SessionClicks(
            len(merged.impression_offsets),
            len(merged.click_offsets),
            merged.first_event_time,
            merged.last_event_time,
            merged.impression_offsets,
            merged.click_offsets,
        )


class SessionClicksFn(CombineFn):
    """Combines click-stream events (mappings) into one ``SessionClicks`` per key and window.

    Each event needs ``type_field`` (``"impression"`` or ``"click"``) and ``time_field`` (a number); anything else
    raises ``ValueError`` naming the field, since a silently skipped event would make the counts wrong. Accumulators
    are immutable ``SessionClicks`` values, so merging is order-free (commutative and associative), which is what
    two-stage aggregation relies on. Events with ``partition_field`` and ``offset_field`` (ints) are also remembered
    by Kafka coordinate (``SessionClicks.impression_offsets``/``click_offsets``).
    """

    def __init__(
        self,
        type_field: str = "event_type",
        time_field: str = "event_time",
        partition_field: str = "kafka_partition",
        offset_field: str = "kafka_offset",
    ) -> None:
        self.type_field = type_field
        self.time_field = time_field
        self.partition_field = partition_field
        self.offset_field = offset_field

    def create_accumulator(self) -> SessionClicks:
        return SessionClicks()

    def add_input(self, accumulator: SessionClicks, element: Mapping[str, Any]) -> SessionClicks:
        try:
            event_type = element[self.type_field]
            event_time = element[self.time_field]
        except (KeyError, TypeError) as exc:
            raise ValueError(
                f"click event needs fields {self.type_field!r} and {self.time_field!r}, got {element!r}"
            ) from exc
        if isinstance(event_time, bool) or not isinstance(event_time, int | float):
            raise ValueError(f"{self.time_field!r} must be a number, got {event_time!r}")
        return accumulator.add(
            event_type, event_time, element.get(self.partition_field), element.get(self.offset_field)
        )

    def merge_accumulators(self, accumulators: Iterable[SessionClicks]) -> SessionClicks:
        merged = SessionClicks()
        for accumulator in accumulators:
            merged = merged.merge(accumulator)
        return merged

    def extract_output(self, accumulator: SessionClicks) -> SessionClicks:
        return accumulator

"""Aggregates for the clicks pipeline: per-session impressions, clicks and first/last event time.

The aggregate itself (``SessionClicks`` and its ``add``/``merge``) is plain Python; ``SessionClicksFn`` adapts it to
Beam's ``CombineFn`` contract so it can run per key per session window, directly or in two stages
(``transforms.hot_key_aggregate.HotKeyAggregate``: accumulators from shards merged, then extracted).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from apache_beam.transforms.core import CombineFn

__all__ = ["CLICK", "IMPRESSION", "SessionClicks", "SessionClicksFn"]

IMPRESSION = "impression"
CLICK = "click"


@dataclass(frozen=True)
class SessionClicks:
    """What one user did in one session. Event times are in the unit the events carry (beamflow: epoch millis).

    The empty value (no events) has ``first_event_time``/``last_event_time`` of None.
    """

    impressions: int = 0
    clicks: int = 0
    first_event_time: int | float | None = None
    last_event_time: int | float | None = None

    @property
    def events(self) -> int:
        return self.impressions + self.clicks

    @property
    def click_through_rate(self) -> float | None:
        """clicks / impressions, None without impressions (a rate over nothing is not zero)."""
        return self.clicks / self.impressions if self.impressions else None

    def add(self, event_type: str, event_time: int | float) -> SessionClicks:
        if event_type == IMPRESSION:
            impressions, clicks = self.impressions + 1, self.clicks
        elif event_type == CLICK:
            impressions, clicks = self.impressions, self.clicks + 1
        else:
            raise ValueError(f"unknown event type {event_type!r}: expected {IMPRESSION!r} or {CLICK!r}")
        return SessionClicks(
            impressions,
            clicks,
            event_time if self.first_event_time is None else min(self.first_event_time, event_time),
            event_time if self.last_event_time is None else max(self.last_event_time, event_time),
        )

    def merge(self, other: SessionClicks) -> SessionClicks:
        firsts = [t for t in (self.first_event_time, other.first_event_time) if t is not None]
        lasts = [t for t in (self.last_event_time, other.last_event_time) if t is not None]
        return SessionClicks(
            self.impressions + other.impressions,
            self.clicks + other.clicks,
            min(firsts) if firsts else None,
            max(lasts) if lasts else None,
        )


class SessionClicksFn(CombineFn):
    """Combines click-stream events (mappings) into one ``SessionClicks`` per key and window.

    Each event needs ``type_field`` (``"impression"`` or ``"click"``) and ``time_field`` (a number); anything else
    raises ``ValueError`` naming the field, since a silently skipped event would make the counts wrong. Accumulators
    are immutable ``SessionClicks`` values, so merging is order-free (commutative and associative), which is what
    two-stage aggregation relies on.
    """

    def __init__(self, type_field: str = "event_type", time_field: str = "event_time") -> None:
        self.type_field = type_field
        self.time_field = time_field

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
        return accumulator.add(event_type, event_time)

    def merge_accumulators(self, accumulators: Iterable[SessionClicks]) -> SessionClicks:
        merged = SessionClicks()
        for accumulator in accumulators:
            merged = merged.merge(accumulator)
        return merged

    def extract_output(self, accumulator: SessionClicks) -> SessionClicks:
        return accumulator

"""Aggregates for the jobs: per-session impressions, clicks and first/last event time (clicks); per-session rides,
fares, distance and zones of a driver (rides, ``RideSession``).

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

__all__ = ["CLICK", "IMPRESSION", "RideSession", "RideSessionFn", "SessionClicks", "SessionClicksFn"]

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
            raise _unknown_type(event_type)
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


def _unknown_type(event_type: Any) -> ValueError:
    return ValueError(f"unknown event type {event_type!r}: expected {IMPRESSION!r} or {CLICK!r}")


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

    def _type_and_time(self, element: Mapping[str, Any]) -> tuple[Any, int | float]:
        try:
            event_type = element[self.type_field]
            event_time = element[self.time_field]
        except (KeyError, TypeError) as exc:
            raise ValueError(
                f"click event needs fields {self.type_field!r} and {self.time_field!r}, got {element!r}"
            ) from exc
        if isinstance(event_time, bool) or not isinstance(event_time, int | float):
            raise ValueError(f"{self.time_field!r} must be a number, got {event_time!r}")
        return event_type, event_time

    def add_input(self, accumulator: SessionClicks, element: Mapping[str, Any]) -> SessionClicks:
        event_type, event_time = self._type_and_time(element)
        return accumulator.add(
            event_type, event_time, element.get(self.partition_field), element.get(self.offset_field)
        )

    def add_inputs(self, accumulator: SessionClicks, elements: Iterable[Mapping[str, Any]]) -> SessionClicks:
        """``add_input`` of many events at once, with the same result: one new value instead of one per event, and
        each type's offsets sorted once. Added one at a time, a session's offsets cost a tuple copy per event (a
        user's offsets are not adjacent in a partition other users write too), quadratic in the session's events."""
        counts = {IMPRESSION: 0, CLICK: 0}
        coordinates: dict[str, list[tuple[int, int, int]]] = {IMPRESSION: [], CLICK: []}
        first: int | float | None = None
        last: int | float | None = None
        for element in elements:
            event_type, event_time = self._type_and_time(element)
            if event_type not in counts:
                raise _unknown_type(event_type)
            counts[event_type] += 1
            partition, offset = element.get(self.partition_field), element.get(self.offset_field)
            if offset is not None and partition is not None:
                coordinates[event_type].append((partition, offset, offset))
            if first is None or event_time < first:
                first = event_time
            if last is None or event_time > last:
                last = event_time
        if first is None:
            return accumulator
        added = SessionClicks(
            counts[IMPRESSION],
            counts[CLICK],
            first,
            last,
            OffsetRanges(coordinates[IMPRESSION]) if coordinates[IMPRESSION] else _NONE,
            OffsetRanges(coordinates[CLICK]) if coordinates[CLICK] else _NONE,
        )
        return accumulator.merge(added)

    def merge_accumulators(self, accumulators: Iterable[SessionClicks]) -> SessionClicks:
        merged = SessionClicks()
        for accumulator in accumulators:
            merged = merged.merge(accumulator)
        return merged

    def extract_output(self, accumulator: SessionClicks) -> SessionClicks:
        return accumulator


# ---- rides (seed 002) ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RideSession:
    """What one driver did in one session: rides, fares and distance, first and last ride, the zones driven from.

    ``driver`` is the driver's dimension row as of the session's latest ride (the enrichment joined one per ride;
    the latest wins so the value does not depend on the order rides were combined in). ``unknown_zone_rides`` counts
    rides whose zone the zone dimension did not hold. ``ride_offsets`` are the Kafka coordinates of the rides counted
    (when the rides carried them), so a reader can check that each ride is counted once across sessions.
    """

    rides: int = 0
    fare_total: float = 0.0
    distance_km: float = 0.0
    first_ride_time: int | None = None
    last_ride_time: int | None = None
    zones: frozenset[str] = frozenset()
    unknown_zone_rides: int = 0
    driver: tuple[Any, ...] = ()  # (event time, *driver columns) of the latest ride
    ride_offsets: OffsetRanges = _NONE

    def merge(self, other: RideSession) -> RideSession:
        """The aggregate of two disjoint sets of rides (commutative and associative, as two stages need)."""
        firsts = [t for t in (self.first_ride_time, other.first_ride_time) if t is not None]
        lasts = [t for t in (self.last_ride_time, other.last_ride_time) if t is not None]
        drivers = [d for d in (self.driver, other.driver) if d]
        return RideSession(
            self.rides + other.rides,
            # Fares are summed in cents so that the order of merging cannot change the total's last digit.
            round(self.fare_total * 100 + other.fare_total * 100) / 100,
            round(self.distance_km * 100 + other.distance_km * 100) / 100,
            min(firsts) if firsts else None,
            max(lasts) if lasts else None,
            self.zones | other.zones,
            self.unknown_zone_rides + other.unknown_zone_rides,
            max(drivers, key=_driver_order) if drivers else (),
            self.ride_offsets | other.ride_offsets,
        )


def _driver_order(driver: tuple[Any, ...]) -> tuple[Any, ...]:
    # By event time, then the columns as text (None first), so equal times still pick one row deterministically.
    return (driver[0], *("" if v is None else str(v) for v in driver[1:]))


class RideSessionFn(CombineFn):
    """Combines enriched ride events (mappings) into one ``RideSession`` per driver and window.

    Each ride needs ``event_time`` (epoch ms) and ``fare``; ``distance_km``, ``zone_id``, ``kafka_partition`` and
    ``kafka_offset`` are read when present; ``driver_columns`` are the driver dimension's columns carried into the
    session; a ride whose ``zone_column`` is None counts as an unknown zone. A ride without a time or fare raises
    ``ValueError`` naming the field (a silently skipped ride would make the totals wrong).
    """

    def __init__(self, driver_columns: tuple[str, ...] = (), zone_column: str | None = None) -> None:
        self.driver_columns = tuple(driver_columns)
        self.zone_column = zone_column

    def create_accumulator(self) -> RideSession:
        return RideSession()

    def add_input(self, accumulator: RideSession, element: Mapping[str, Any]) -> RideSession:
        try:
            when, fare = element["event_time"], element["fare"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"a ride needs fields 'event_time' and 'fare', got {element!r}") from exc
        if isinstance(when, bool) or not isinstance(when, int):
            raise ValueError(f"'event_time' must be epoch milliseconds (int), got {when!r}")
        partition, offset = element.get("kafka_partition"), element.get("kafka_offset")
        offsets = _NONE.add(partition, offset) if partition is not None and offset is not None else _NONE
        zone = element.get("zone_id")
        unknown = self.zone_column is not None and element.get(self.zone_column) is None
        one = RideSession(
            1,
            float(fare),
            float(element.get("distance_km") or 0.0),
            when,
            when,
            frozenset([zone]) if zone is not None else frozenset(),
            int(unknown),
            (when, *(element.get(c) for c in self.driver_columns)),
            offsets,
        )
        return accumulator.merge(one)

    def merge_accumulators(self, accumulators: Iterable[RideSession]) -> RideSession:
        merged = RideSession()
        for accumulator in accumulators:
            merged = merged.merge(accumulator)
        return merged

    def extract_output(self, accumulator: RideSession) -> RideSession:
        return accumulator

"""Ride traffic (``RideTrafficSpec``): the clicks generator's trouble plus unknown dimension keys, with the lateness
in the record itself, and dimension tables that hold every known key and none of the unknown ones."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

import pytest

from beamflow.cli.generate import register, spec_from_args
from beamflow.generate import (
    RIDE_EVENT_ID_FIELDS,
    RideTrafficSpec,
    TrafficSpec,
    generate_traffic,
    ride_dimensions,
)

pytestmark = pytest.mark.unit


def _encode(event: dict[str, Any], version: int) -> bytes:
    return json.dumps({"v": version, **event}).encode()


SPEC = RideTrafficSpec(events=20_000, users=500, zones=40, partitions=4, start_ms=1_767_225_600_000, seed=5)


def test_rides_carry_skew_duplicates_lateness_idle_partition_and_unknown_keys() -> None:
    traffic = generate_traffic(SPEC, _encode)
    counts = traffic.counts
    assert counts["records"] == len(traffic.records) == counts["events"] + counts["duplicate_sends"] + 25
    assert counts["events_v1"] == SPEC.events and "events_v2" not in counts
    events = [r for r in traffic.records if r.kind == "event"]
    assert all(r.event is not None for r in events)
    rides = [r.event for r in events if r.event is not None]

    # Skew: the top 1% of 500 drivers (5) drive about 22% of the rides.
    per_driver = Counter(e["driver_id"] for e in rides if not e["driver_id"].startswith("dx"))
    assert 0.19 < sum(n for _, n in per_driver.most_common(5)) / len(rides) < 0.25

    # Unknown keys: exactly the counted ones, none of them in the dimension tables, every known one in them.
    dims = ride_dimensions(SPEC)
    drivers, zones = {d["driver_id"] for d in dims.drivers}, {z["zone_id"] for z in dims.zones}
    unknown_drivers = [e for e in rides if e["driver_id"] not in drivers]
    unknown_zones = [e for e in rides if e["zone_id"] not in zones]
    assert len(unknown_drivers) == counts["unknown_driver_events"] and 150 < len(unknown_drivers) < 250
    assert len(unknown_zones) == counts["unknown_zone_events"] and 150 < len(unknown_zones) < 250
    assert all(e["driver_id"].startswith("dx") for e in unknown_drivers)

    # Keyed and partitioned by driver; the record timestamp is when it was sent, so lateness = timestamp - event time.
    assert all(r.key == r.event["driver_id"].encode() for r in events if r.event)
    lateness = Counter(r.timestamp_ms - r.event["event_time"] for r in events if r.event)
    assert lateness[SPEC.late_by_ms] == counts["late_events"] > 0
    assert lateness[SPEC.too_late_by_ms] == counts["too_late_events"] > 0
    assert lateness[0] == SPEC.events - counts["late_events"] - counts["too_late_events"]

    idle = [i for i, r in enumerate(events) if r.partition == SPEC.idle_partition]
    start, end = int(SPEC.idle_from * SPEC.events), int(SPEC.idle_until * SPEC.events)
    assert idle and not [i for i in idle if start <= i < end] and min(idle) < start and max(idle) >= end

    # Duplicates repeat bytes; distinct rides never share their identifying fields.
    originals = {r.value for r in events}
    assert all(r.value in originals for r in traffic.records if r.kind == "duplicate")
    assert max(Counter(tuple(e[f] for f in RIDE_EVENT_ID_FIELDS) for e in rides).values()) == 1


def test_dimensions_depend_on_the_key_counts_only() -> None:
    assert ride_dimensions(SPEC) == ride_dimensions(RideTrafficSpec(users=500, zones=40, seed=99))
    assert len(ride_dimensions(SPEC).drivers) == 500 and len(ride_dimensions(SPEC).zones) == 40
    assert generate_traffic(SPEC, _encode).records == generate_traffic(SPEC, _encode).records


def test_ride_traffic_has_one_schema() -> None:
    with pytest.raises(ValueError, match="v2_from"):
        RideTrafficSpec(v2_from=0.5)


def test_cli_picks_the_kind_and_refuses_the_other_kinds_flags() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    rides = spec_from_args(parser.parse_args(["generate", "--kind", "rides", "--events", "50", "--zones", "7"]))
    assert isinstance(rides, RideTrafficSpec) and rides.events == 50 and rides.zones == 7
    clicks = spec_from_args(parser.parse_args(["generate", "--events", "50"]))
    assert type(clicks) is TrafficSpec and clicks.v2_from == 0.5
    with pytest.raises(SystemExit, match="--zones"):
        spec_from_args(parser.parse_args(["generate", "--zones", "7"]))

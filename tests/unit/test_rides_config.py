"""The rides job's configuration (conf/rides.yaml in the typed config) and the pieces of the job that are plain
functions: the session aggregate, the results, their cells and Kafka records."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import apache_beam as beam
import pytest
from apache_beam.utils.timestamp import Timestamp

from beamflow.aggregates import RideSession, RideSessionFn
from beamflow.config import ConfigError, JobConfig, LookupConfig, load_job_config
from beamflow.kafka.offset_ranges import OffsetRanges
from pipelines.rides import (
    build_pipeline,
    current_results,
    for_runner,
    producer_record,
    result_cells,
    session_result,
)
from transforms.hot_key_aggregate import WindowedAggregate

pytestmark = pytest.mark.unit

CONF = Path(__file__).resolve().parents[2] / "conf" / "rides.yaml"


def test_the_shipped_conf_loads_with_idleness_lookups_and_both_sinks() -> None:
    config = load_job_config(CONF)
    assert config.kafka is not None and config.kafka.topic == "rides" and config.kafka.idle_timeout_ms == 60_000
    assert list(config.lookups) == ["drivers", "zones"]  # applied in this order
    drivers = config.lookups["drivers"]
    assert drivers == LookupConfig(
        table="drivers",
        key_field="driver_id",
        columns=("driver_name", "rating", "vehicle"),
        on_missing="dead_letter",
        cache_ttl_s=300.0,
        missing_ttl_s=30.0,
    )
    assert config.lookups["zones"].on_missing == "pass"
    assert config.kafka_sink is not None and config.kafka_sink.mode == "exactly-once"
    assert config.kafka_sink.group == "rides-sessions" and config.kafka_sink.bootstrap is None
    assert config.cells is not None and config.cells.salt_buckets == 16
    assert JobConfig.from_dict(config.to_dict()) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        drivers.table = "other"  # type: ignore[misc]


def test_unknown_keys_and_wrong_types_in_the_new_sections_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"lookups\.drivers\.on_mising: unknown key; did you mean 'on_missing'\?"):
        load_job_config(CONF, ["lookups.drivers.on_mising=pass"])
    with pytest.raises(ConfigError, match=r"lookups\.zones\.cache_ttl_s must be a number"):
        load_job_config(CONF, ["lookups.zones.cache_ttl_s=soon"])
    with pytest.raises(ConfigError, match=r"kafka_sink\.shard: unknown key; did you mean 'shards'\?"):
        load_job_config(CONF, ["kafka_sink.shard=2"])
    with pytest.raises(ConfigError, match=r"lookups\.extra\.table is required"):
        load_job_config(CONF, ["lookups.extra.key_field=x"])
    # Overrides reach into a named lookup; a whole sink can be switched off.
    config = load_job_config(CONF, ["lookups.zones.on_missing=dead_letter", "kafka_sink=null", "cells.salt_buckets=4"])
    assert config.lookups["zones"].on_missing == "dead_letter" and config.kafka_sink is None
    assert config.cells is not None and config.cells.salt_buckets == 4


def test_a_streaming_flink_run_reads_the_topic_as_a_stream() -> None:
    config = load_job_config(CONF)
    assert for_runner(config, "DirectRunner").flink is None
    flink = for_runner(config, "FlinkRunner")
    assert flink.kafka is not None and flink.kafka.bounded is False and flink.flink is not None


def test_the_job_refuses_a_conf_without_its_two_lookups() -> None:
    config = load_job_config(CONF)
    without = dataclasses.replace(config, lookups={"drivers": config.lookups["drivers"]})
    with pytest.raises(ValueError, match=r"lookups\.zones"):
        build_pipeline(beam.Pipeline(), without)


def _ride(t: int, fare: float, zone: str | None, offset: int, name: str = "Ada") -> dict[str, object]:
    return {
        "event_time": t,
        "fare": fare,
        "distance_km": 1.5,
        "zone_id": "z001" if zone else "zx1",
        "zone_name": zone,
        "driver_name": name,
        "rating": 4.5,
        "kafka_partition": 0,
        "kafka_offset": offset,
    }


def test_ride_sessions_combine_in_any_order_to_the_same_session() -> None:
    fn = RideSessionFn(("driver_name", "rating"), "zone_name")
    rides = [_ride(1000, 10.10, "zone 1", 5), _ride(3000, 0.2, None, 7, "Ada B."), _ride(2000, 5.35, "zone 1", 6)]
    one = fn.create_accumulator()
    for ride in rides:
        one = fn.add_input(one, ride)
    parts = [fn.add_input(fn.create_accumulator(), r) for r in reversed(rides)]
    merged = fn.merge_accumulators(parts)
    assert merged == one
    assert (one.rides, one.fare_total, one.first_ride_time, one.last_ride_time) == (3, 15.65, 1000, 3000)
    assert one.unknown_zone_rides == 1 and one.zones == frozenset({"z001", "zx1"})
    assert one.driver == (3000, "Ada B.", 4.5)  # the latest ride's driver row
    assert one.ride_offsets == OffsetRanges([(0, 5, 7)])
    with pytest.raises(ValueError, match="fare"):
        fn.add_input(fn.create_accumulator(), {"event_time": 1})


def test_a_result_its_cells_and_its_kafka_record() -> None:
    session = RideSession(
        rides=2,
        fare_total=12.5,
        distance_km=3.0,
        first_ride_time=1_000,
        last_ride_time=2_000,
        zones=frozenset({"z001"}),
        driver=(2_000, "Ada", 4.5, "van"),
        ride_offsets=OffsetRanges([(1, 10, 11)]),
    )
    agg = WindowedAggregate(
        "d00001",
        Timestamp(1),
        Timestamp(602),
        session,
        2,
        0,
        True,
        True,
        "ON_TIME",
        supersedes=((Timestamp(0.5), Timestamp(601)),),
    )
    result = session_result(agg, ("driver_name", "rating", "vehicle"))
    assert result["result_id"].startswith("d00001/1000/602000/0/")
    # The same pane over other rides (fired again after a restore) is another result.
    fewer = RideSession(rides=1, driver=(1, "Ada", 4.5, "van"), ride_offsets=OffsetRanges([(1, 10, 10)]))
    other = WindowedAggregate("d00001", Timestamp(1), Timestamp(602), fewer, 1, 0, True, True, "ON_TIME")
    assert session_result(other, ("driver_name", "rating", "vehicle"))["result_id"] != result["result_id"]
    assert result["driver_name"] == "Ada" and result["vehicle"] == "van" and result["ride_offsets"] == "1:10-11"
    assert result["supersedes"] == [[500, 601000]]

    cells = result_cells(result, ("driver_name", "rating", "vehicle"))
    row = b"d00001#0000000001000"
    assert {c.row for c in cells} == {row, b"d00001#0000000000500"}
    assert {c.timestamp for c in cells} == {2}  # the version is the ride count
    by_column = {c.column: c.value for c in cells if c.row == row}
    assert by_column["s:rides"] == b"2" and by_column["d:driver_name"] == b"Ada"
    assert by_column["s:ride_offsets"] == b"1:10-11"
    superseded = [c for c in cells if c.row != row]
    assert [(c.column, json.loads(c.value)) for c in superseded] == [("s:superseded_by", [1000, 602000])]

    record = producer_record(result)
    assert record.key == b"d00001" and record.record_id == result["result_id"] and record.timestamp_ms == 2_000
    assert json.loads(record.value or b"") == result


def _result(driver: str, start: int, end: int, rides: int, pane: int = 0, supersedes: Any = ()) -> dict[str, Any]:
    return {
        "driver_id": driver,
        "session_start": start,
        "session_end": end,
        "rides": rides,
        "pane_index": pane,
        "supersedes": [list(w) for w in supersedes],
    }


def test_current_results_keep_the_newest_pane_and_drop_what_a_merge_supersedes() -> None:
    # No failure: panes accumulate, and a late ride merging two sessions names both in supersedes.
    results = [
        _result("d1", 0, 600, 2),
        _result("d1", 0, 700, 3, pane=1),
        _result("d1", 1000, 1600, 1),
        _result("d1", 0, 1600, 5, pane=0, supersedes=[(0, 700), (1000, 1600)]),
        _result("d2", 0, 600, 1),
    ]
    got = sorted((r["driver_id"], r["session_start"], r["session_end"]) for r in current_results(results))
    assert got == [("d1", 0, 1600), ("d2", 0, 600)]


def test_a_session_replayed_in_another_shape_after_a_restore_replaces_the_stale_one() -> None:
    # Before the failure [100, 700) fired with 3 rides; after the restore the replay put a ride at 50 first, so the
    # session fired as [50, 700) with 4 rides and no supersedes naming [100, 700): the two share 3 rides.
    stale, fresh = _result("d1", 100, 700, 3), _result("d1", 50, 700, 4)
    assert current_results([stale, fresh]) == [fresh]
    assert current_results([fresh, stale]) == [fresh]  # whatever order the reader met them in
    # Sessions of one driver that do not overlap are both current, however many rides each holds.
    apart = [_result("d1", 0, 600, 9), _result("d1", 600, 1200, 1)]
    assert len(current_results(apart)) == 2

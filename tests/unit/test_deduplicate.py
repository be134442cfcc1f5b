"""DeduplicateEvents: the first copy passes, later copies go to quarantine with the reason; TTL by event time."""

from __future__ import annotations

import random
from typing import Any

import apache_beam as beam
import pytest
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.runners.direct.direct_runner import BundleBasedDirectRunner
from apache_beam.testing import test_stream
from apache_beam.transforms.window import Sessions, TimestampedValue
from apache_beam.utils.timestamp import Duration

from beamflow.aggregates import SessionClicksFn
from runners.direct import local_options
from tests.collected import collect, collected
from transforms.deduplicate import METRICS_NAMESPACE, DeduplicateEvents, QuarantinedEvent
from transforms.hot_key_aggregate import HotKeyAggregate, WindowedAggregate

pytestmark = pytest.mark.unit


def _timestamped(event: dict[str, Any]) -> TimestampedValue:
    return TimestampedValue(event, event["event_time"])


def run(events: list[Any], **dedup_args: Any) -> tuple[list[Any], list[QuarantinedEvent], dict[str, int]]:
    pipeline = beam.Pipeline(options=local_options())
    result = pipeline | beam.Create(events) | beam.Map(_timestamped) | DeduplicateEvents(**dedup_args)
    unique, quarantine = collect(result.unique, "Unique"), collect(result.quarantine, "Quarantine")
    run_result = pipeline.run()
    run_result.wait_until_finish()
    counters = {
        c.key.metric.name: c.committed
        for c in run_result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))["counters"]
    }
    return collected(unique), collected(quarantine), counters


def test_duplicates_go_to_quarantine_with_reason() -> None:
    events = [
        {"event_id": "a", "event_time": 10, "n": 1},
        {"event_id": "b", "event_time": 11, "n": 2},
        {"event_id": "a", "event_time": 12, "n": 3},
        {"event_id": "a", "event_time": 13, "n": 4},
    ]
    unique, quarantine, counters = run(events, ttl=Duration(seconds=3600))
    assert sorted(e["event_id"] for e in unique) == ["a", "b"]
    assert sorted(str(q.event_id) for q in quarantine) == ["a", "a"]
    kept_a = next(e for e in unique if e["event_id"] == "a")
    for q in quarantine:
        assert q.reason.startswith("duplicate of event id 'a' first seen at ")
        assert q.first_seen is not None and q.first_seen.micros == kept_a["event_time"] * 10**6
        assert q.event["n"] != kept_a["n"]  # the quarantined copy is the other one, carried whole
    assert counters == {"unique": 2, "duplicates": 2}


def test_missing_id_is_quarantined_not_dropped() -> None:
    unique, quarantine, counters = run(
        [{"event_time": 1}, {"event_id": None, "event_time": 2}, {"event_id": "x", "event_time": 3}]
    )
    assert [e["event_id"] for e in unique] == ["x"]
    assert len(quarantine) == 2
    assert all(q.event_id is None and "missing event id" in q.reason for q in quarantine)
    assert counters["missing_id"] == 2


def test_id_function_for_non_mapping_events() -> None:
    events = [{"event_time": t, "payload": ("k", t % 3)} for t in range(9)]
    unique, quarantine, _ = run(events, id_fn=lambda e: e["payload"])
    assert sorted(e["payload"] for e in unique) == [("k", 0), ("k", 1), ("k", 2)]
    assert len(quarantine) == 6


def test_state_expires_by_event_time_ttl() -> None:
    # Needs a moving watermark: TestStream on BundleBasedDirectRunner (FnApiRunner does not run TestStream in 2.62).
    def event(t: int) -> TimestampedValue:
        return TimestampedValue({"event_id": "a", "event_time": t}, t)

    stream = (
        test_stream.TestStream()
        .advance_watermark_to(0)
        .add_elements([event(0), event(50)])  # 50 is within the TTL of the copy at 0: a duplicate
        .advance_watermark_to(200)  # past 0 + ttl: the id's state expires
        .add_elements([event(150)])  # a copy again, but the id has been forgotten: passes
        .advance_watermark_to_infinity()
    )
    options = PipelineOptions()
    options.view_as(StandardOptions).streaming = True
    pipeline = beam.Pipeline(runner=BundleBasedDirectRunner(), options=options)
    result = pipeline | stream | DeduplicateEvents(ttl=Duration(seconds=100))
    unique, quarantine = collect(result.unique, "Unique"), collect(result.quarantine, "Quarantine")
    pipeline.run().wait_until_finish()
    assert sorted(e["event_time"] for e in collected(unique)) == [0, 150]
    assert [q.event["event_time"] for q in collected(quarantine)] == [50]


def test_bad_ttl_is_refused() -> None:
    with pytest.raises(ValueError, match="ttl"):
        DeduplicateEvents(ttl=0)


def _keyed(event: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return event["user"], event


def test_replayed_duplicates_are_counted_once_in_aggregates() -> None:
    rng = random.Random(11)
    originals = [
        {
            "event_id": f"e{i}",
            "user": "hot" if rng.random() < 0.4 else f"u{rng.randrange(20)}",
            "event_time": round(rng.uniform(0, 7200), 3),
            "event_type": "click" if rng.random() < 0.2 else "impression",
        }
        for i in range(300)
    ]
    # A replay after a restart: a slice of the stream arrives again, whole events, same ids and times.
    replayed = [dict(e) for e in originals[100:160]]
    events = originals + replayed
    rng.shuffle(events)

    pipeline = beam.Pipeline(options=local_options())
    deduped = pipeline | beam.Create(events) | beam.Map(_timestamped) | DeduplicateEvents(ttl=Duration(seconds=86400))
    rows = (
        deduped.unique
        | beam.Map(_keyed)
        | HotKeyAggregate(SessionClicksFn(), windowfn=Sessions(600), hot_keys={"hot"}, fanout=4)
    )
    got_rows, got_quarantine = collect(rows, "Rows"), collect(deduped.quarantine, "Quarantine")
    pipeline.run().wait_until_finish()

    aggregates: list[WindowedAggregate] = collected(got_rows)
    assert sum(r.value.events for r in aggregates) == len(originals)
    assert sum(r.input_count for r in aggregates) == len(originals)
    quarantined: list[QuarantinedEvent] = collected(got_quarantine)
    assert sorted(str(q.event_id) for q in quarantined) == sorted(str(e["event_id"]) for e in replayed)
    # Per user, each original event counted exactly once.
    per_user: dict[str, int] = {}
    for e in originals:
        per_user[str(e["user"])] = per_user.get(str(e["user"]), 0) + 1
    got_per_user: dict[str, int] = {}
    for r in aggregates:
        got_per_user[r.key] = got_per_user.get(r.key, 0) + r.value.events
    assert got_per_user == per_user

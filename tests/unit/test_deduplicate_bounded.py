"""DeduplicateEvents on bounded input in a batch run: the GroupByKey path gives the stateful path's guarantee.

The stateful path runs on the same runner with ``--streaming`` (FnApiRunner honours the flag only in the
transform's choice of path), so both are compared on identical input.
"""

from __future__ import annotations

import random
from typing import Any

import apache_beam as beam
import pytest
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.transforms import trigger
from apache_beam.transforms.window import FixedWindows, GlobalWindows, Sessions, TimestampedValue
from apache_beam.utils.timestamp import Duration, Timestamp

from runners.direct import local_options
from tests.collected import collect, collected
from transforms.deduplicate import METRICS_NAMESPACE, DeduplicateEvents, QuarantinedEvent

pytestmark = pytest.mark.unit


def _timestamped(event: dict[str, Any]) -> TimestampedValue:
    return TimestampedValue(event, event["event_time"])


def _labels(pipeline: beam.Pipeline) -> set[str]:
    return {t.unique_name.rsplit("/", 1)[-1] for t in pipeline.to_runner_api().components.transforms.values()}


def run(
    events: list[dict[str, Any]], streaming: bool = False, window: Any = None, **dedup_args: Any
) -> tuple[list[Any], list[Any], dict[str, int], set[str]]:
    pipeline = beam.Pipeline(options=local_options(streaming=streaming))
    timed = pipeline | beam.Create(events) | beam.Map(_timestamped)
    if window is not None:
        timed = timed | window
    result = timed | DeduplicateEvents(**dedup_args)
    unique, quarantine = (
        collect(result.unique, "Unique", with_time=True),
        collect(result.quarantine, "Quarantine", with_time=True),
    )
    run_result = pipeline.run()
    run_result.wait_until_finish()
    counters = {
        c.key.metric.name: c.committed
        for c in run_result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))["counters"]
    }
    return collected(unique), collected(quarantine), counters, _labels(pipeline)


def test_bounded_batch_takes_the_grouped_path_and_streaming_the_stateful_one() -> None:
    events = [{"event_id": "a", "event_time": 1}]
    *_, batch_labels = run(events)
    *_, streaming_labels = run(events, streaming=True)
    assert "CopiesPerId" in batch_labels and "FirstCopyPerId" not in batch_labels
    assert "FirstCopyPerId" in streaming_labels and "CopiesPerId" not in streaming_labels


def test_auto_strategy_rule_and_position_fn_without_table_warns() -> None:
    batch = beam.Pipeline(options=local_options()) | beam.Create([{"event_id": "a"}])
    streaming = beam.Pipeline(options=local_options(streaming=True)) | beam.Create([{"event_id": "a"}])
    sessions = batch | beam.WindowInto(Sessions(60))
    assert DeduplicateEvents().chosen_strategy(batch) == "grouped"
    assert DeduplicateEvents().chosen_strategy(streaming) == "state"
    assert DeduplicateEvents().chosen_strategy(sessions) == "state"  # merging windows: one group is not every copy
    assert DeduplicateEvents(strategy="state").chosen_strategy(batch) == "state"
    with pytest.warns(UserWarning, match="position_fn has no effect without table="):
        DeduplicateEvents(position_fn=lambda event: ("t", 0, 0))


def test_grouped_path_equals_stateful_path_on_replayed_sends() -> None:
    # As in the clicks job: a duplicate send is the same event (same id, same event time), sent again.
    rng = random.Random(5)
    originals = [{"event_id": f"e{i}", "event_time": rng.randrange(0, 7200), "n": i} for i in range(400)]
    events = originals + [dict(rng.choice(originals), copy=k) for k in range(120)]
    events += [{"event_time": 5}, {"event_id": None, "event_time": 6}]  # no id: quarantined on both paths
    rng.shuffle(events)
    grouped = run(events, ttl=3600)
    stateful = run(events, streaming=True, ttl=3600)
    for unique, quarantine, counters, _ in (grouped, stateful):
        assert sorted(e["event_id"] for e, _, _ in unique) == [f"e{i}" for i in sorted(range(400), key=str)]
        assert sorted(str(q.event_id) for q, _, _ in quarantine) == sorted(
            [str(e.get("event_id")) for e in events if "copy" in e] + ["None", "None"]
        )
        assert counters == {"unique": 400, "duplicates": 120, "missing_id": 2}
    # Same reasons and first-seen times (copies share the event time, so either copy gives the same row).
    assert sorted((str(q.event_id), q.reason, q.first_seen) for q, _, _ in grouped[1]) == sorted(
        (str(q.event_id), q.reason, q.first_seen) for q, _, _ in stateful[1]
    )


def test_outputs_keep_each_events_own_time_and_window() -> None:
    events = [
        {"event_id": "a", "event_time": 30},
        {"event_id": "a", "event_time": 40},
        {"event_id": "b", "event_time": 70},
    ]
    unique, quarantine, _, _ = run(events, ttl=3600, window=beam.WindowInto(FixedWindows(60)))
    assert sorted((e["event_time"], ts, (w.start, w.end)) for e, ts, w in unique) == [
        (30, Timestamp(30), (Timestamp(0), Timestamp(60))),
        (70, Timestamp(70), (Timestamp(60), Timestamp(120))),
    ]
    [(q, ts, w)] = quarantine
    assert q.event["event_time"] == 40 and ts == Timestamp(40) and (w.start, w.end) == (Timestamp(0), Timestamp(60))


def test_earliest_copy_is_kept_whatever_the_arrival_order() -> None:
    events = [{"event_id": "a", "event_time": t, "n": t} for t in (50, 10, 30)]
    unique, quarantine, _, _ = run(events, ttl=Duration(seconds=100))
    assert [e["n"] for e, _, _ in unique] == [10]
    assert sorted(q.event["n"] for q, _, _ in quarantine) == [30, 50]
    assert all(
        q.first_seen == Timestamp(10) and "first seen at 1970-01-01T00:00:10Z" in q.reason for q, _, _ in quarantine
    )


def test_ttl_expires_in_event_time() -> None:
    # ttl 100: 50 is within the TTL of 0; 150 is past 0 + 100 (the id's state would have expired): kept, and starts
    # a new TTL, within which 200 is a duplicate of 150; 250 is exactly 150 + 100: kept again.
    events = [{"event_id": "a", "event_time": t} for t in (200, 0, 150, 50, 250)]
    unique, quarantine, counters, _ = run(events, ttl=Duration(seconds=100))
    assert sorted(e["event_time"] for e, _, _ in unique) == [0, 150, 250]
    assert sorted((q.event["event_time"], q.first_seen) for q, _, _ in quarantine) == [
        (50, Timestamp(0)),
        (200, Timestamp(150)),
    ]
    assert counters == {"unique": 3, "duplicates": 2}


def test_early_firing_trigger_keeps_the_stateful_path() -> None:
    # With a trigger that fires before the end of the window, one group would not hold every copy of an id.
    window = beam.WindowInto(
        GlobalWindows(),
        trigger=trigger.Repeatedly(trigger.AfterCount(1)),
        accumulation_mode=trigger.AccumulationMode.DISCARDING,
    )
    unique, quarantine, _, labels = run(
        [{"event_id": "a", "event_time": 1}, {"event_id": "a", "event_time": 2}], window=window
    )
    assert "FirstCopyPerId" in labels and "CopiesPerId" not in labels
    assert len(unique) == 1 and len(quarantine) == 1
    assert isinstance(quarantine[0][0], QuarantinedEvent)

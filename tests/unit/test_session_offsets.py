"""Offset ranges (the Kafka records a session counts), SessionClicks.union, the local runner's streaming refusal."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from beamflow.aggregates import SessionClicks, SessionClicksFn
from beamflow.kafka.offset_ranges import OffsetRanges
from pipelines.clicks import pipeline_options, session_input

pytestmark = pytest.mark.unit

coordinates = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 60)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(coordinates, coordinates)
def test_offset_ranges_are_sets(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> None:
    ra, rb = OffsetRanges.of(a), OffsetRanges.of(b)
    assert len(ra) == len(set(a))
    assert len(ra | rb) == len(set(a) | set(b))
    assert ra | rb == rb | ra
    assert OffsetRanges.decode(ra.encode()) == ra
    added = OffsetRanges()
    for p, o in a:
        added = added.add(p, o)
    assert added == ra
    assert all(c in ra for c in a)


click_events = st.lists(
    st.fixed_dictionaries(
        {"event_type": st.sampled_from(["impression", "click"]), "event_time": st.integers(0, 10_000)},
        optional={"kafka_partition": st.integers(0, 3), "kafka_offset": st.integers(0, 40)},
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(click_events, click_events)
def test_add_inputs_equals_adding_one_event_at_a_time(before: list[dict], events: list[dict]) -> None:
    fn = SessionClicksFn()
    start = fn.create_accumulator()
    for event in before:
        start = fn.add_input(start, event)
    one_by_one = start
    for event in events:
        one_by_one = fn.add_input(one_by_one, event)
    assert fn.add_inputs(start, events) == one_by_one


def test_add_inputs_refuses_what_add_input_refuses() -> None:
    fn = SessionClicksFn()
    for bad, message in (
        ({"event_type": "view", "event_time": 1}, "unknown event type 'view'"),
        ({"event_type": "click"}, "needs fields"),
        ({"event_type": "click", "event_time": "soon"}, "must be a number"),
    ):
        for add in (
            lambda e: fn.add_input(fn.create_accumulator(), e),
            lambda e: fn.add_inputs(fn.create_accumulator(), [e]),
        ):
            with pytest.raises(ValueError, match=message):
                add(bad)


def test_offset_ranges_text_form() -> None:
    ranges = OffsetRanges.of([(0, 100), (0, 101), (0, 102), (0, 190), (2, 5), (2, 6)])
    assert ranges.encode() == "0:100-102,190;2:5-6"
    assert OffsetRanges.decode("") == OffsetRanges() and OffsetRanges().encode() == ""
    with pytest.raises(ValueError, match="offset range list"):
        OffsetRanges.decode("0:x")


def test_union_counts_shared_events_once_and_merge_adds() -> None:
    fn = SessionClicksFn()

    def session(*events: tuple[str, int, int]) -> SessionClicks:
        acc = fn.create_accumulator()
        for kind, time, offset in events:
            acc = fn.add_input(
                acc, {"event_type": kind, "event_time": time, "kafka_partition": 0, "kafka_offset": offset}
            )
        return acc

    stored = session(("impression", 10, 1), ("click", 20, 2))
    replay = session(("click", 20, 2), ("impression", 30, 3))
    merged = stored.union(replay)
    assert (merged.impressions, merged.clicks, merged.first_event_time, merged.last_event_time) == (2, 1, 10, 30)
    assert merged.union(replay) == merged == replay.union(stored)
    assert stored.merge(replay).events == 4  # Beam's merge: disjoint inputs
    with pytest.raises(ValueError, match="Kafka coordinates"):
        stored.union(SessionClicks(impressions=1))


def test_session_input_carries_the_kafka_coordinates() -> None:
    event = {
        "user_id": "u",
        "event_type": "click",
        "event_time": 5,
        "event_id": "e",
        "_kafka": {"partition": 2, "offset": 9, "topic": "t"},
    }
    assert session_input(event) == (
        "u",
        {"event_type": "click", "event_time": 5, "event_id": "e", "kafka_partition": 2, "kafka_offset": 9},
    )


def test_the_local_runner_refuses_a_streaming_read() -> None:
    with pytest.raises(SystemExit, match=r"FlinkRunner.*Prism") as refused:
        pipeline_options("DirectRunner", [], {"kafka": {"topic": "clicks", "group_id": "g", "bounded": False}})
    assert "\n" not in str(refused.value)
    assert pipeline_options("DirectRunner", [], {"kafka": {"topic": "clicks", "group_id": "g", "bounded": True}})

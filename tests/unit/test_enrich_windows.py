"""``Enrich`` on the local runner with an in-memory lookup that answers late: every element leaves with its own
timestamp, window(s) and pane, whether its row came from the cache inside its ``process`` call or from a batch that
finished later; sliding windows give one output per window; the missing-key policy holds on both paths."""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import apache_beam as beam
import pytest
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.transforms.window import FixedWindows, IntervalWindow, SlidingWindows, TimestampedValue
from apache_beam.utils.windowed_value import PANE_INFO_UNKNOWN

from runners.direct import local_options
from transforms.enrich import METRICS_NAMESPACE, Enrich, _EnrichFn

pytestmark = pytest.mark.unit

T0 = 1_700_000_000
KEYS = 40  # k0..k39; every key divisible by 10 is unknown to the lookup
_SEEN: dict[str, list[Any]] = {}


class SlowRows:
    """A lookup source in memory that takes ``delay_s`` per batch, so answers come after their elements' calls."""

    columns = ("name",)

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __enter__(self) -> SlowRows:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def is_transient(self, exc: BaseException) -> bool:
        return False

    def cache_key(self, key: Hashable) -> Hashable:
        return key

    def lookup(self, keys: Sequence[Hashable]) -> dict[Hashable, Mapping[str, Any]]:
        time.sleep(self.delay_s)
        return {k: {"name": f"name of {k}"} for k in keys if int(str(k)[1:]) % 10}


class _Keep(beam.DoFn):
    def __init__(self, token: str) -> None:
        self.token = token

    def process(
        self,
        element: Any,
        timestamp: Any = beam.DoFn.TimestampParam,
        window: Any = beam.DoFn.WindowParam,
        pane: Any = beam.DoFn.PaneInfoParam,
    ) -> Iterator[Any]:
        _SEEN.setdefault(self.token, []).append((element, timestamp, window, pane))
        return iter(())


def _keep(pcoll: beam.PCollection, token: str) -> None:
    _SEEN[token] = []
    pcoll | f"Keep{token}" >> beam.ParDo(_Keep(token))


def _events(n: int) -> list[TimestampedValue]:
    # Each key's first events miss; its later ones hit the cache (or join the lookup still in flight).
    return [TimestampedValue({"id": i, "k": f"k{i % KEYS}"}, T0 + 7 * i) for i in range(n)]


def _enrich(**kw: Any) -> Enrich:
    args: dict[str, Any] = {"key_field": "k", "max_batch_size": 4, "max_in_flight": 2, "on_missing": "dead_letter"}
    return Enrich(SlowRows(0.01), **{**args, **kw})


def _run(windowing: Any, enrich: Enrich | None = None, fn: _EnrichFn | None = None, n: int = 600) -> Any:
    p = beam.Pipeline(options=local_options())
    events = p | beam.Create(_events(n)) | "Window" >> beam.WindowInto(windowing)
    _keep(events, "input")
    if fn is not None:
        out = events | "Lean" >> beam.ParDo(fn).with_outputs("dead_letters", main="enriched")
        enriched, dead = out["enriched"], out["dead_letters"]
    else:
        assert enrich is not None
        result = events | enrich
        enriched, dead = result.enriched, result.dead_letters
    _keep(enriched, "enriched")
    _keep(dead, "dead")
    run = p.run()
    run.wait_until_finish()
    return run


def _counter(run: Any, name: str) -> int:
    found = run.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE).with_name(name))["counters"]
    return int(sum(c.committed or 0 for c in found))


def _check_outputs(per_element_windows: int) -> None:
    """Each input (element, window) once on exactly one output, with the input's timestamp, window and pane."""
    expected = {(e["id"], w): (t, pane) for e, t, w, pane in _SEEN.pop("input")}
    assert len(expected) == len({i for i, _ in expected}) * per_element_windows
    got: dict[tuple[int, Any], Any] = {}
    for e, t, w, pane in _SEEN.pop("enriched"):
        assert (e["id"], w) not in got, "an element came out twice in one window"
        got[(e["id"], w)] = (t, pane)
        assert e["name"] == f"name of {e['k']}"
    for d, t, w, pane in _SEEN.pop("dead"):
        ident = int(d.payload.decode().split('"id": ')[1].split(",")[0])
        assert (ident, w) not in got, "an element came out twice in one window"
        assert d.error == "MissingKey" and int(d.reason.rsplit("'k", 1)[1].rstrip("'")) % 10 == 0
        got[(ident, w)] = (t, pane)
    assert got == expected


def test_fixed_windows_keep_timestamps_windows_and_panes_on_both_paths() -> None:
    run = _run(FixedWindows(60), _enrich(cache_size=1000))
    # Both paths were taken: answers from the cache inside process, and answers from batches that finished later.
    assert _counter(run, "cache_hits") > 100
    assert _counter(run, "batches") >= KEYS // 4
    _check_outputs(per_element_windows=1)


def test_cache_off_every_answer_arrives_late_and_keeps_its_window() -> None:
    run = _run(FixedWindows(60), _enrich(cache_size=0))
    assert _counter(run, "cache_hits") == 0
    _check_outputs(per_element_windows=1)


def test_sliding_windows_give_one_output_per_window() -> None:
    _run(SlidingWindows(60, 30), _enrich(cache_size=1000))
    _check_outputs(per_element_windows=2)


def test_answers_finished_during_a_multi_window_element_are_held_not_multiplied() -> None:
    # The lean DoFn forced onto sliding windows (Enrich itself picks the per-window one there): Beam would multiply
    # the windows of a late answer yielded while a two-window element is current, so such answers must be held.
    enrich = _enrich(cache_size=1000)
    _run(SlidingWindows(60, 30), fn=_EnrichFn(*enrich._fn_args))
    _check_outputs(per_element_windows=2)


def test_panes_after_a_group_by_key_are_kept() -> None:
    p = beam.Pipeline(options=local_options())
    grouped = (
        p
        | beam.Create(list(range(600)))
        | beam.Map(lambda i: TimestampedValue((f"k{i % KEYS}", i), T0 + 7 * i))
        | beam.WindowInto(FixedWindows(600))
        | beam.GroupByKey()
        | beam.Map(lambda kv: {"id": hash((kv[0], min(kv[1]))) & 0xFFFFFF, "k": kv[0], "n": len(kv[1])})
    )
    _keep(grouped, "input")
    result = grouped | _enrich(cache_size=1000, on_missing="pass")
    _keep(result.enriched, "enriched")
    _keep(result.dead_letters, "dead")
    p.run().wait_until_finish()
    inputs = {(e["id"], w): (t, pane) for e, t, w, pane in _SEEN.pop("input")}
    assert all(pane != PANE_INFO_UNKNOWN for _, pane in inputs.values())  # the GroupByKey's panes, not the default
    outputs = {(e["id"], w): (t, pane) for e, t, w, pane in _SEEN.pop("enriched")}
    assert outputs == inputs and _SEEN.pop("dead") == []


def test_window_of_each_output_is_its_elements() -> None:
    # A spot check of the arithmetic the other tests compare against the input: element i sits in [t - t % 60, +60).
    _run(FixedWindows(60), _enrich(cache_size=1000), n=50)
    for e, t, w, _ in _SEEN.pop("enriched"):
        start = (T0 + 7 * e["id"]) // 60 * 60
        assert t.micros == (T0 + 7 * e["id"]) * 1_000_000 and w == IntervalWindow(start, start + 60)
    _SEEN.clear()

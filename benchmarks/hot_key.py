"""Hot-key benchmark: per-key load of the aggregation stage, and throughput, with and without hot-key fanout.

Workload: the seed's skew, 1% of users produce 22% of the click events, over a few hours of event time.
Prints, as ratios against the plain ``WindowInto + CombinePerKey`` baseline measured in the same run:

- the largest number of records one aggregation key (key, or (key, shard) with fanout) receives: the work one
  worker must do for the hottest key however many workers there are;
- end-to-end throughput (events/s) of HotKeyAggregate with configured hot keys and with detected ones.

On the local runner (FnApiRunner, one worker) fanout can only cost time: there is no second worker to take the
shards. The per-shard load is what carries over to Flink, where shards spread over parallel subtasks. With
``--window sessions`` this is a bounded batch run, where HotKeyAggregate lifts every key (partial sessions per bundle)
instead of fanning out hot ones: "configured" and "detected" then run the same lifted path, and the per-key load
figure describes fanout (the streaming path), not that run.

    .venv/bin/python -m benchmarks.hot_key --events 200000 --window sessions
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import apache_beam as beam
from apache_beam.transforms.combiners import CountCombineFn
from apache_beam.transforms.window import FixedWindows, GlobalWindows, Sessions, TimestampedValue, WindowFn

from runners.direct import local_options
from transforms.hot_key_aggregate import HotKeyAggregate, HotKeyDetection
from transforms.hot_key_aggregate.fanout import _RouteByHotness

CHUNK = 10_000
_RESULTS: dict[str, list[Any]] = {}


def hot_users(users: int) -> list[str]:
    return [f"u{i}" for i in range(max(1, users // 100))]


class _Generate(beam.DoFn):
    """Events of one chunk, generated in the pipeline (``beam.Create`` of many dicts would dominate the timing)."""

    def __init__(self, users: int, hot_share: float, span_s: float) -> None:
        self.users, self.hot_share, self.span_s = users, hot_share, span_s

    def process(self, chunk: int) -> Iterator[TimestampedValue]:
        rng = random.Random(chunk)
        n_hot = max(1, self.users // 100)
        for i in range(CHUNK):
            user = rng.randrange(n_hot) if rng.random() < self.hot_share else rng.randrange(n_hot, self.users)
            event_id = chunk * CHUNK + i
            yield TimestampedValue((f"u{user}", event_id), rng.uniform(0, self.span_s))


class _Collect(beam.DoFn):
    def __init__(self, token: str) -> None:
        self.token = token

    def process(self, element: Any) -> Iterator[Any]:
        _RESULTS[self.token].append(element)
        return iter(())


def _shard_by_event_id(event_id: int) -> int:
    return event_id


def run(build: Callable[[beam.PCollection], beam.PCollection], args: argparse.Namespace) -> tuple[float, list[Any]]:
    """Runs generate -> build -> collect; returns wall seconds and the collected output."""
    token = uuid.uuid4().hex
    _RESULTS[token] = []
    pipeline = beam.Pipeline(options=local_options())
    events = (
        pipeline
        | beam.Create(range(args.events // CHUNK))
        | beam.ParDo(_Generate(args.users, args.hot_share, args.hours * 3600))
    )
    build(events) | "Global" >> beam.WindowInto(GlobalWindows()) | "Collect" >> beam.ParDo(_Collect(token))
    start = time.perf_counter()
    pipeline.run().wait_until_finish()
    return time.perf_counter() - start, _RESULTS.pop(token)


def _window_row(kv: tuple[Any, int], window: Any = beam.DoFn.WindowParam) -> Iterator[tuple[Any, ...]]:
    yield kv[0], window.start, window.end, kv[1]


def _count_per_aggregation_key(
    fanout: int | None, hot: frozenset[str]
) -> Callable[[beam.PCollection], beam.PCollection]:
    """Records per aggregation-stage key: user without fanout, (user, shard) for hot users with it."""

    def build(events: beam.PCollection) -> beam.PCollection:
        if fanout is None:
            keys = events | "Keys" >> beam.Keys()
        else:
            routed = events | beam.ParDo(_RouteByHotness(hot, fanout, _shard_by_event_id)).with_outputs(
                "hot", main="cold"
            )
            keys = (routed.cold | "ColdKeys" >> beam.Keys(), routed.hot | "HotKeys" >> beam.Keys()) | beam.Flatten()
        return keys | beam.combiners.Count.PerElement() | beam.Values() | beam.combiners.Top.Of(1)

    return build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=100_000, help="events (rounded down to 10k)")
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--hot-share", type=float, default=0.22, help="share of events from the top 1%% of users")
    parser.add_argument("--hours", type=float, default=4.0, help="event-time span")
    parser.add_argument("--fanout", type=int, default=16)
    parser.add_argument("--window", choices=["sessions", "fixed"], default="sessions")
    args = parser.parse_args(argv)
    if args.events < CHUNK:
        parser.error(f"--events must be at least {CHUNK}")
    n = args.events // CHUNK * CHUNK
    windowfn: WindowFn = Sessions(600) if args.window == "sessions" else FixedWindows(600)
    hot = frozenset(hot_users(args.users))

    _, [[max_key]] = run(_count_per_aggregation_key(None, hot), args)
    _, [[max_shard]] = run(_count_per_aggregation_key(args.fanout, hot), args)

    def plain(events: beam.PCollection) -> beam.PCollection:
        return events | beam.WindowInto(windowfn) | beam.CombinePerKey(CountCombineFn()) | beam.ParDo(_window_row)

    def configured(events: beam.PCollection) -> beam.PCollection:
        rows = events | HotKeyAggregate(
            CountCombineFn(), windowfn=windowfn, hot_keys=hot, fanout=args.fanout, shard_by=_shard_by_event_id
        )
        return rows | beam.Map(lambda r: (r.key, r.window_start, r.window_end, r.value))

    def detected(events: beam.PCollection) -> beam.PCollection:
        rows = events | HotKeyAggregate(
            CountCombineFn(),
            windowfn=windowfn,
            detect=HotKeyDetection(min_share=0.005, sample_every=10),
            fanout=args.fanout,
            shard_by=_shard_by_event_id,
        )
        return rows | beam.Map(lambda r: (r.key, r.window_start, r.window_end, r.value))

    base_s, base_rows = run(plain, args)
    conf_s, conf_rows = run(configured, args)
    det_s, det_rows = run(detected, args)
    same = sorted(base_rows, key=repr) == sorted(conf_rows, key=repr) == sorted(det_rows, key=repr)

    print(
        f"workload: {n} events, {args.users} users, top 1% = {len(hot)} users with {args.hot_share:.0%} of events, "
        f"{args.window} windows of 10 min, fanout {args.fanout}, FnApiRunner (1 worker)"
    )
    print(
        f"max records per aggregation key: no fanout {max_key}, with fanout {max_shard} "
        f"-> ratio {max_shard / max_key:.3f} (hottest key's share of events: {max_key / n:.2%})"
    )
    print(f"throughput plain CombinePerKey:        {n / base_s:10.0f} events/s  (baseline, 1.00)")
    print(f"throughput HotKeyAggregate configured: {n / conf_s:10.0f} events/s  ratio {base_s / conf_s:.2f}")
    print(f"throughput HotKeyAggregate detected:   {n / det_s:10.0f} events/s  ratio {base_s / det_s:.2f}")
    print(f"results identical to plain CombinePerKey: {same} ({len(base_rows)} (key, window) results)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

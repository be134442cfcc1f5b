"""Hot-key benchmark on the real Flink session cluster: per-subtask load of the aggregation stage, with and without
hot-key fanout, read from Flink's REST API.

Workload (the seed's skew, as in ``benchmarks/hot_key.py``): 1% of users produce 22% of the click events, spread
over a few hours of event time, generated inside the pipeline from a bounded ``Create`` of chunk numbers. Two jobs go
to the session cluster ``ServiceSet(data=.data/hotbench)`` starts (``--runner=FlinkRunner --job_endpoint=...
--environment_type=LOOPBACK``, parallelism 2 by default), each running ``HotKeyAggregate(CountCombineFn())``:

- ``no-fanout``: ``hot_keys=()`` and ``detect=None``, so every key takes the plain ``WindowInto + CombinePerKey`` path;
- ``fanout``: the top 1% of users configured as hot keys (or ``--hot detected``: ``HotKeyDetection``), spread over
  ``--fanout`` shards and combined in two stages.

Reported, as ratios against the no-fanout job of the same run:

- records per subtask of every aggregation vertex (Flink vertex whose name holds the Beam label of a CombinePerKey:
  ``CombineCold``, ``CombineShards``, ``MergeShards``), the task's ``read-records`` (= ``numRecordsIn``) from
  ``/jobs/<id>/vertices/<vid>``; compared: the largest one over those vertices and subtasks, and the largest sum per
  slot (subtask i of every aggregation vertex; Flink's default slot sharing co-locates them);
- the largest number of records one aggregation key receives (user, or (user, shard) with fanout), computed from the
  same generator and shard function in this process: the work one subtask must do for the hottest key however many
  subtasks there are; and a model (not a measurement) of the busiest subtask at larger parallelism, keys spread by a
  stable hash, to show from where on the hottest key rather than the hash spread sets the per-subtask maximum;
- throughput, events / job duration (``/jobs/<id>``: start to end as Flink records it, submission not included);
- whether both jobs wrote the same (key, window, count) rows (each LOOPBACK worker runs in this process and writes its
  rows to files under the data folder).

Execution mode: streaming (as in production) WITHOUT checkpointing. With checkpointing on, end-of-input windows of a
bounded source were measured to go missing on Beam 2.62 + Flink 1.19 (see ``runners/flink.py``); batch mode would
lift combiners (a partial combine before the shuffle), so the aggregation vertex would count partial accumulators per
bundle, not events.

    .venv/bin/python -m benchmarks.hot_key_flink --events 100000 --parallelism 2

The cluster is started if needed and stopped at the end (``--keep-cluster`` leaves it up for another run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
from apache_beam.runners.runner import PipelineState
from apache_beam.transforms.combiners import CountCombineFn
from apache_beam.transforms.window import FixedWindows, Sessions, WindowFn

from beamflow.flink_rest import FlinkRest
from beamflow.services import ServiceSet, ServiceState
from benchmarks.hot_key import CHUNK, _Generate, _shard_by_event_id, hot_users
from runners.flink import options_for_service
from transforms.hot_key_aggregate import HotKeyAggregate, HotKeyDetection, WindowedAggregate
from transforms.hot_key_aggregate.common import _stable_hash

# Beam labels of the CombinePerKey steps inside HotKeyAggregate: the aggregation stage.
AGGREGATION_LABELS = ("CombineCold", "CombineShards", "MergeShards")
MODEL_PARALLELISM = (2, 4, 16, 64, 256)


class _WriteRows(beam.DoFn):
    """Writes each bundle's rows to its own file: the LOOPBACK workers run in this process, so the files are local."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self._rows: list[list[Any]] = []

    def start_bundle(self) -> None:
        self._rows = []

    def process(self, row: WindowedAggregate) -> Iterator[None]:
        self._rows.append(
            [str(row.key), row.window_start.micros, row.window_end.micros, row.value, row.input_count, row.pane_index]
        )
        return iter(())

    def finish_bundle(self) -> None:
        if self._rows:
            path = os.path.join(self.out_dir, f"{uuid.uuid4().hex}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(self._rows, f)
            os.replace(path + ".tmp", path)
        self._rows = []


def read_rows(out_dir: Path) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    for path in out_dir.glob("*.json"):
        rows.extend(tuple(r) for r in json.loads(path.read_text()))
    return sorted(rows)


def aggregation_vertices(rest: FlinkRest, job_id: str) -> list[dict[str, Any]]:
    """Per aggregation vertex: name, which Beam labels it holds, and read-records per subtask."""
    found = []
    for vertex in rest.job(job_id)["vertices"]:
        labels = [label for label in AGGREGATION_LABELS if label in vertex["name"]]
        if not labels:
            continue
        detail = rest._request("GET", f"/jobs/{job_id}/vertices/{vertex['id']}")
        subtasks = sorted(detail["subtasks"], key=lambda s: s["subtask"])
        per_subtask = [int(s["metrics"]["read-records"]) for s in subtasks]
        found.append({"name": vertex["name"], "labels": labels, "records_in": per_subtask})
    return found


def aggregation_key_counts(args: argparse.Namespace, hot: frozenset[str], fanout: int | None) -> Counter[Any]:
    """Records per aggregation key (user; (user, shard) for hot users with fanout), from the same generator."""
    generate = _Generate(args.users, args.hot_share, args.hours * 3600)
    counts: Counter[Any] = Counter()
    for chunk in range(args.events // CHUNK):
        for event in generate.process(chunk):
            user, event_id = event.value
            if fanout is not None and user in hot:
                counts[(user, _stable_hash(_shard_by_event_id(event_id)) % fanout)] += 1
            else:
                counts[user] += 1
    return counts


def modelled_subtask_max(counts: Counter[Any], parallelism: int) -> int:
    """Busiest subtask if keys are spread by a stable hash over ``parallelism`` subtasks (a model of Flink's key
    groups, not a measurement): shows from which parallelism on the hottest key, not the hash spread, sets the max."""
    load = [0] * parallelism
    for key, count in counts.items():
        load[_stable_hash(repr(key)) % parallelism] += count
    return max(load)


def run_job(
    flink: ServiceState, args: argparse.Namespace, variant: str, windowfn: WindowFn, out_dir: Path
) -> dict[str, Any]:
    """Submits one job, waits for it, and returns its REST figures and output rows."""
    hot = frozenset(hot_users(args.users))
    if variant == "no-fanout":
        aggregate = HotKeyAggregate(CountCombineFn(), windowfn=windowfn, hot_keys=(), detect=None)
    elif args.hot == "configured":
        aggregate = HotKeyAggregate(
            CountCombineFn(), windowfn=windowfn, hot_keys=hot, fanout=args.fanout, shard_by=_shard_by_event_id
        )
    else:
        aggregate = HotKeyAggregate(
            CountCombineFn(),
            windowfn=windowfn,
            detect=HotKeyDetection(min_share=0.005, sample_every=10),
            fanout=args.fanout,
            shard_by=_shard_by_event_id,
        )
    job_name = f"hotbench-{variant}-{uuid.uuid4().hex[:8]}"
    options = options_for_service(flink, {"job_name": job_name, "parallelism": args.parallelism})
    out_dir.mkdir(parents=True)
    pipeline = beam.Pipeline(options=options)
    _ = (
        pipeline
        | "Chunks" >> beam.Create(range(args.events // CHUNK))
        | "Generate" >> beam.ParDo(_Generate(args.users, args.hot_share, args.hours * 3600))
        | "HotKeyAggregate" >> aggregate
        | "WriteRows" >> beam.ParDo(_WriteRows(str(out_dir)))
    )
    started = time.monotonic()
    state = pipeline.run().wait_until_finish()
    wall_s = time.monotonic() - started
    if state != PipelineState.DONE:
        raise RuntimeError(f"{job_name} ended {state}")
    rest = FlinkRest(flink.info["rest_url"])
    [job] = [j for j in rest.jobs() if j.name == job_name]
    detail = rest.job(job.job_id)
    if detail["state"] != "FINISHED":
        raise RuntimeError(f"{job_name} is {detail['state']} in Flink")
    return {
        "variant": variant,
        "job_id": job.job_id,
        "job_s": (detail["end-time"] - detail["start-time"]) / 1000,
        "wall_s": wall_s,
        "vertices": aggregation_vertices(rest, job.job_id),
        "rows": read_rows(out_dir),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=100_000, help="events (rounded down to 10k)")
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--hot-share", type=float, default=0.22, help="share of events from the top 1%% of users")
    parser.add_argument("--hours", type=float, default=4.0, help="event-time span")
    parser.add_argument("--fanout", type=int, default=16)
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--window", choices=["sessions", "fixed"], default="sessions")
    parser.add_argument("--hot", choices=["configured", "detected"], default="configured")
    parser.add_argument("--data", type=Path, default=Path(".data/hotbench"), help="service data folder")
    parser.add_argument("--keep-cluster", action="store_true", help="leave the Flink cluster running")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.events < CHUNK:
        parser.error(f"--events must be at least {CHUNK}")
    if args.parallelism < 2:
        parser.error("--parallelism must be at least 2 (fanout needs subtasks to spread over)")
    n = args.events // CHUNK * CHUNK
    windowfn: WindowFn = Sessions(600) if args.window == "sessions" else FixedWindows(600)
    hot = frozenset(hot_users(args.users))
    data = args.data.resolve()
    service = ServiceSet(data=data).get("flink")
    out_root = data / "hotbench-out" / uuid.uuid4().hex[:8]
    load_before = os.getloadavg()
    try:
        flink = service.up()
        base = run_job(flink, args, "no-fanout", windowfn, out_root / "no-fanout")
        fan = run_job(flink, args, "fanout", windowfn, out_root / "fanout")
    finally:
        if not args.keep_cluster:
            service.down()
        shutil.rmtree(out_root, ignore_errors=True)
    load_after = os.getloadavg()

    counts_base, counts_fan = aggregation_key_counts(args, hot, None), aggregation_key_counts(args, hot, args.fanout)
    key_base, key_fan = max(counts_base.values()), max(counts_fan.values())
    same = base["rows"] == fan["rows"]
    final_inputs = {v: _inputs_of_final_panes(r["rows"]) for v, r in (("no-fanout", base), ("fanout", fan))}

    print(
        f"workload: {n} events, {args.users} users, top 1% = {len(hot)} users with {args.hot_share:.0%} of events, "
        f"{args.window} windows of 10 min, fanout {args.fanout} ({args.hot} hot keys); Flink session cluster, "
        f"streaming without checkpointing, parallelism {args.parallelism}, LOOPBACK SDK workers"
    )
    print(f"machine: {platform.node()} nproc={os.cpu_count()} load avg before {load_before[0]:.1f}, "
          f"after {load_after[0]:.1f}")  # fmt: skip
    for run in (base, fan):
        print(f"[{run['variant']}] job {run['job_id']}: aggregation vertices (read-records per subtask):")
        for vertex in run["vertices"]:
            total = sum(vertex["records_in"])
            label = "+".join(vertex["labels"])
            print(f"    {label:<13} {vertex['records_in']} total {total}   <- {vertex['name'][:90]}")
    max_base = max(max(v["records_in"]) for v in base["vertices"])
    max_fan = max(max(v["records_in"]) for v in fan["vertices"])
    # Flink's default slot sharing puts subtask i of every vertex in the same slot: a slot's aggregation work is the
    # sum over the aggregation vertices.
    slot_base, slot_fan = max(_per_slot(base["vertices"])), max(_per_slot(fan["vertices"]))
    print(
        f"max records per slot (subtask i of all aggregation vertices): no fanout {slot_base}, with fanout "
        f"{slot_fan} -> {slot_base / slot_fan:.2f}x lower with fanout"
    )
    # Bound: without fanout a subtask reads at most all n events; with it, the busiest cold subtask reads at least
    # the cold events / parallelism. Per-subtask load cannot drop by more than that, whatever the fanout.
    cold = sum(sum(v["records_in"]) for v in fan["vertices"] if v["labels"] == ["CombineCold"])
    bound = n / (cold / args.parallelism) if cold else float("inf")
    print(
        f"max records per aggregation subtask: no fanout {max_base}, with fanout {max_fan} "
        f"-> {max_base / max_fan:.2f}x lower with fanout (can be at most {bound:.2f}x here: n / (cold events / "
        f"parallelism))"
    )
    print(
        f"max records per aggregation key:     no fanout {key_base}, with fanout {key_fan} "
        f"-> {key_base / key_fan:.2f}x lower with fanout (from the generator)"
    )
    modelled = {
        p: (modelled_subtask_max(counts_base, p), modelled_subtask_max(counts_fan, p)) for p in MODEL_PARALLELISM
    }
    print(
        "modelled max records per subtask (keys hashed over p subtasks; fanout's cold and hot vertices counted "
        "together): " + ", ".join(f"p={p}: {b} vs {f} -> {b / f:.2f}x" for p, (b, f) in modelled.items())
    )
    print(
        f"throughput no fanout: {n / base['job_s']:8.0f} events/s (job {base['job_s']:.1f} s, "
        f"submit-to-done {base['wall_s']:.1f} s)  baseline 1.00"
    )
    print(
        f"throughput fanout:    {n / fan['job_s']:8.0f} events/s (job {fan['job_s']:.1f} s, "
        f"submit-to-done {fan['wall_s']:.1f} s)  ratio {base['job_s'] / fan['job_s']:.2f}"
    )
    print(
        f"results identical: {same} ({len(base['rows'])} vs {len(fan['rows'])} rows; inputs covered by final "
        f"panes: {final_inputs['no-fanout']} vs {final_inputs['fanout']} of {n})"
    )
    if args.json:
        figures = {
            "events": n,
            "args": {k: str(v) for k, v in vars(args).items()},
            "load": [load_before[0], load_after[0]],
            "per_key_max": {"no-fanout": key_base, "fanout": key_fan},
            "modelled_subtask_max": {str(p): list(v) for p, v in modelled.items()},
            "identical": same,
            "runs": [{k: v for k, v in r.items() if k != "rows"} | {"row_count": len(r["rows"])} for r in (base, fan)],
        }
        args.json.write_text(json.dumps(figures, indent=2))
    return 0 if same and final_inputs["no-fanout"] == n else 1


def _per_slot(vertices: list[dict[str, Any]]) -> list[int]:
    width = max(len(v["records_in"]) for v in vertices)
    return [sum(v["records_in"][i] for v in vertices if i < len(v["records_in"])) for i in range(width)]


def _inputs_of_final_panes(rows: list[tuple[Any, ...]]) -> int:
    """Sum of input counts of each (key, window)'s last pane: every event counted exactly once if nothing was lost."""
    last: dict[tuple[Any, ...], tuple[int, int]] = {}
    for key, start, end, _value, count, pane in rows:
        if (key, start, end) not in last or pane > last[(key, start, end)][0]:
            last[(key, start, end)] = (pane, count)
    return sum(count for _pane, count in last.values())


if __name__ == "__main__":
    sys.exit(main())

"""ReadFromKafka's records/s against a bare consumer loop of the same client, same topic, same run.

    .venv/bin/python -m benchmarks.kafka_read [--records 300000] [--json .data/bench/kafka_read.json]

Prints, per backend, the bare loop's rate, the transform's rate on the pinned local runner, and their ratio
(goal: >= 0.7x). The transform's figure includes pipeline start-up and partition discovery, as a user would see it.
Start-up is about two seconds of FnApiRunner planning and bundle-processor construction whatever the volume, so a
second figure takes it out: the transform also reads a 1,000-record topic, and the steady-state rate is
``(records - 1000) / (seconds - seconds_for_1000)``. Each figure is the best of ``--repeat`` interleaved runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from pathlib import Path

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter

from beamflow.kafka.admin import create_topic, produce
from beamflow.kafka.client import BACKENDS, open_consumer
from beamflow.kafka.record import TopicPartition
from beamflow.services import ServiceSet
from beamflow.services.paths import data_dir
from runners.direct import local_options
from transforms.read_from_kafka import ReadFromKafka, StopPolicy

SMALL = 1000


def bare_loop(backend: str, bootstrap: str, topic: str, partitions: int, total: int) -> float:
    consumer = open_consumer(backend, bootstrap, f"bench-{uuid.uuid4().hex[:6]}")
    start = time.perf_counter()
    for p in range(partitions):
        consumer.assign(TopicPartition(topic, p), 0)
    seen = 0
    while seen < total:
        seen += len(consumer.poll(10_000, 1.0))
    elapsed = time.perf_counter() - start
    consumer.close()
    return total / elapsed


def transform(backend: str, bootstrap: str, topic: str, total: int) -> float:
    start = time.perf_counter()
    with beam.Pipeline(options=local_options()) as p:
        (
            p
            | ReadFromKafka(
                bootstrap,
                [topic],
                f"bench-{uuid.uuid4().hex[:6]}",
                backend=backend,
                stop=StopPolicy(at_end_offsets=True),
                commit_offsets=True,
            )
            | beam.ParDo(_CountRecords())
        )
    seconds = time.perf_counter() - start
    counters = p.result.metrics().query(MetricsFilter().with_name("bench_records"))["counters"]
    counted = sum(c.committed or 0 for c in counters)
    if counted != total:
        raise SystemExit(f"COUNT MISMATCH: the transform emitted {counted} records, {total} were produced")
    return total / seconds


class _CountRecords(beam.DoFn):
    """The cheapest consumer that still checks the count: one step, a local tally, one metric per bundle (the bare
    loop counts with len() too)."""

    def start_bundle(self) -> None:
        self._n = 0

    def process(self, record: object) -> tuple[()]:
        self._n += 1
        return ()

    def finish_bundle(self) -> None:
        Metrics.counter("bench", "bench_records").inc(self._n)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--repeat", type=int, default=2, help="interleaved runs per figure; the best counts")
    parser.add_argument("--json", help="write the figures here (benchmarks.e2e --kafka-json plots them)")
    args = parser.parse_args()
    services = ServiceSet(data=Path(data_dir()) / "bench")
    state = services.get("kafka").up()
    bootstrap = state.info["bootstrap"]
    topic = f"bench-{uuid.uuid4().hex[:6]}"
    create_topic(bootstrap, topic, args.partitions)
    produce(bootstrap, topic, ((None, b"x" * 60) for _ in range(args.records)))
    small_topic = f"bench-small-{uuid.uuid4().hex[:6]}"
    create_topic(bootstrap, small_topic, args.partitions)
    produce(bootstrap, small_topic, ((None, b"x" * 60) for _ in range(SMALL)))
    print(
        f"{args.records} records of 60 bytes on {args.partitions} partitions; nproc={os.cpu_count()}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'backend':14} {'bare msg/s':>12} {'transform msg/s':>16} {'ratio':>7} {'steady msg/s':>13} {'ratio':>7}")
    results = []
    try:
        for backend in args.backends.split(","):
            # Best of --repeat interleaved runs: on a shared machine the slow runs measure the neighbours.
            bare = read = small_rate = 0.0
            for _ in range(args.repeat):
                bare = max(bare, bare_loop(backend, bootstrap, topic, args.partitions, args.records))
                read = max(read, transform(backend, bootstrap, topic, args.records))
                small_rate = max(small_rate, transform(backend, bootstrap, small_topic, SMALL))
            small_seconds = SMALL / small_rate
            steady = (args.records - SMALL) / max(args.records / read - small_seconds, 1e-9)
            results.append(
                {"backend": backend, "bare": bare, "transform": read, "steady": steady, "startup_s": small_seconds}
            )
            print(f"{backend:14} {bare:12,.0f} {read:16,.0f} {read / bare:7.2f} {steady:13,.0f} {steady / bare:7.2f}")
    finally:
        services.down(["kafka"])
    print(f"(goal: ratio >= 0.7; steady = without the start-up measured on a {SMALL:,}-record topic)")
    if args.json:
        figures = {"records": args.records, "partitions": args.partitions, "results": results}
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()

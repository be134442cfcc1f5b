"""ReadFromKafka's records/s against a bare consumer loop of the same client, same topic, same run.

    .venv/bin/python -m benchmarks.kafka_read [--records 300000]

Prints, per backend, the bare loop's rate, the transform's rate on the pinned local runner, and their ratio
(goal: >= 0.7x). The transform's figure includes pipeline start-up and partition discovery, as a user would see it.
"""

from __future__ import annotations

import argparse
import time
import uuid
from pathlib import Path

import apache_beam as beam

from beamflow.kafka.admin import create_topic, produce
from beamflow.kafka.client import BACKENDS, open_consumer
from beamflow.kafka.record import TopicPartition
from beamflow.services import ServiceSet
from beamflow.services.paths import data_dir
from runners.direct import local_options
from transforms.read_from_kafka import ReadFromKafka, StopPolicy


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
        counted = (
            p
            | ReadFromKafka(
                bootstrap,
                [topic],
                f"bench-{uuid.uuid4().hex[:6]}",
                backend=backend,
                stop=StopPolicy(at_end_offsets=True),
                commit_offsets=True,
            )
            | beam.combiners.Count.Globally()
        )
        counted | beam.Map(lambda n: n == total or print(f"COUNT MISMATCH {n} != {total}"))
    return total / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--partitions", type=int, default=4)
    args = parser.parse_args()
    services = ServiceSet(data=Path(data_dir()) / "bench")
    state = services.get("kafka").up()
    bootstrap = state.info["bootstrap"]
    topic = f"bench-{uuid.uuid4().hex[:6]}"
    create_topic(bootstrap, topic, args.partitions)
    produce(bootstrap, topic, ((None, b"x" * 60) for _ in range(args.records)))
    print(f"{args.records} records of 60 bytes on {args.partitions} partitions")
    print(f"{'backend':14} {'bare msg/s':>12} {'transform msg/s':>16} {'ratio':>7}")
    try:
        for backend in BACKENDS:
            bare = bare_loop(backend, bootstrap, topic, args.partitions, args.records)
            read = transform(backend, bootstrap, topic, args.records)
            print(f"{backend:14} {bare:12,.0f} {read:16,.0f} {read / bare:7.2f}")
    finally:
        services.down(["kafka"])


if __name__ == "__main__":
    main()

"""A job that makes Beam 2.62's Flink runner emit the final watermark ahead of a bundle's output (see
``tests/flink/test_watermark_order.py``): the Impulse's only element starts a slow bundle, the +inf watermark comes
right behind it, and the bundle waits until the test sees a checkpoint under way, whose barrier then finishes it.

    python -m tests.flink.watermark_order_job STATE_JSON OUT_DIR JOB_NAME
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam

ELEMENTS = 40
KEYS = 4


class SlowFirstBundle(beam.DoFn):
    """From the impulse: waits until ``gate`` exists (the test creates it once a checkpoint is under way, so the
    barrier finishes this very bundle), then emits the elements."""

    def __init__(self, gate: str, elements: int, keys: int) -> None:
        self.gate = gate
        self.elements = elements
        self.keys = keys

    def process(self, _impulse: bytes) -> Iterator[tuple[int, int]]:
        import os
        import time  # this module runs as __main__, whose globals the workers do not get

        deadline = time.monotonic() + 300
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.05)
        for i in range(self.elements):
            yield i % self.keys, i


class WriteGroup(beam.DoFn):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def process(self, group: tuple[int, Any]) -> None:

        key, values = group
        with open(os.path.join(self.out_dir, f"{key}.json"), "w") as f:
            json.dump(sorted(values), f)


def main(state_json: str, out_dir: str, job_name: str) -> None:
    from beamflow.services import ServiceState
    from runners.flink import options_for_service

    state = ServiceState.load(Path(state_json))
    options = options_for_service(
        state,
        {
            "job_name": job_name,
            "parallelism": 2,
            "checkpointing_interval_ms": 100,
            "min_pause_between_checkpoints_ms": 0,
            # Only a barrier may finish the gated bundle, not the bundle-time limit.
            "max_bundle_time_ms": 600_000,
            # The job ends once the Impulse has idled this long, so the test reads a finished job's output.
            "shutdown_sources_after_idle_ms": 15000,
        },
    )
    with beam.Pipeline(options=options) as p:
        _ = (
            p
            | "Impulse" >> beam.Impulse()
            | "Slow" >> beam.ParDo(SlowFirstBundle(os.path.join(out_dir, "gate"), ELEMENTS, KEYS))
            # A GroupByKey in the global window fires at the +inf watermark: what arrives after it is dropped.
            | "Group" >> beam.GroupByKey()
            | "Write" >> beam.ParDo(WriteGroup(out_dir))
        )


if __name__ == "__main__":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for the stacks if this process lingers
    main(*sys.argv[1:4])

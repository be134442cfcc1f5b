"""The job of the idle-partition test on Flink (issue 15, seed 002's question 3), in an importable module so the
Python workers beside the TaskManagers import ``RecordPanes`` by reference.

Two reads of the same topic in one job (two consumer groups), one with ``idle_timeout_ms`` and one without, each
into the windowed session path of ``HotKeyAggregate`` (Sessions, allowed lateness, accumulating late panes): the
path the job's windows take when they fire on the watermark. Each fired pane is appended as one JSON line to a file
per worker process under ``<out>/<branch>/``, so the test sees what the cluster emitted while the job runs.

``python -m tests.flink.idle_sessions_job <flink state.json> <bootstrap> <topic> <out dir> <job name> <gap s>
<allowed lateness s> <idle timeout ms>``: submits, waits until Flink runs the job, exits (the job stays on the
cluster).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import apache_beam as beam
from apache_beam.transforms.combiners import CountCombineFn
from apache_beam.transforms.window import Sessions

from transforms.hot_key_aggregate import HotKeyAggregate, WindowedAggregate

__all__ = ["BRANCHES", "RecordPanes", "key_of", "main"]

BRANCHES = ("idle", "no_idle")


class RecordPanes(beam.DoFn):
    """Appends each pane as a JSON line to ``<out>/<pid>.jsonl`` (one file per worker process: no interleaving)."""

    def __init__(self, out: str) -> None:
        self._out = out

    def process(self, row: WindowedAggregate) -> None:
        line = {
            "key": row.key,
            "start_ms": row.window_start.micros // 1000,
            "end_ms": row.window_end.micros // 1000,
            "count": row.input_count,
            "pane": row.pane_index,
            "timing": row.timing,
            "wall_ms": int(time.time() * 1000),
        }
        with open(os.path.join(self._out, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")


def key_of(record: Any) -> tuple[str, int]:
    return (record.key or b"").decode(), 1


def main(argv: list[str]) -> int:
    from beamflow.services import ServiceState
    from runners.flink import options_for_service, wait_until_running
    from transforms.read_from_kafka import ReadFromKafka

    state_path, bootstrap, topic, out, job_name, gap_s, lateness_s, idle_ms = argv
    state = ServiceState.load(Path(state_path))
    assert state is not None, state_path
    settings = {
        "job_name": job_name,
        "parallelism": 2,
        "checkpointing_interval_ms": 3000,
        "max_bundle_time_ms": 1000,
        "min_pause_between_checkpoints_ms": 1000,
        "restart_strategy": {"type": "fixed-delay", "attempts": 5, "delay_ms": 2000},
    }
    p = beam.Pipeline(options=options_for_service(state, settings))
    for branch, idle in zip(BRANCHES, (int(idle_ms), None), strict=True):
        folder = os.path.join(out, branch)
        os.makedirs(folder, exist_ok=True)
        (
            p
            | f"Read_{branch}"
            >> ReadFromKafka(bootstrap, [topic], group_id=f"{job_name}-{branch}", idle_timeout_ms=idle, max_delay_ms=0)
            | f"Key_{branch}" >> beam.Map(key_of)
            | f"Sessions_{branch}"
            >> HotKeyAggregate(
                CountCombineFn(), Sessions(int(gap_s)), allowed_lateness=int(lateness_s), strategy="windowed"
            )
            | f"Record_{branch}" >> beam.ParDo(RecordPanes(folder))
        )
    result = p.run()
    wait_until_running(result, job_name, f"http://127.0.0.1:{state.ports['rest']}")
    return 0


if __name__ == "__main__":
    from tests.flink.idle_sessions_job import main as _main

    sys.exit(_main(sys.argv[1:]))

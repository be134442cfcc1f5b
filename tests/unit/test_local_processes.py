"""A local run split over processes: how partitions are dealt, how many processes a backlog takes, and that the
processes die with their launcher (a killed launcher must leave no run behind to race the next over its partitions)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from beamflow.config import ConfigError, load_config, load_job_config
from runners.local_processes import PartFailed, partition_groups, processes_for, run_in_processes

ROOT = Path(__file__).resolve().parents[2]


def test_partitions_are_dealt_round_robin_with_no_empty_group() -> None:
    assert partition_groups([3, 0, 2, 1], 2) == [(0, 2), (1, 3)]
    assert partition_groups([0, 1, 2, 3, 4], 2) == [(0, 2, 4), (1, 3)]
    assert partition_groups([0, 1], 4) == [(0,), (1,)]
    assert partition_groups([5], 1) == [(5,)]
    every = [p for g in partition_groups(range(12), 5) for p in g]
    assert sorted(every) == list(range(12))  # each partition in exactly one group
    with pytest.raises(ValueError):
        partition_groups([0], 0)


def test_a_small_backlog_runs_in_one_process() -> None:
    assert processes_for(20_000, most=2, records_per_process=50_000) == 1
    assert processes_for(0, most=2, records_per_process=50_000) == 1
    assert processes_for(100_000, most=2, records_per_process=50_000) == 2
    assert processes_for(10_000_000, most=2, records_per_process=50_000) == 2
    assert processes_for(150_000, most=4, records_per_process=50_000) == 3


def test_the_shipped_conf_splits_and_bad_values_are_refused() -> None:
    kafka = load_job_config(str(ROOT / "conf" / "clicks.yaml")).kafka
    assert kafka is not None and kafka.local_processes == 2 and kafka.only_partitions is None
    for key in ("local_processes", "local_process_records"):
        with pytest.raises(ConfigError, match=f"kafka.{key} must be at least 1"):
            load_job_config(str(ROOT / "conf" / "clicks.yaml"), [f"kafka.{key}=0"])
    raw = load_config(str(ROOT / "conf" / "clicks.yaml"), ["kafka.only_partitions=[1, 3]"])
    assert raw["kafka"]["only_partitions"] == [1, 3]


def _square(n: int) -> int:
    if n < 0:
        raise ValueError(f"negative: {n}")
    return n * n


def test_results_come_back_in_order_and_a_failure_names_its_part() -> None:
    assert run_in_processes(_square, [3, 4]) == [9, 16]
    with pytest.raises(PartFailed, match=r"the local run over part -2 failed: negative: -2"):
        run_in_processes(_square, [2, -2], describe=lambda n: f"part {n}")


_LAUNCHER = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from runners.local_processes import run_in_processes

def sleep_forever(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)

if __name__ == "__main__":
    run_in_processes(sleep_forever, [sys.argv[2] + ".a", sys.argv[2] + ".b"])
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_the_processes_die_with_their_launcher(tmp_path: Path) -> None:
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER)
    marker = tmp_path / "pid"
    launcher = subprocess.Popen([sys.executable, str(script), str(ROOT), str(marker)])
    try:
        deadline = time.monotonic() + 60
        paths = [Path(f"{marker}.a"), Path(f"{marker}.b")]
        while not all(p.exists() and p.read_text() for p in paths):
            assert time.monotonic() < deadline, "the processes never started"
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in paths]
        assert all(_alive(pid) for pid in pids)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids):
            assert time.monotonic() < deadline, f"processes {pids} outlived their killed launcher"
            time.sleep(0.1)
    finally:
        launcher.kill()

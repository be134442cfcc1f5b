"""The benchmarks' peak-memory figure is the child's own, not the parent's that Linux carries across ``execve``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

CHILD = (
    "import resource, sys; sys.path.insert(0, sys.argv[1]); from beamflow.process_memory import own_peak_rss_mb; "
    "print(own_peak_rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
)


def test_a_small_child_of_a_large_parent_reports_its_own_peak() -> None:
    held = bytearray(300 * 2**20)
    held[::4096] = b"\x01" * len(held[::4096])  # touched, so resident
    repo = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", CHILD, repo], capture_output=True, text=True, check=True).stdout
    own, carried = (float(x) for x in out.split())
    assert carried >= 300  # ru_maxrss: the parent's figure (what the benchmarks used to report)
    assert own < 100, (own, carried)  # VmHWM: the child's own (a Python interpreter, tens of MB)
    del held

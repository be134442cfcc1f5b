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


FRAGMENTED = """
import sys, time
sys.path.insert(0, sys.argv[1])
from beamflow.process_memory import glibc_heap_mb, proc_rss_mb, release_free_heap, release_free_heap_every
blocks = [bytearray(64 * 1024) for _ in range(3000)]  # 192 MB from glibc's heap (under its mmap threshold)
kept = blocks[::10]  # one block in ten kept: the freed ones are holes between kept blocks, not the heap's top
del blocks
free, before = glibc_heap_mb()["free_held"], proc_rss_mb()
how = sys.argv[2]
if how == "call":
    release_free_heap()
elif how == "thread":
    assert release_free_heap_every(0.1) is not None and release_free_heap_every(0.1) is None  # one per process
time.sleep(0.5)
print(free, before - proc_rss_mb())
"""


@pytest.mark.parametrize("how", ["call", "thread", "none"])
def test_free_heap_pages_go_back_to_the_system(how: str) -> None:
    """A heap whose free memory lies between kept blocks (a long-running worker's) keeps it resident: glibc gives
    back only the top of its heap by itself (``none``: RSS stays). ``release_free_heap`` hands the free pages back,
    called or from the releaser's thread."""
    repo = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", FRAGMENTED, repo, how], capture_output=True, text=True, check=True)
    free_mb, released_mb = (float(x) for x in out.stdout.split())
    assert free_mb > 150, f"the test's heap holds only {free_mb:.0f} MB free"
    if how == "none":
        assert released_mb < 10, f"glibc gave back {released_mb:.0f} MB by itself: the check shows nothing"
    else:
        assert released_mb > 0.9 * free_mb, f"{released_mb:.0f} of {free_mb:.0f} MB free went back"

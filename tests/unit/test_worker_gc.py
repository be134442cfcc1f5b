"""The streaming worker's collector settings keep cyclic garbage bounded (issue 13, the workers' growth).

A census of a soak's workers (``benchmarks.soak_probe``, ``BEAMFLOW_PROBE_SURVIVORS``) found what they kept: 40,000
objects made in 13 minutes and still tracked, most of them pyiceberg's: each commit loads the table a few times, each
load makes a ``PyArrowFileIO``, and each of those holds an ``lru_cache`` of its own bound method, a reference cycle
that only the cyclic collector frees. With the thresholds the workers had (100,000, 50, 100), a young collection came
only after 100,000 more tracked objects were made than freed, and the cycles were most of that surplus: none was
collected in a commit loop of 600 commits, and the soak's workers grew with them. These tests run in a fresh
interpreter each, so the collector's state is only theirs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Make PyArrowFileIO objects (pyiceberg's own class, the cycles the census found) with nothing else alive between
# them, as a worker's commits leave them; report the most alive at once and the collections that ran.
_CYCLES = """
import gc, json, sys
from pyiceberg.io.pyarrow import PyArrowFileIO
import runners.worker_settings as settings
settings.apply()
if len(sys.argv) > 1:
    gc.set_threshold(*json.loads(sys.argv[1]))
most = 0
ran_before = [s["collections"] for s in gc.get_stats()]  # the imports' own collections
def made():
    PyArrowFileIO({"any": "property"})
for i in range(9_000):  # each is about ten tracked objects: 90,000, under the old young threshold
    made()
    if i % 250 == 0:
        most = max(most, sum(1 for o in gc.get_objects() if type(o) is PyArrowFileIO))
ran = [s["collections"] - before for s, before in zip(gc.get_stats(), ran_before)]
print(json.dumps({"most_alive": most, "collections": ran}))
"""


def _run(code: str, *args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=True, cwd=ROOT, timeout=300
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_a_pyiceberg_file_io_is_cyclic_garbage_once_dropped() -> None:
    """The cause, on pyiceberg's real class: a dropped ``PyArrowFileIO`` stays until the collector runs."""
    code = """
import gc, json
from pyiceberg.io.pyarrow import PyArrowFileIO
gc.disable()
for _ in range(100):
    PyArrowFileIO({})
count = lambda: sum(1 for o in gc.get_objects() if type(o) is PyArrowFileIO)
before = count()
gc.collect()
print(json.dumps({"before": before, "after": count()}))
"""
    out = _run(code)
    assert out == {"before": 100, "after": 0}


def test_the_worker_settings_collect_the_cycles_as_they_come() -> None:
    """With ``runners.worker_settings.apply()``, the young generation runs every 10,000 surplus objects: of 9,000
    dropped FileIOs (about ten tracked objects each) never more than about a thousand are alive at once."""
    from runners.worker_settings import WORKER_GC_THRESHOLDS

    out = _run(_CYCLES)
    collections = out["collections"]
    assert isinstance(collections, list) and collections[0] > 0
    most = out["most_alive"]
    assert isinstance(most, int) and most < 2_500, (WORKER_GC_THRESHOLDS, out)


def test_the_old_thresholds_never_collect_them() -> None:
    """The check above fails with the thresholds the soak's workers had: every FileIO stays alive."""
    out = _run(_CYCLES, json.dumps([100_000, 50, 100]))
    assert out["most_alive"] == 8_751  # the last count, after the 8,751st: every one made so far
    assert out["collections"] == [0, 0, 0]

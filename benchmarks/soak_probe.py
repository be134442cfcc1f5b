"""The clicks job with a memory probe in each Python SDK worker, for ``benchmarks.soak --probe`` (issue 15 item 4).

The soak showed the Python workers' RSS growing (+10% quiet, +29% loaded from minute 2 to 10) while the live state
stayed flat. This variant says what grows: the streaming Iceberg sink's ``flush`` (which runs in every worker, once
per bundle) starts ``tracemalloc`` in its first call and, every ``PROBE_EVERY_S``, appends to
``$BEAMFLOW_PROBE_DIR/<pid>.jsonl`` (as the TaskManager's environment has it; default ``/tmp/beamflow-probe``) the
worker's RSS, the traced heap, pyarrow's pool, the object counts by type that changed most since the first probe,
and the source lines whose retained allocations grew most. Nothing of it is in the product: run exactly like
``python -m pipelines.clicks`` (``python -m benchmarks.soak_probe --runner=FlinkRunner ...``).

``BEAMFLOW_PROBE_SURVIVORS=START:END`` (seconds from the worker's first bundle) asks another question: which
objects were made between START and END and are still alive at END. A bounded cache whose entries are replaced
keeps its size, so a comparison of snapshots shows no growth for it, yet each replacement puts a long-lived object
among the short-lived ones of its bundle and keeps their memory from being reused whole: memory that grows while
nothing in use does. tracemalloc would name the lines, but tracing a worker at 1,500 records/s slowed it until its
checkpoints expired and the job restarted (tried). So this is a census of the collector's objects instead, nothing
traced in between: at START the addresses of every object the collector tracks (a sorted array, 8 bytes each); at
END the objects at addresses not in it, counted by type, and for a sample of each of the commonest types, the
types of the objects that refer to them. Written to ``<pid>.survivors.json``. Strings and numbers are not tracked
by the collector: their owners are.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import sys
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from beamflow.process_memory import glibc_heap_mb, proc_rss_mb
from transforms import write_to_iceberg

__all__ = ["PROBE_EVERY_S", "ProbedIcebergCommitFn", "main"]

PROBE_EVERY_S = 60.0
_TOP = 25
_SURVIVOR_TOP = 40
_SURVIVOR_TYPES = 12  # the commonest types whose holders are sampled
_SURVIVOR_SAMPLE = 50


def _name(o: object) -> str:
    kind = type(o)
    return f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__


class _Probe:
    """One per worker process: the first snapshot, then a line per ``PROBE_EVERY_S``."""

    def __init__(self) -> None:
        # Tracing slows every allocation and each snapshot holds the bundle (and so a checkpoint barrier) for seconds:
        # a 38-minute probe at 1,500 records/s fell behind from minute 25 with checkpoints failing.
        # BEAMFLOW_PROBE_TRACE=0 keeps only the allocator's and the process's figures, which cost nothing.
        self.trace = os.environ.get("BEAMFLOW_PROBE_TRACE", "1") != "0"
        if self.trace:
            tracemalloc.start(1)
            self.first = tracemalloc.take_snapshot()
            self.first_types = self._types()
        self.t0 = time.monotonic()
        self.next_at = self.t0 + PROBE_EVERY_S
        folder = Path(os.environ.get("BEAMFLOW_PROBE_DIR", "/tmp/beamflow-probe"))
        folder.mkdir(parents=True, exist_ok=True)
        self.out = folder / f"{os.getpid()}.jsonl"
        window = os.environ.get("BEAMFLOW_PROBE_SURVIVORS", "")
        self.survivors: tuple[float, float] | None = None
        self.born_before: np.ndarray | None = None
        if window:
            start, end = (float(x) for x in window.split(":"))
            self.survivors = (self.t0 + start, self.t0 + end)
        # What the collector costs the worker: seconds inside collections, per generation, from its own callbacks
        # (the thresholds decide how often it runs; this says what that frequency costs beside the worker's CPU).
        self.gc_seconds = [0.0, 0.0, 0.0]
        self._gc_started = 0.0
        gc.callbacks.append(self._gc_timer)

    def _gc_timer(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_seconds[info["generation"]] += time.perf_counter() - self._gc_started

    @staticmethod
    def _types() -> collections.Counter[str]:
        return collections.Counter(type(o).__qualname__ for o in gc.get_objects())

    @staticmethod
    def _arrow() -> dict[str, Any]:
        """pyarrow's own pool (Parquet files of the Iceberg sink): tracemalloc does not see it."""
        import pyarrow

        pool = pyarrow.default_memory_pool()
        return {
            "arrow_pool": pool.backend_name,
            "arrow_allocated_mb": round(pool.bytes_allocated() / 2**20, 2),
            "arrow_max_mb": round(pool.max_memory() / 2**20, 2),
        }

    @staticmethod
    def _malloc() -> dict[str, Any]:
        """glibc's own heap (``beamflow.process_memory.glibc_heap_mb``). Python's small objects are not in it: they
        come from pymalloc's arenas, which it maps itself (``_pymalloc``)."""
        try:
            heap = glibc_heap_mb()
        except (OSError, AttributeError) as exc:
            return {"malloc_error": str(exc)}
        return {f"malloc_{name}_mb": round(value, 1) for name, value in heap.items()}

    @staticmethod
    def _jemalloc() -> dict[str, Any]:
        """jemalloc's own figures when the worker preloads it (``--second-tm-env LD_PRELOAD=libjemalloc.so.2``;
        glibc's ``mallinfo2`` then reads zeros): what the program holds (``allocated``), the pages it keeps resident,
        and the address space it keeps mapped. Read through ``mallctl``, after bumping its ``epoch`` (its statistics
        are cached)."""
        import ctypes

        try:
            mallctl = ctypes.CDLL(None).mallctl  # the preloaded library's, by the process's global symbol lookup
        except AttributeError:
            return {"jemalloc": False}
        epoch = ctypes.c_uint64(1)
        size = ctypes.c_size_t(ctypes.sizeof(epoch))
        mallctl(b"epoch", None, None, ctypes.byref(epoch), size)
        out: dict[str, Any] = {"jemalloc": True}
        for name in ("allocated", "active", "resident", "mapped", "retained"):
            value, size = ctypes.c_size_t(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
            if mallctl(f"stats.{name}".encode(), ctypes.byref(value), ctypes.byref(size), None, 0) == 0:
                out[f"jemalloc_{name}_mb"] = round(value.value / 2**20, 1)
        return out

    @staticmethod
    def _pymalloc() -> dict[str, Any]:
        """CPython's own small-object allocator (its 1 MiB arenas come from mmap, so neither glibc's nor jemalloc's
        figures include them): the arenas it holds, what its objects use of them, and what it keeps free in
        partly used pools and in unused pools (an arena goes back only when all of it is free). From
        ``sys._debugmallocstats``, which writes to the C stderr: read back through a temporary file."""
        import tempfile

        with tempfile.TemporaryFile(mode="w+") as report:
            sys.stderr.flush()
            saved = os.dup(2)
            try:
                os.dup2(report.fileno(), 2)
                sys._debugmallocstats()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            report.seek(0)
            text = report.read()
        wanted = {
            "# arenas allocated current": "pymalloc_arenas",
            "# bytes in allocated blocks": "pymalloc_in_use_mb",
            "# bytes in available blocks": "pymalloc_free_in_pools_mb",
            "unused pools": "pymalloc_unused_pools_mb",
        }
        out: dict[str, Any] = {}
        for line in text.splitlines():
            for prefix, key in wanted.items():
                if prefix in line:  # "36 unused pools * 16384 bytes = 589,824": the count comes first there
                    value = int(line.rsplit("=", 1)[1].replace(",", "").strip())
                    out[key] = value if key == "pymalloc_arenas" else round(value / 2**20, 1)
        return out

    @staticmethod
    def _process() -> dict[str, Any]:
        """Threads, anonymous memory (/proc), tracemalloc's own overhead, the allocator setting the worker got, and
        which tree's known keys it runs (an A/B of a code change: ``benchmarks.soak --second-tm-env PYTHONPATH=``)."""
        out: dict[str, Any] = {
            "threads": len(os.listdir("/proc/self/task")),
            "tracemalloc_overhead_mb": round(tracemalloc.get_tracemalloc_memory() / 2**20, 1),
            "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),
            "known_keys_module": getattr(sys.modules.get("beamflow.iceberg.known_keys"), "__file__", None),
        }
        # The cyclic collector: how often each generation ran, and how many objects it tracks (cyclic garbage among
        # them until a collection of its generation finds it).
        out["gc_collections"] = [stats["collections"] for stats in gc.get_stats()]
        out["gc_thresholds"] = list(gc.get_threshold())
        out["gc_tracked"] = len(gc.get_objects())
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Anonymous:"):
                    out["anonymous_mb"] = round(int(line.split()[1]) / 1024, 1)
        return out

    def _survivors(self, now: float) -> None:
        """At the window's start, the tracked objects' addresses; at its end, what is new among them."""
        if self.survivors is None:
            return
        start, end = self.survivors
        if now >= start and self.born_before is None:
            self.born_before = np.sort(np.fromiter(map(id, gc.get_objects()), np.int64))
        elif now >= end and self.born_before is not None:
            self.survivors = None
            started = time.monotonic()
            everything = gc.get_objects()
            addresses = np.fromiter(map(id, everything), np.int64, len(everything))
            new = ~np.isin(addresses, self.born_before, assume_unique=False)
            tracked_at_start, self.born_before = len(self.born_before), None
            survivors = [everything[i] for i in np.flatnonzero(new)]
            of_type: dict[str, list[object]] = collections.defaultdict(list)
            for o in survivors:
                of_type[_name(o)].append(o)
            by_type = collections.Counter({name: len(objects) for name, objects in of_type.items()})
            # Who holds the survivors: one pass over every object's referents, for a sample of each common type.
            sample: dict[int, str] = {}
            for name, count in by_type.most_common(_SURVIVOR_TYPES):
                for o in of_type[name][:: max(1, count // _SURVIVOR_SAMPLE)][:_SURVIVOR_SAMPLE]:
                    sample[id(o)] = name
            holders: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
            for holder in everything:
                for referent in gc.get_referents(holder):
                    sampled = sample.get(id(referent))
                    if sampled is not None:
                        holders[sampled][_name(holder)] += 1
            report = {
                "window_s": [round(start - self.t0), round(end - self.t0)],
                "tracked_at_start": tracked_at_start,
                "tracked_at_end": len(addresses),
                "survivors": int(new.sum()),
                "survivor_bytes_shallow": sum(sys.getsizeof(o) for o in survivors),
                "by_type": by_type.most_common(_SURVIVOR_TOP),
                "holders": {name: holders[name].most_common(8) for name, _ in by_type.most_common(_SURVIVOR_TYPES)},
                "census_s": round(time.monotonic() - started, 2),
            }
            del everything, survivors, of_type
            (self.out.parent / f"{os.getpid()}.survivors.json").write_text(json.dumps(report, indent=1))

    def maybe(self) -> None:
        now = time.monotonic()
        self._survivors(now)
        if now < self.next_at:
            return
        self.next_at = now + PROBE_EVERY_S
        line: dict[str, Any] = {
            "t_s": round(now - self.t0),
            "rss_mb": round(proc_rss_mb() or 0.0, 1),
            "cpu_s": round(time.process_time(), 2),
            "gc_s": [round(seconds, 3) for seconds in self.gc_seconds],
            **self._arrow(),
            **self._malloc(),
            **self._jemalloc(),
            **self._pymalloc(),
            **self._process(),
        }
        if self.trace:
            snapshot = tracemalloc.take_snapshot()
            grown = snapshot.compare_to(self.first, "lineno")[:_TOP]
            types = self._types()
            changed = sorted(((n, types[n] - self.first_types.get(n, 0)) for n in types), key=lambda x: -abs(x[1]))
            traced, peak = tracemalloc.get_traced_memory()
            line["traced_mb"], line["traced_peak_mb"] = round(traced / 2**20, 2), round(peak / 2**20, 2)
            line["types"] = changed[:_TOP]
            line["lines"] = [(str(s.traceback), round(s.size_diff / 1024, 1), s.count_diff) for s in grown]
        with self.out.open("a") as f:
            f.write(json.dumps(line) + "\n")


_probe: _Probe | None = None


class ProbedIcebergCommitFn(write_to_iceberg._CommitPerBundle):
    """The streaming Iceberg sink, probing its worker's memory once per ``PROBE_EVERY_S``."""

    def flush(self) -> list[Any]:
        global _probe
        if _probe is None:
            _probe = _Probe()
        _probe.maybe()
        return super().flush()


def main(argv: Sequence[str] | None = None) -> int:
    from pipelines.clicks import main as clicks_main

    # WriteToIceberg.expand looks its DoFn class up in its module when the pipeline is built.
    write_to_iceberg._CommitPerBundle = ProbedIcebergCommitFn  # type: ignore[misc]
    return clicks_main(argv)


if __name__ == "__main__":
    # The importable module's class, not this __main__ copy's, so workers unpickle it by reference.
    from benchmarks.soak_probe import main as _main

    sys.exit(_main())

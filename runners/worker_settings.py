"""The Python SDK worker's speed settings, for the workers Beam's boot starts (Flink's PROCESS environment).

``apply()`` sets them for the calling process's lifetime. Workers call it at start-up through the Beam plugin
``runners.worker_plugin``: ``runners.flink`` passes ``--beam_plugins=runners.worker_plugin`` (Beam's
``sdk_worker_main`` imports every ``beam_plugins`` module before it builds the SDK harness, so the settings are in
place before the first bundle processor exists). Importing this module changes nothing. ``flink.worker_settings:
false`` leaves Beam's defaults. (The EXTERNAL pool's children, ``runners.worker_pool``, are started by Beam's pool
as ``SdkHarness(...).run()`` without ``sdk_worker_main``, so no plugin runs there: they keep Beam's defaults.)

The same two settings ``runners.direct`` applies to the in-process worker of a local run (measured there first):

- **The state sampler's period** (``SAMPLING_PERIOD_MS``, Beam's default 200 ms). Every bundle ends by joining the
  sampler's thread, which first finishes its sleep: on Flink a one-second bundle waited on average 100 ms for nothing
  (py-spy on the clicks job's worker at parallelism 1: ``StateSampler.stop`` -> ``Thread.join`` was 11% of the bundle
  threads' samples), and the fused stage waits with it. Beam 2.62 binds the period as the constructor's default at
  definition time, with no option for it.
- **The cyclic garbage collector**: what is alive once Beam is imported is frozen out of the collector's way, and the
  young generation is collected every ``WORKER_GC_THRESHOLDS[0]`` surplus allocations (tracked objects made minus
  freed) instead of 700. Not fewer: most of a worker's objects are freed by their counts, so the surplus grows only by
  what stays alive, and cyclic garbage is most of that. pyiceberg makes a cycle each time it loads a table (its
  ``PyArrowFileIO`` holds an ``lru_cache`` of its own bound method; five per commit), freed only by the
  collector. At (100,000, 50, 100) a soak's workers ran no young collection from minute 1 to 30 and grew with the
  cycles (a census of the objects one worker made over 13 minutes and still tracked: 40,000, most of them
  pyiceberg's); at (10,000, 10, 10) a soak's worker (1,500 records/s at parallelism 2) ran a young collection every
  1.0-1.3 s and a full one every 2-3 minutes, and its tracked objects stayed flat (``docs/streaming.md``, "Cyclic
  garbage the workers never collected"). What that costs, timed by the soak probe's collector callbacks: 1.1-2.0%
  of a worker's CPU (a young collection about 3.3 ms, a full one about 75 ms).
  ``tests/unit/test_worker_gc.py`` shows both.
"""

from __future__ import annotations

import gc

from apache_beam.runners.worker import statesampler

__all__ = ["PLUGIN", "SAMPLING_PERIOD_MS", "WORKER_GC_THRESHOLDS", "apply", "set_sampling_period"]

PLUGIN = "runners.worker_plugin"  # what --beam_plugins names: the module whose import calls apply()
SAMPLING_PERIOD_MS = 20
WORKER_GC_THRESHOLDS = (10_000, 10, 10)


def set_sampling_period(period_ms: int) -> tuple[object, ...] | None:
    """Makes every StateSampler built from now on wake each ``period_ms``; returns the previous defaults."""
    previous = statesampler.StateSampler.__init__.__defaults__
    statesampler.StateSampler.__init__.__defaults__ = (period_ms,)
    return previous


def apply() -> None:
    """This process's worker settings (idempotent)."""
    set_sampling_period(SAMPLING_PERIOD_MS)
    gc.freeze()
    gc.set_threshold(*WORKER_GC_THRESHOLDS)

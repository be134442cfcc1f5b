"""The local runner beamflow pins for tests and the local job.

Why not plain ``DirectRunner``: Beam's DirectRunner is a *switching* runner. It first tries Prism, a Go binary it
downloads from GitHub at run time (unreachable here and in many CI sandboxes, where it fails or, on networks that drop
packets, hangs), then silently falls back to FnApiRunner, or, for pipelines with processing-time timers or TestStream,
to the legacy BundleBasedDirectRunner, which cannot run splittable DoFns and never calls bundle finalizers. beamflow's
Kafka read is a splittable DoFn that commits offsets from a bundle finalizer, so the choice is made explicitly here:
FnApiRunner with exactly one worker (``direct_num_workers>1`` silently drops SDF residuals).

The runner is ``LocalRunner``, an FnApiRunner that runs each pipeline inside ``local_settings()``: three process-wide
settings that make the in-process worker faster (state sampler period, state cache, garbage collector), applied for
the duration of the run and restored when it ends, so building options or importing this module changes nothing.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence
from typing import Any

from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions
from apache_beam.runners.portability.fn_api_runner import worker_handlers
from apache_beam.runners.portability.fn_api_runner.fn_runner import FnApiRunner
from apache_beam.runners.worker import statesampler

from runners.worker_settings import SAMPLING_PERIOD_MS, set_sampling_period

__all__ = ["GC_THRESHOLDS", "LOCAL_RUNNER", "SAMPLING_PERIOD_MS", "LocalRunner", "local_options", "local_settings"]

LOCAL_RUNNER = "runners.direct.LocalRunner"
# SAMPLING_PERIOD_MS (runners.worker_settings): how often the SDK worker's state sampler wakes (Beam's default: 200
# ms). Every bundle ends by joining that thread, which first finishes its sleep: a long bundle waited up to 200 ms for
# nothing (about 0.3 s of the 4 s clicks job).
# The collector's generation thresholds while a local job runs (CPython's defaults: 700, 10, 10); 4-5% of the clicks
# job's wall and CPU time measured in interleaved runs.
GC_THRESHOLDS = (100_000, 50, 1000)


@contextlib.contextmanager
def local_settings() -> Iterator[None]:
    """The in-process worker's speed settings, for the duration of the ``with`` block; everything is restored after.

    ``LocalRunner`` wraps each run in this; use it directly only around another in-process FnApiRunner run.
    """
    cache_mb = worker_handlers.STATE_CACHE_SIZE_MB
    thresholds = gc.get_threshold()
    frozen_before = gc.get_freeze_count()
    # FnApiRunner's in-process state cache sizes every stored value with objsize, which walks all loaded modules on
    # each call: with stateful dedup that was two thirds of the clicks job's time. Beam 2.62 has no option for it;
    # without the cache, state is read through the state API (same results).
    worker_handlers.STATE_CACHE_SIZE_MB = 0
    # Each bundle processor builds its StateSampler with the constructor's default period, which Beam 2.62 binds at
    # definition time (no option, and changing statesampler.DEFAULT_SAMPLING_PERIOD_MS has no effect).
    sampler_defaults = set_sampling_period(SAMPLING_PERIOD_MS)
    # Python's cyclic GC walks every tracked object on each full collection, and the imports of a beamflow job (Beam,
    # pyarrow, pyiceberg, SQLAlchemy, psycopg: about 1,400 modules) leave hundreds of thousands of them, walked again
    # each time the per-element objects of the in-process worker trigger one (about 10% of the clicks job). What is
    # alive when the run starts is mostly module state: moved out of the collector's way while the run lasts.
    gc.freeze()
    # And collect less often: the worker allocates a few objects per element per step, and with CPython's defaults
    # (700, 10, 10) the young generation is collected every few elements, promoting what is still in flight.
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if frozen_before == 0:
            # CPython cannot unfreeze part of the permanent generation: when the caller had frozen objects itself,
            # what this run froze stays frozen with them (harmless: it is only exempt from collection).
            gc.unfreeze()
        statesampler.StateSampler.__init__.__defaults__ = sampler_defaults
        worker_handlers.STATE_CACHE_SIZE_MB = cache_mb


class LocalRunner(FnApiRunner):
    """FnApiRunner whose runs execute inside ``local_settings()`` (FnApiRunner runs a pipeline within this call)."""

    def run_pipeline(self, pipeline: Any, options: PipelineOptions) -> Any:
        with local_settings():
            return super().run_pipeline(pipeline, options)


def local_options(argv: Sequence[str] = (), streaming: bool = False, **overrides: object) -> PipelineOptions:
    """PipelineOptions that run on ``LocalRunner`` (FnApiRunner) in-process with one worker, whatever ``--runner``
    said. Building them changes nothing in the process; the runner applies its settings only while it runs.

    ``--runner=DirectRunner`` on beamflow's command lines means this profile.
    """
    args = [a for a in argv if not a.startswith("--runner")]
    options = PipelineOptions(args, **overrides)
    options.view_as(StandardOptions).runner = LOCAL_RUNNER
    options.view_as(StandardOptions).streaming = streaming
    direct = options.view_as(DirectOptions)
    direct.direct_num_workers = 1
    direct.direct_running_mode = "in_memory"
    return options

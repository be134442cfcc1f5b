"""The local runner beamflow pins for tests and the local job.

Why not plain ``DirectRunner``: Beam's DirectRunner is a *switching* runner. It first tries Prism, a Go binary it
downloads from GitHub at run time (unreachable here and in many CI sandboxes, where it fails or, on networks that drop
packets, hangs), then silently falls back to FnApiRunner, or, for pipelines with processing-time timers or TestStream,
to the legacy BundleBasedDirectRunner, which cannot run splittable DoFns and never calls bundle finalizers. beamflow's
Kafka read is a splittable DoFn that commits offsets from a bundle finalizer, so the choice is made explicitly here:
FnApiRunner with exactly one worker (``direct_num_workers>1`` silently drops SDF residuals).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions
from apache_beam.runners.portability.fn_api_runner import worker_handlers
from apache_beam.runners.worker import statesampler

__all__ = ["GC_THRESHOLDS", "LOCAL_RUNNER", "SAMPLING_PERIOD_MS", "local_options"]

LOCAL_RUNNER = "apache_beam.runners.portability.fn_api_runner.FnApiRunner"
# How often the SDK worker's state sampler wakes (Beam's default: 200 ms). Every bundle ends by joining that thread,
# which first finishes its sleep: a long bundle waited up to 200 ms for nothing (about 0.3 s of the 4 s clicks job).
SAMPLING_PERIOD_MS = 20
# The collector's generation thresholds while a local job runs (CPython's defaults: 700, 10, 10); 4-5% of the clicks
# job's wall and CPU time measured in interleaved runs.
GC_THRESHOLDS = (100_000, 50, 1000)


def local_options(argv: Sequence[str] = (), streaming: bool = False, **overrides: object) -> PipelineOptions:
    """PipelineOptions that run on FnApiRunner in-process with one worker, whatever ``--runner`` said.

    ``--runner=DirectRunner`` on beamflow's command lines means this profile.
    """
    args = [a for a in argv if not a.startswith("--runner")]
    options = PipelineOptions(args, **overrides)
    options.view_as(StandardOptions).runner = LOCAL_RUNNER
    options.view_as(StandardOptions).streaming = streaming
    # FnApiRunner's in-process state cache sizes every stored value with objsize, which walks all loaded modules on
    # each call: with stateful dedup that was two thirds of the clicks job's time. Beam 2.62 has no option for it;
    # without the cache, state is read through the state API (same results).
    worker_handlers.STATE_CACHE_SIZE_MB = 0
    # Each bundle processor builds its StateSampler with the constructor's default period, which Beam 2.62 binds at
    # definition time (no option, and changing statesampler.DEFAULT_SAMPLING_PERIOD_MS has no effect).
    statesampler.StateSampler.__init__.__defaults__ = (SAMPLING_PERIOD_MS,)
    # Python's cyclic GC walks every tracked object on each full collection, and the imports of a beamflow job (Beam,
    # pyarrow, pyiceberg, SQLAlchemy, psycopg: about 1,400 modules) leave hundreds of thousands of them, walked again
    # each time the per-element objects of the in-process worker trigger one (about 10% of the clicks job). What is
    # alive now is mostly module state that lives as long as the process: moved out of the collector's way.
    gc.freeze()
    # And collect less often: the worker allocates a few objects per element per step, and with CPython's defaults
    # (700, 10, 10) the young generation is collected every few elements, promoting what is still in flight.
    gc.set_threshold(*GC_THRESHOLDS)
    direct = options.view_as(DirectOptions)
    direct.direct_num_workers = 1
    direct.direct_running_mode = "in_memory"
    return options

"""The local runner beamflow pins for tests and the local job.

Why not plain ``DirectRunner``: Beam's DirectRunner is a *switching* runner. It first tries Prism, a Go binary it
downloads from GitHub at run time (unreachable here and in many CI sandboxes, where it fails or, on networks that drop
packets, hangs), then silently falls back to FnApiRunner, or, for pipelines with processing-time timers or TestStream,
to the legacy BundleBasedDirectRunner, which cannot run splittable DoFns and never calls bundle finalizers. beamflow's
Kafka read is a splittable DoFn that commits offsets from a bundle finalizer, so the choice is made explicitly here:
FnApiRunner with exactly one worker (``direct_num_workers>1`` silently drops SDF residuals).
"""

from __future__ import annotations

from collections.abc import Sequence

from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions
from apache_beam.runners.portability.fn_api_runner import worker_handlers

__all__ = ["LOCAL_RUNNER", "local_options"]

LOCAL_RUNNER = "apache_beam.runners.portability.fn_api_runner.FnApiRunner"


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
    direct = options.view_as(DirectOptions)
    direct.direct_num_workers = 1
    direct.direct_running_mode = "in_memory"
    return options

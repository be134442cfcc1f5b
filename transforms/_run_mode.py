"""What kind of run a PCollection is in (streaming or batch, bounded or not): the transforms choose paths by it."""

from __future__ import annotations

import apache_beam as beam
from apache_beam.options.pipeline_options import StandardOptions

__all__ = ["is_batch_bounded", "is_streaming"]


def is_streaming(pcoll: beam.PCollection) -> bool:
    """Whether the pipeline runs with ``--streaming``."""
    options = pcoll.pipeline.options if pcoll.pipeline is not None else None
    return options is not None and bool(options.view_as(StandardOptions).streaming)


def is_batch_bounded(pcoll: beam.PCollection) -> bool:
    """Bounded input in a batch run: the watermark moves past the input's times only once all of it was read."""
    return bool(pcoll.is_bounded) and not is_streaming(pcoll)

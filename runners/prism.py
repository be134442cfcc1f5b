"""Prism, Beam's portable local runner, built here from the Go module proxy and pinned by path.

Why: FnApiRunner runs stage after stage, so downstream windows fire only once the (unbounded) read has finished; it
cannot show a watermark moving mid-stream. Prism is a real streaming runner (the engine Beam's DirectRunner would
download from GitHub at run time, which this project never relies on). Building it needs Go and the Go module proxy;
the checksum database is not reachable from every sandbox, so the build is pinned by the module version instead.
Used for streaming-semantics tests (idle partitions, late data); the Kafka read's bundle finalizer is not supported
by Prism 2.62 (it logs "Bundle is not in a finalizable state"), so tests on Prism read without committing offsets.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

from beamflow.services.gobuild import go_install
from beamflow.services.paths import cache_dir

__all__ = ["PRISM_VERSION", "ensure_prism", "prism_options"]

PRISM_VERSION = "v2.62.0"  # the Go SDK tag matching apache-beam==2.62.0


def ensure_prism(cache: Path | None = None) -> Path:
    """The prism binary, built once into the cache (``beamflow.services.gobuild``)."""
    return go_install("github.com/apache/beam/sdks/v2/go/cmd/prism", PRISM_VERSION, "prism", cache or cache_dir())


def prism_options(argv: Sequence[str] = (), streaming: bool = True) -> PipelineOptions:
    options = PipelineOptions(
        [a for a in argv if not a.startswith("--runner")] + [f"--prism_location={ensure_prism()}"]
    )
    options.view_as(StandardOptions).runner = "PrismRunner"
    options.view_as(StandardOptions).streaming = streaming
    return options

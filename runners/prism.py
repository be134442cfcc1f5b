"""Prism, Beam's portable local runner, built here from the Go module proxy (patched to bind loopback only).

Why Prism: FnApiRunner runs stage after stage, so downstream windows fire only once the (unbounded) read has finished;
it cannot show a watermark moving mid-stream. Prism is a real streaming runner (the engine Beam's DirectRunner would
download from GitHub at run time, which this project never relies on). Building it needs Go and the Go module proxy;
the checksum database is not reachable from every sandbox, so the build is pinned by the module version instead.
Used for streaming-semantics tests (idle partitions, late data); the Kafka read's bundle finalizer is not supported
by Prism 2.62 (it logs "Bundle is not in a finalizable state"), so tests on Prism read without committing offsets.

Why patched: Prism 2.62 listens on every interface, and no flag changes that. Its job service
(``pkg/beam/runners/prism/internal/jobservices/server.go:67``, ``net.Listen("tcp", fmt.Sprintf(":%d", port))``) and
the Fn API servers it starts for SDK workers (``internal/worker/worker.go:87``, ``net.Listen("tcp", ":0")``) bind
``[::]``: anyone who reaches the job port can submit a pipeline, i.e. run code here. Its web UI
(``internal/web/web.go:436``, ``fmt.Sprintf("localhost:%d", port)``) binds the first address ``localhost`` resolves
to; it is on although Beam's ``PrismJobServer`` passes ``--serve_http False`` (a Go boolean flag takes no separate
value: ``--serve_http`` sets it true and ``False`` ends flag parsing), always on port 8074.

How: ``ensure_prism`` copies the ``github.com/apache/beam/sdks/v2@v2.62.0`` module from the Go module cache to a
writable folder under the cache, replaces those three sites with literal ``127.0.0.1`` binds (``LOOPBACK_PATCHES``),
and ``go build``\\ s ``./go/cmd/prism`` there with the same environment as every Go build here
(``beamflow.services.gobuild``), cached by a hash of version and patches: built once. A site not found exactly once,
or a listen call in Prism's source (``go/pkg/beam/runners/prism``, ``go/cmd/prism``) that no patch covers, stops the
build with one error line, so a Beam upgrade cannot silently build a Prism that listens everywhere. Two other listen
calls are linked into the binary from the Go SDK but never run by ``cmd/prism``: ``core/runtime/xlangx/expansionx``
(``:0``, a port picker closed at once, for launching a Java expansion service from a Go pipeline) and
``runners/universal/extworker`` (``localhost``, the Go SDK's LOOPBACK worker).

The Python SDK side: Prism runs Python pipelines in the LOOPBACK environment, whose worker pool Beam starts in the
submitting process on ``[::]``; ``prism_options`` makes it bind 127.0.0.1 (``runners.worker_pool``).
``tests/services/test_prism_loopback_only.py`` lists every listening socket of Prism and of the submitting process
with a job running.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

from beamflow.services.base import ServiceError
from beamflow.services.gobuild import SourcePatch, go_build_patched
from beamflow.services.paths import cache_dir

__all__ = ["LOOPBACK_PATCHES", "PRISM_MODULE", "PRISM_VERSION", "check_listen_sites", "ensure_prism", "prism_options"]

PRISM_VERSION = "v2.62.0"  # the Go SDK tag matching apache-beam==2.62.0
PRISM_MODULE = "github.com/apache/beam/sdks/v2"
PRISM_PACKAGE = "go/cmd/prism"
_PRISM = "go/pkg/beam/runners/prism"
# Prism's own source, where every listen call must be covered by a patch.
PRISM_SOURCE_DIRS = (_PRISM, PRISM_PACKAGE)

LOOPBACK_PATCHES = (
    SourcePatch(  # the job service (job port): [::]:<port>
        f"{_PRISM}/internal/jobservices/server.go",
        'net.Listen("tcp", fmt.Sprintf(":%d", port))',
        'net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))',
    ),
    SourcePatch(  # the Fn API servers (control, data, state, logging, provisioning) per SDK environment: [::]:0
        f"{_PRISM}/internal/worker/worker.go",
        'net.Listen("tcp", ":0")',
        'net.Listen("tcp", "127.0.0.1:0")',
    ),
    SourcePatch(  # the web UI: whatever "localhost" resolves to first, on 8074
        f"{_PRISM}/internal/web/web.go",
        'endpoint := fmt.Sprintf("localhost:%d", port)',
        'endpoint := fmt.Sprintf("127.0.0.1:%d", port)',
    ),
)

_LISTEN_CALL = re.compile(
    r"\.(?:Listen|ListenPacket|ListenTCP|ListenUDP|ListenUnix|ListenAndServe|ListenAndServeTLS)\("
)


def listen_calls(module_root: Path) -> dict[str, int]:
    """Listen calls per file (relative path) in Prism's non-test Go source under ``module_root``."""
    found: dict[str, int] = {}
    for folder in PRISM_SOURCE_DIRS:
        for path in sorted((module_root / folder).rglob("*.go")):
            if path.name.endswith("_test.go"):
                continue
            code = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("//")]
            count = sum(len(_LISTEN_CALL.findall(line)) for line in code)
            if count:
                found[path.relative_to(module_root).as_posix()] = count
    return found


def check_listen_sites(module_root: Path) -> None:
    """One-line ``ServiceError`` unless each file of Prism's source with listen calls has one patch per call."""
    patched: dict[str, int] = {}
    for patch in LOOPBACK_PATCHES:
        patched[patch.file] = patched.get(patch.file, 0) + 1
    found = listen_calls(module_root)
    unreviewed = {file: n for file, n in found.items() if patched.get(file, 0) != n}
    if unreviewed:
        raise ServiceError(
            f"prism {PRISM_VERSION}: listen calls not covered by LOOPBACK_PATCHES in {unreviewed} (patched: "
            f"{patched}); review runners/prism.py for this version"
        )


def ensure_prism(cache: Path | None = None) -> Path:
    """The prism binary, patched to bind loopback only and built once into the cache (see the module docstring)."""
    return go_build_patched(
        PRISM_MODULE,
        PRISM_VERSION,
        PRISM_PACKAGE,
        "prism",
        LOOPBACK_PATCHES,
        cache or cache_dir(),
        verify=check_listen_sites,
    )


def prism_options(argv: Sequence[str] = (), streaming: bool = True) -> PipelineOptions:
    from runners.worker_pool import bind_loopback_worker_pool

    # Prism runs Python workers in the LOOPBACK environment; Beam's in-process pool binds [::], beamflow's 127.0.0.1.
    bind_loopback_worker_pool()
    options = PipelineOptions(
        [a for a in argv if not a.startswith("--runner")] + [f"--prism_location={ensure_prism()}"]
    )
    options.view_as(StandardOptions).runner = "PrismRunner"
    options.view_as(StandardOptions).streaming = streaming
    return options

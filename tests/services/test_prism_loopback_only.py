"""Nobody gets in through Prism: with a job running, every listening socket of the Prism process (and its children)
and every socket the job opened in this process (the LOOPBACK worker pool) is on a loopback address.

Prism 2.62 binds its job service and its Fn API servers on every interface; ``runners.prism`` builds it from a patched
copy of its source. The first tests show why: the unpatched source in the Go module cache has the wildcard binds,
and a patch site that is not found, or a listen call no patch covers, stops the build.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.runners.runner import PipelineState

from beamflow.services.base import ServiceError, wait_until
from beamflow.services.gobuild import SourcePatch, module_source, patched_text
from beamflow.services.paths import cache_dir
from runners.prism import (
    LOOPBACK_PATCHES,
    PRISM_MODULE,
    PRISM_SOURCE_DIRS,
    PRISM_VERSION,
    check_listen_sites,
    ensure_prism,
    listen_calls,
    prism_options,
)
from tests.sockets import Bound, SocketGate, bound_sockets, with_descendants

pytestmark = [pytest.mark.services, pytest.mark.usefixtures("prism")]

_JOB_SERVICE = "go/pkg/beam/runners/prism/internal/jobservices/server.go"
_WORKER = "go/pkg/beam/runners/prism/internal/worker/worker.go"


def _pristine() -> Path:
    return module_source(PRISM_MODULE, PRISM_VERSION, cache_dir())


def test_the_unpatched_prism_source_listens_on_every_interface() -> None:
    """Why the patch exists: Prism 2.62 as published binds its job port and its Fn API servers to the wildcard."""
    source = _pristine()
    job_service = (source / _JOB_SERVICE).read_text()
    worker = (source / _WORKER).read_text()
    assert 'net.Listen("tcp", fmt.Sprintf(":%d", port))' in job_service
    assert 'net.Listen("tcp", ":0")' in worker
    # Every listen call in Prism's own source is one of the patched sites, and each patch applies exactly once.
    assert listen_calls(source) == {patch.file: 1 for patch in LOOPBACK_PATCHES}
    for patch in LOOPBACK_PATCHES:
        patched = patched_text(source, patch, PRISM_MODULE, PRISM_VERSION)
        assert patch.old not in patched and patch.new in patched
        assert "127.0.0.1" in patch.new


def _prism_tree(destination: Path) -> Path:
    """A writable copy of Prism's own source folders (not the whole module)."""
    source = _pristine()
    for folder in PRISM_SOURCE_DIRS:
        shutil.copytree(source / folder, destination / folder, copy_function=shutil.copyfile)
    for folder, dirs, _ in os.walk(destination):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o755)
    return destination


def test_a_moved_patch_site_or_a_new_listen_call_stops_the_build(tmp_path: Path) -> None:
    """A Beam upgrade must not silently build a Prism that listens everywhere."""
    tree = _prism_tree(tmp_path)
    check_listen_sites(tree)  # the published 2.62 source: every listen call is covered
    moved = tree / _WORKER
    moved.write_text(moved.read_text().replace('net.Listen("tcp", ":0")', 'net.Listen("tcp", ":"+port)'))
    with pytest.raises(ServiceError) as caught:
        patched_text(tree, LOOPBACK_PATCHES[1], PRISM_MODULE, PRISM_VERSION)
    assert "found 0 times" in str(caught.value) and "\n" not in str(caught.value)
    extra = tree / "go/pkg/beam/runners/prism/internal/debug.go"
    extra.write_text('package internal\n\nfunc debug() { net.Listen("tcp", ":6060") }\n')
    with pytest.raises(ServiceError) as caught:
        check_listen_sites(tree)
    assert "internal/debug.go" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ServiceError):
        patched_text(tree, SourcePatch("go/no/such/file.go", "x", "y"), PRISM_MODULE, PRISM_VERSION)


def _prism_processes(binary: Path) -> dict[int, int]:
    """pid -> job port of every Prism process below this one running ``binary``."""
    found: dict[int, int] = {}
    for pid in with_descendants([os.getpid()]) - {os.getpid()}:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if argv and argv[0] == str(binary) and "--job_port" in argv:
            found[pid] = int(argv[argv.index("--job_port") + 1])
    return found


def _table(found: Iterable[Bound]) -> str:
    return "\n".join(f"  {'ok     ' if b.loopback else 'EXPOSED'} {b}" for b in found)


def test_prism_and_the_loopback_workers_listen_on_loopback_only_with_a_job_running(tmp_path: Path) -> None:
    options = prism_options()  # builds the patched Prism first (about a minute on a cold cache)
    binary = ensure_prism()
    before = {(b.proto, b.port) for b in bound_sockets([os.getpid()])}
    pipeline = beam.Pipeline(options=options)
    _ = pipeline | beam.Create([1, 2]) | beam.Reshuffle() | beam.ParDo(SocketGate(str(tmp_path)))
    result = pipeline.run()
    try:
        wait_until(lambda: any(tmp_path.glob("started-*")), 240, "a gated element in the SDK worker")
        time.sleep(1.0)
        prisms = _prism_processes(binary)
        in_prism = bound_sockets(with_descendants(prisms))
        in_here = [b for b in bound_sockets([os.getpid()]) if (b.proto, b.port) not in before]
    finally:
        (tmp_path / "release").write_text("")
    assert result.wait_until_finish() == PipelineState.DONE
    print(
        f"\nPrism processes (pid: job port) {prisms}; their listening sockets, a job running:\n{_table(in_prism)}"
        f"\nsockets the job opened in this process (pid {os.getpid()}):\n{_table(in_here)}"
    )
    assert prisms, f"no process of {binary} below this one"
    assert [b for b in in_prism if b.pid in prisms and b.port == prisms[b.pid]], "no Prism job port listed\n" + _table(
        in_prism
    )
    # Prism's Fn API servers for the job's SDK worker (neither a job port nor the web UI's 8074) were listed too.
    fn_api = [b for b in in_prism if b.port not in prisms.values() and b.port != 8074]
    assert fn_api, "no Fn API server in Prism: the job's servers were not listed\n" + _table(in_prism)
    assert in_here, "the LOOPBACK worker pool's socket was not found in this process"
    exposed = [b for b in [*in_prism, *in_here] if not b.loopback]
    assert not exposed, "reachable from other machines:\n" + _table(exposed)

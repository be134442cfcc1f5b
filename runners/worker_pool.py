"""The Python worker pool for Flink's EXTERNAL environment: run one beside each TaskManager.

::

    python -m runners.worker_pool --port 50000                  # listens on 127.0.0.1:50000
    python -m runners.worker_pool --port 50000 --host 0.0.0.0   # only if the TaskManager is on another host

and configure the job with ``flink: {environment: {type: EXTERNAL, config: "localhost:50000"}}``. The TaskManager asks
the pool for a worker per environment; the pool starts each as a child process (``sdk_worker_main``), so the job's
code (``beamflow``, ``transforms``, ``pipelines``) must be importable where the pool runs: start it from the project
folder or with beamflow installed.

The pool also answers ``VERSIONS_METHOD`` with the apache-beam and Python versions it runs workers with, so a
submitter can refuse a pool whose workers would not understand its pipeline (``runners.flink.check_reachable``):
pickled functions and Beam's protos are only compatible within one apache-beam version and one Python minor version.

Why not ``apache_beam.runners.worker.worker_pool_main`` directly: it binds every interface (``[::]``) and cannot be
told otherwise; a worker pool executes whatever code a caller sends it, so beamflow binds loopback unless told.

The same holds for the LOOPBACK environment: Beam's portable runner starts its in-process pool with
``BeamFnExternalWorkerPoolServicer.start``, which binds ``[::]`` too and has no parameter for the host.
``bind_loopback_worker_pool()`` (called by ``runners.flink`` for every LOOPBACK submission) replaces that one
classmethod in this process with ``loopback_start``, which binds 127.0.0.1: Beam has no hook for it, and the
replacement is confined to the submitting process and to that method (the pool's servicer is Beam's own).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

import grpc
from apache_beam.portability.api import beam_fn_api_pb2_grpc
from apache_beam.runners.worker.worker_pool_main import BeamFnExternalWorkerPoolServicer
from apache_beam.utils import thread_pool_executor

__all__ = [
    "BEAM_START",
    "VERSIONS_METHOD",
    "bind_loopback_worker_pool",
    "local_versions",
    "loopback_start",
    "main",
    "pool_versions",
    "start_worker_pool",
]

# A gRPC method of beamflow's own beside Beam's worker pool service: empty request, JSON of ``local_versions()``.
VERSIONS_METHOD = "/beamflow.WorkerPool/Versions"


def local_versions() -> dict[str, str]:
    """What a worker started here runs: apache-beam's version and Python's major.minor."""
    import apache_beam

    return {"apache_beam": apache_beam.__version__, "python": f"{sys.version_info[0]}.{sys.version_info[1]}"}


def pool_versions(address: str, timeout_s: float = 5.0) -> dict[str, str] | None:
    """The versions a worker pool at ``address`` reports; None if it is not beamflow's pool (no such method).

    Raises ``grpc.RpcError`` when nothing answers in ``timeout_s``."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(VERSIONS_METHOD)
        try:
            reply = call(b"", timeout=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise
    versions: dict[str, str] = json.loads(reply)
    return versions


def _versions_handler() -> grpc.GenericRpcHandler:
    reply = json.dumps(local_versions()).encode()
    method = grpc.unary_unary_rpc_method_handler(lambda _request, _context: reply)
    return grpc.method_handlers_generic_handler(VERSIONS_METHOD.split("/")[1], {VERSIONS_METHOD.split("/")[2]: method})


_LOG = logging.getLogger("runners.worker_pool")


def start_worker_pool(host: str = "127.0.0.1", port: int = 0) -> tuple[str, grpc.Server]:
    """Starts the pool's gRPC service; returns its ``host:port`` and the server (``server.stop(0)`` ends it)."""
    _this_python_first()
    server = grpc.server(
        thread_pool_executor.shared_unbounded_instance(),
        options=[("grpc.http2.max_pings_without_data", 0), ("grpc.http2.max_ping_strikes", 0)],
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind the worker pool to {host}:{port}")
    # use_process: each SDK worker is its own process, as beside a production TaskManager.
    beam_fn_api_pb2_grpc.add_BeamFnExternalWorkerPoolServicer_to_server(
        BeamFnExternalWorkerPoolServicer(use_process=True), server
    )
    server.add_generic_rpc_handlers((_versions_handler(),))
    server.start()
    return f"{host}:{bound}", server


def loopback_start(
    cls: type[BeamFnExternalWorkerPoolServicer],
    use_process: bool = False,
    port: int = 0,
    state_cache_size: int = 0,
    data_buffer_time_limit_ms: int = -1,
    container_executable: str | None = None,
) -> tuple[str, grpc.Server]:
    """``BeamFnExternalWorkerPoolServicer.start`` (same parameters and result) on 127.0.0.1 instead of ``[::]``."""
    server = grpc.server(
        thread_pool_executor.shared_unbounded_instance(),
        options=[("grpc.http2.max_pings_without_data", 0), ("grpc.http2.max_ping_strikes", 0)],
    )
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind the LOOPBACK worker pool to 127.0.0.1:{port}")
    pool = cls(
        use_process=use_process,
        container_executable=container_executable,
        state_cache_size=state_cache_size,
        data_buffer_time_limit_ms=data_buffer_time_limit_ms,
    )
    beam_fn_api_pb2_grpc.add_BeamFnExternalWorkerPoolServicer_to_server(pool, server)
    server.start()
    _LOG.info("LOOPBACK worker pool listening on 127.0.0.1:%s", bound)

    def stop_workers() -> None:  # as Beam's start: worker processes end with this process
        from apache_beam.runners.worker.worker_pool_main import kill_process_gracefully

        for process in list(pool._worker_processes.values()):
            kill_process_gracefully(process)

    atexit.register(stop_workers)
    return f"127.0.0.1:{bound}", server


# Beam's own classmethod, before bind_loopback_worker_pool replaces it (tests show that it binds every interface).
BEAM_START = BeamFnExternalWorkerPoolServicer.__dict__["start"]


def bind_loopback_worker_pool() -> None:
    """Makes Beam's LOOPBACK pool in this process bind 127.0.0.1 (``loopback_start``); idempotent."""
    current = BeamFnExternalWorkerPoolServicer.__dict__.get("start")
    if getattr(getattr(current, "__func__", None), "__name__", "") != loopback_start.__name__:
        BeamFnExternalWorkerPoolServicer.start = classmethod(loopback_start)  # type: ignore[method-assign,assignment]


def _this_python_first() -> None:
    """Beam's pool starts each worker as ``python -c ...`` found on PATH; make that this interpreter (its venv)."""
    here = os.path.dirname(sys.executable)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != here:
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runners.worker_pool", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=50000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    address, server = start_worker_pool(args.host, args.port)
    print(f"worker pool listening on {address}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    server.stop(5).wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

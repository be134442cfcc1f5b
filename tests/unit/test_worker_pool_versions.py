"""The submitter refuses an EXTERNAL worker pool that is down or runs other versions, in one line, before submitting.

Real gRPC servers on loopback: beamflow's pool (``runners.worker_pool``), Beam's own pool service without beamflow's
versions method, and a pool answering the versions method with another apache-beam (what an old sidecar image would
say: the one piece of fault injection here).
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator

import grpc
import pytest
from apache_beam.portability.api import beam_fn_api_pb2_grpc
from apache_beam.runners.worker.worker_pool_main import BeamFnExternalWorkerPoolServicer
from apache_beam.utils import thread_pool_executor

from runners.flink import SubmissionError, check_reachable, worker_pool_problem
from runners.worker_pool import VERSIONS_METHOD, local_versions, pool_versions, start_worker_pool


@pytest.fixture
def beamflow_pool() -> Iterator[str]:
    address, server = start_worker_pool("127.0.0.1", 0)
    yield address
    server.stop(0)


def _server(handlers: tuple[grpc.GenericRpcHandler, ...] = (), beam_pool: bool = False) -> tuple[str, grpc.Server]:
    server = grpc.server(thread_pool_executor.shared_unbounded_instance())
    port = server.add_insecure_port("127.0.0.1:0")
    if beam_pool:
        beam_fn_api_pb2_grpc.add_BeamFnExternalWorkerPoolServicer_to_server(BeamFnExternalWorkerPoolServicer(), server)
    server.add_generic_rpc_handlers(handlers)
    server.start()
    return f"127.0.0.1:{port}", server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_beamflows_pool_reports_the_versions_its_workers_run(beamflow_pool: str) -> None:
    assert pool_versions(beamflow_pool) == local_versions()
    assert worker_pool_problem(beamflow_pool) is None


def test_a_pool_of_another_apache_beam_is_refused_naming_both_versions() -> None:
    old = {**local_versions(), "apache_beam": "2.61.0"}
    reply = json.dumps(old).encode()
    service, method = VERSIONS_METHOD.strip("/").split("/")
    handler = grpc.method_handlers_generic_handler(
        service, {method: grpc.unary_unary_rpc_method_handler(lambda _r, _c: reply)}
    )
    address, server = _server((handler,), beam_pool=True)
    try:
        problem = worker_pool_problem(address)
        assert problem is not None
        assert "apache_beam 2.61.0" in problem and f"here {local_versions()['apache_beam']}" in problem
        with pytest.raises(SubmissionError, match=r"apache_beam 2\.61\.0"):
            check_reachable(_config(address, job_endpoint=address))
    finally:
        server.stop(0)


def test_a_pool_that_is_down_is_refused_with_the_command_that_starts_one() -> None:
    port = _free_port()
    problem = worker_pool_problem(f"127.0.0.1:{port}", timeout_s=1.0)
    assert problem is not None and f"python -m runners.worker_pool --port {port}" in problem


def test_beams_own_pool_is_accepted_with_a_warning_that_its_version_is_unchecked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    address, server = _server(beam_pool=True)
    try:
        with caplog.at_level(logging.WARNING, logger="runners.flink"):
            assert worker_pool_problem(address) is None
        assert "unchecked" in caplog.text
    finally:
        server.stop(0)


def _config(pool: str, job_endpoint: str) -> dict[str, object]:
    return {"job_endpoint": job_endpoint, "environment": {"type": "EXTERNAL", "config": pool}}

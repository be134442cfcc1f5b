"""Nobody gets in: every socket that a process of the local service set listens on is bound to a loopback address.

With a job running on the Flink cluster (so the TaskManagers' Fn API servers for the Python workers exist), every
listening TCP socket and every unconnected UDP socket (``/proc/net/{tcp,tcp6,udp,udp6}`` joined with the socket
inodes under ``/proc/<pid>/fd``) of every process the service set started (each service's pids and all their
descendants: the JVMs, PostgreSQL's backends, the TaskManagers' ``boot`` and Python workers) must be on 127.0.0.0/8
or ::1. The LOOPBACK environment's worker pool lives in the submitting process: the last test checks this process.
The first test shows the check itself fails on a wildcard bind two processes down.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.runners.runner import PipelineState

from beamflow.services import ServiceSet, ServiceState
from beamflow.services.base import free_port, wait_until
from runners.flink import options_for_service
from tests.sockets import Bound, SocketGate, bound_sockets, with_descendants

pytestmark = pytest.mark.flink


def service_pids(services: ServiceSet, names: Iterable[str]) -> dict[str, set[int]]:
    """Each service's recorded pids with all their descendants."""
    pids: dict[str, set[int]] = {}
    for name in names:
        state = services.get(name).state()
        assert state is not None and state.pids, f"{name} is not running"
        pids[name] = with_descendants(state.pids)
    return pids


def test_the_check_finds_a_wildcard_bind_in_a_grandchild() -> None:
    """The guarantee broken on purpose: sockets on 0.0.0.0 and [::], two processes below the root, are found."""
    script = (
        "import socket, sys, time\n"
        "socks = []\n"
        "for family, host in ((socket.AF_INET, '0.0.0.0'), (socket.AF_INET6, '::'), (socket.AF_INET, '127.0.0.1')):\n"
        "    s = socket.socket(family); s.bind((host, 0)); s.listen(); socks.append(s)\n"
        "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(('0.0.0.0', 0)); socks.append(u)\n"
        "print(' '.join(str(s.getsockname()[1]) for s in socks), flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen(
        ["sh", "-c", f'"{sys.executable}" -c "$0"; :', script], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert parent.stdout is not None
        wildcard4, wildcard6, loopback, udp = (int(p) for p in parent.stdout.readline().split())
        found = bound_sockets(with_descendants([parent.pid]))
        exposed = {(b.proto, b.port) for b in found if not b.loopback}
        assert {("tcp", wildcard4), ("tcp6", wildcard6), ("udp", udp)} <= exposed, found
        assert [b for b in found if b.port == loopback and b.loopback], found
        assert parent.pid not in {b.pid for b in found}  # the sockets are the grandchild's
    finally:
        os.killpg(parent.pid, 9)
        parent.wait(10)


def _run_gated(flink: ServiceState, folder: Path, environment: object | None, sample: object) -> list[Bound]:
    """Submits a two-element job whose workers wait at the gate, lists the sockets with ``sample()`` while one
    waits, releases them, and returns the list once the job finished."""
    config: dict[str, object] = {
        "job_name": f"beamflow-loopback-{uuid.uuid4().hex[:8]}",
        "parallelism": 2,
        "checkpointing_interval_ms": 1000,
        "shutdown_sources_after_idle_ms": 1000,
    }
    if environment is not None:
        config["environment"] = environment
    pipeline = beam.Pipeline(options=options_for_service(flink, config))
    _ = pipeline | beam.Create([1, 2]) | beam.Reshuffle() | beam.ParDo(SocketGate(str(folder)))
    result = pipeline.run()
    try:
        # One element at the gate is enough: its worker's Fn API servers are up (both may share one bundle).
        wait_until(lambda: any(folder.glob("started-*")), 240, "a gated element in the Python workers")
        time.sleep(2.0)  # a moment for the other subtask's environment, if it has one
        listed: list[Bound] = sample()  # type: ignore[operator]
    finally:
        (folder / "release").write_text("")
    assert result.wait_until_finish() == PipelineState.DONE
    return listed


def _table(found: Iterable[Bound]) -> str:
    return "\n".join(f"  {'ok     ' if b.loopback else 'EXPOSED'} {b}" for b in found)


def test_every_port_of_the_service_set_is_loopback_only_with_a_job_running(
    kafka: ServiceState,
    postgres: ServiceState,
    registry: ServiceState,
    flink: ServiceState,
    service_set: ServiceSet,
    tmp_path: Path,
) -> None:
    names = ["kafka", "postgres", "registry", "flink"]
    listed: dict[str, list[Bound]] = {}

    def sample() -> list[Bound]:
        for name, pids in service_pids(service_set, names).items():
            listed[name] = bound_sockets(pids)
        return [b for found in listed.values() for b in found]

    everything = _run_gated(flink, tmp_path, None, sample)
    print("\nlistening sockets of the service set, a job running:\n" + _table(everything))
    # The listing saw what it must: each service's own ports, and Fn API servers in the TaskManagers for the job.
    for name in names:
        state = service_set.get(name).state()
        assert state is not None
        ports = {b.port for b in listed[name]}
        expected = {port for key, port in state.ports.items() if key != "expansion" or port > 0}
        assert expected <= ports, (name, sorted(expected - ports), _table(listed[name]))
    roles = flink.info["roles"]
    taskmanagers = [pid for role, pid in roles.items() if role.startswith("taskmanager")]
    own = {port for port in flink.ports.values()}
    fn_api = [b for b in listed["flink"] if b.pid in taskmanagers and b.port not in own]
    assert fn_api, "no Fn API server in a TaskManager: the job's servers were not listed\n" + _table(listed["flink"])
    exposed = [b for b in everything if not b.loopback]
    assert not exposed, "reachable from other machines:\n" + _table(exposed)


def test_the_loopback_environment_worker_pool_binds_loopback(flink: ServiceState, tmp_path: Path) -> None:
    """LOOPBACK: Beam's worker pool runs in the submitting process (this one), with the job's SDK workers."""
    before = {(b.proto, b.port) for b in bound_sockets([os.getpid()])}

    def sample() -> list[Bound]:
        return [b for b in bound_sockets([os.getpid()]) if (b.proto, b.port) not in before]

    opened = _run_gated(flink, tmp_path, "LOOPBACK", sample)
    print("\nsockets the LOOPBACK job opened in this process:\n" + _table(opened))
    assert opened, "the LOOPBACK worker pool's socket was not found in this process"
    exposed = [b for b in opened if not b.loopback]
    assert not exposed, "reachable from other machines:\n" + _table(exposed)


def test_the_loopback_pool_replacement_is_what_binds() -> None:
    """Beam's own LOOPBACK pool start binds [::] (why the replacement exists); beamflow's binds 127.0.0.1."""
    from apache_beam.runners.worker.worker_pool_main import BeamFnExternalWorkerPoolServicer

    from runners.worker_pool import BEAM_START, bind_loopback_worker_pool

    def bound_by(start: object) -> list[Bound]:
        address, server = start()  # type: ignore[operator]
        try:
            port = int(address.rsplit(":", 1)[1])
            return [b for b in bound_sockets([os.getpid()]) if b.port == port]
        finally:
            server.stop(0)

    beams = bound_by(BEAM_START.__get__(None, BeamFnExternalWorkerPoolServicer))
    assert beams and not any(b.loopback for b in beams), _table(beams)
    bind_loopback_worker_pool()
    ours = bound_by(BeamFnExternalWorkerPoolServicer.start)
    assert ours and all(b.loopback for b in ours), _table(ours)


def test_the_launcher_binds_only_the_address_a_cluster_deployment_names(
    flink: ServiceState, service_set: ServiceSet, tmp_path: Path
) -> None:
    """docs/deploying/job-server.yaml runs the launcher with ``-Dbeamflow.job-server.bind-address=$(POD_IP)`` and
    ``--job-host`` = the Service's name: the job and artifact ports listen on that one address (127.0.0.2 here, a
    stand-in for the pod's IP that no other test uses), whatever host the URLs carry; the wildcard is refused."""
    from beamflow.services.flink import JOB_SERVER_MAIN, FlinkService

    service: FlinkService = service_set.get("flink")  # type: ignore[assignment]
    classpath = os.pathsep.join([str(service.launcher_jar()), f"{service.job_server_classpath()}/*"])
    job_port = free_port()
    artifact_port = next(p for p in iter(free_port, None) if p != job_port)

    def launch(bind: str) -> subprocess.Popen[bytes]:
        argv = [
            "java", f"-Dbeamflow.job-server.bind-address={bind}", "-cp", classpath, JOB_SERVER_MAIN,
            f"--flink-master=127.0.0.1:{flink.ports['rest']}", "--job-host=beam-job-server.beamflow.invalid",
            f"--job-port={job_port}", f"--artifact-port={artifact_port}", "--expansion-port=-1",
            f"--artifacts-dir={tmp_path / 'artifacts'}",
        ]  # fmt: skip
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    named = launch("127.0.0.2")
    try:
        wait_until(lambda: {b.port for b in bound_sockets([named.pid])} >= {job_port, artifact_port}, 60, "bound")
        found = [b for b in bound_sockets([named.pid]) if b.port in (job_port, artifact_port)]
        assert {(b.address, b.port) for b in found} == {("127.0.0.2", job_port), ("127.0.0.2", artifact_port)}, _table(
            found
        )
    finally:
        named.kill()
        named.wait(10)
    wildcard = launch("0.0.0.0")
    out, _ = wildcard.communicate(timeout=60)
    assert wildcard.returncode != 0 and b"is the wildcard" in out, out[-2000:]

"""The real Flink session cluster FlinkService starts, running a Beam Python pipeline through Beam's job server."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import pytest
from apache_beam.runners.runner import PipelineState

from beamflow.flink_rest import FlinkRest
from beamflow.services import ServiceState
from beamflow.services.base import wait_until
from beamflow.services.flink import FlinkService
from beamflow.services.paths import cache_dir
from runners.flink import WORKER_ENV, options_for_service
from runners.worker_settings import SAMPLING_PERIOD_MS, WORKER_GC_THRESHOLDS
from tests.flink.drill_support import job_blobs

pytestmark = pytest.mark.flink


class WriteSquare(beam.DoFn):
    """Writes one file per element from the SDK worker: the test reads what the cluster really processed."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def process(self, element: int) -> Iterator[int]:
        path = os.path.join(self.out_dir, f"{element}.txt")
        with open(path, "w") as f:
            f.write(str(element * element))
        yield element


class RecordWorkerSettings(beam.DoFn):
    """Writes, per element, the worker's garbage-collector thresholds, state-sampler period and allocator setting
    (``worker_settings``)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def process(self, element: int) -> Iterator[int]:
        import gc
        import json

        from apache_beam.runners.worker import statesampler

        settings = {
            "gc": list(gc.get_threshold()),
            "sampler": list(statesampler.StateSampler.__init__.__defaults__),
            "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),
        }
        with open(os.path.join(self.out_dir, f"{element}.json"), "w") as f:
            json.dump(settings, f)
        yield element


def _worker_settings_seen(out_dir: Path) -> list[dict[str, list[int]]]:
    import json

    return [json.loads(p.read_text()) for p in sorted(out_dir.iterdir())]


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (the service's data folder appears in every JVM's arguments)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = (entry / "stat").read_text().split(") ", 1)[1][0]
        except OSError:
            continue
        if text in cmdline and status != "Z":
            found.append(int(entry.name))
    return found


def test_streaming_pipeline_with_checkpoints_runs_on_the_session_cluster(flink: ServiceState, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    job_name = f"beamflow-test-{uuid.uuid4().hex[:8]}"
    options = options_for_service(
        flink,
        {
            "job_name": job_name,
            "parallelism": 2,
            "checkpointing_interval_ms": 500,
            # A bounded source in a streaming job with checkpointing stays up forever unless told to stop.
            "shutdown_sources_after_idle_ms": 3000,
        },
    )
    settings_dir = tmp_path / "settings"
    settings_dir.mkdir()
    pipeline = beam.Pipeline(options=options)
    squares = pipeline | beam.Create(list(range(40))) | beam.Reshuffle() | beam.ParDo(WriteSquare(str(out_dir)))
    _ = squares | beam.ParDo(RecordWorkerSettings(str(settings_dir)))
    rest = FlinkRest(flink.info["rest_url"])
    result = pipeline.run()
    # What the submission shipped, read while the job runs: only the empty marker jar (Beam's runner jars are on the
    # cluster's classpath), not the job server's 165 jars (Beam 2.62's own invoker stages its whole classpath).
    job_id = _wait_for_job(rest, job_name)
    rest.wait_for_state(job_id, {"RUNNING", "FINISHED"}, timeout=300)
    blobs = job_blobs(flink, job_id)
    assert any(len(sizes) == 1 for sizes in blobs.values()), f"no blob store holds the job's marker jar: {blobs}"
    # A store may hold none: a TaskManager still downloading, or already cleaning up after its tasks finished (seen
    # on a loaded machine). None holds more than the one jar.
    assert all(len(sizes) <= 1 for sizes in blobs.values()), blobs
    assert sum(map(sum, blobs.values())) < 10_000, blobs
    assert result.wait_until_finish() == PipelineState.DONE

    written = {int(p.stem): p.read_text() for p in out_dir.iterdir()}
    assert written == {i: str(i * i) for i in range(40)}

    jobs = [job for job in rest.jobs() if job.name == job_name]
    assert len(jobs) == 1, [j.name for j in rest.jobs()]
    assert jobs[0].state == "FINISHED"
    # Flink takes a final checkpoint before finished tasks shut down, so at least one completed.
    assert rest.completed_checkpoints(jobs[0].job_id) >= 1
    job_config = rest._request("GET", f"/jobs/{jobs[0].job_id}/config")["execution-config"]
    assert job_config["job-parallelism"] == 2
    # The PROCESS workers imported runners.worker_plugin at start-up (runners.worker_settings).
    seen = _worker_settings_seen(settings_dir)
    assert len(seen) == 40
    assert {json_key(s) for s in seen} == {json_key({"gc": WORKER_GC_THRESHOLDS, "sampler": [SAMPLING_PERIOD_MS]})}
    # Started by Beam's boot with the environment's env (runners.flink.WORKER_ENV), not from the TaskManager's.
    assert {s["malloc_arena_max"] for s in seen} == {WORKER_ENV["MALLOC_ARENA_MAX"]}


def json_key(settings: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(settings["gc"]), tuple(settings["sampler"])


def test_worker_settings_false_leaves_the_workers_with_beams_defaults(flink: ServiceState, tmp_path: Path) -> None:
    # The check above can fail: a job that switches the settings off runs workers with CPython's and Beam's defaults.
    options = options_for_service(
        flink,
        {
            "job_name": f"beamflow-defaults-{uuid.uuid4().hex[:8]}",
            "parallelism": 1,
            "checkpointing_interval_ms": 1000,
            "shutdown_sources_after_idle_ms": 3000,
            "worker_settings": False,
        },
    )
    pipeline = beam.Pipeline(options=options)
    _ = pipeline | beam.Create([0, 1]) | beam.Reshuffle() | beam.ParDo(RecordWorkerSettings(str(tmp_path)))
    assert pipeline.run().wait_until_finish() == PipelineState.DONE
    seen = _worker_settings_seen(tmp_path)
    assert len(seen) == 2
    assert {json_key(s) for s in seen} == {((700, 10, 10), (200,))}
    assert {s["malloc_arena_max"] for s in seen} == {os.environ.get("MALLOC_ARENA_MAX")}  # glibc's default


def _wait_for_job(rest: FlinkRest, job_name: str, timeout: float = 300) -> str:
    """The id of the Flink job of that name, once the job server has submitted it."""
    found: list[str] = []

    def listed() -> bool:
        found.extend(job.job_id for job in rest.jobs() if job.name == job_name)
        return bool(found)

    wait_until(listed, timeout, f"Flink to list the job {job_name}")
    return found[0]


def test_cluster_survives_a_killed_taskmanager_and_down_leaves_no_jvm(tmp_path: Path) -> None:
    # A second, private cluster: stopping the session one would break the other Flink tests.
    service = FlinkService(tmp_path / "data", cache_dir())
    try:
        state = service.up()
        assert state.info["startup"]["total_s"] > 0
        rest = service.rest()
        overview = rest.overview()
        assert overview["taskmanagers"] == 2
        assert overview["slots-total"] >= 4
        assert rest.config()["rest.bind-address"] == "127.0.0.1"

        old_pid = service.kill_taskmanager()
        restarted = service.restart_taskmanager()
        assert restarted.info["roles"]["taskmanager"] != old_pid
        # The new TaskManager registers with the JobManager a few seconds after its process starts.
        wait_until(lambda: service.ready(restarted), 120, "the restarted TaskManager to register")
        # jobmanager, two taskmanagers, job server
        assert len(_processes_mentioning(str(service.home))) == 4
    finally:
        service.down()
    assert _processes_mentioning(str(service.home)) == []
    assert service.status()["running"] is False


class WritePid(beam.DoFn):
    """Writes the SDK worker's pid per element: shows which process really ran the code."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def process(self, element: int) -> Iterator[int]:
        with open(os.path.join(self.out_dir, f"{element}.txt"), "w") as f:
            f.write(str(os.getpid()))
        yield element


def test_external_worker_pool_runs_the_python_code_beside_the_taskmanager(flink: ServiceState, tmp_path: Path) -> None:
    """The deployment layout: TaskManagers call a worker pool (``python -m runners.worker_pool``) on loopback."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    pool = subprocess.Popen(
        [sys.executable, "-m", "runners.worker_pool", "--port", str(port)],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        assert pool.stdout is not None
        assert f"listening on 127.0.0.1:{port}" in pool.stdout.readline().decode()
        out_dir = tmp_path / "out"
        out_dir.mkdir()
        options = options_for_service(
            flink,
            {
                "job_name": f"beamflow-external-{uuid.uuid4().hex[:8]}",
                "parallelism": 1,
                "checkpointing_interval_ms": 1000,
                "shutdown_sources_after_idle_ms": 3000,
                "environment": {"type": "EXTERNAL", "config": f"127.0.0.1:{port}"},
            },
        )
        pipeline = beam.Pipeline(options=options)
        _ = pipeline | beam.Create(list(range(10))) | beam.Reshuffle() | beam.ParDo(WritePid(str(out_dir)))
        assert pipeline.run().wait_until_finish() == PipelineState.DONE
        pids = {int(p.read_text()) for p in out_dir.iterdir()}
        assert len(list(out_dir.iterdir())) == 10
        # Neither this process (LOOPBACK would run it here) nor the pool itself: the pool's worker children.
        assert os.getpid() not in pids and pool.pid not in pids
    finally:
        os.killpg(pool.pid, 15)
        pool.wait(30)

"""The SDF residual fix (beamflow.services.beam_patches, apache/beam#27648), shown to matter.

The probe drives Beam's ``StateAndTimerBundleCheckpointHandler`` through 200 self-checkpoints, as a deferring Kafka
read makes them, once with Beam 2.62's own classes and once with the patched jar first on the classpath (as the
cluster runs it), and counts the keyed states the residuals went into: one per deferral unpatched (each a state
descriptor, on RocksDB a column family, that the job keeps for good), one in all patched. The cluster side (a real
streaming job's checkpoint holds no per-deferral state) is checked in test_streaming_backlog.py.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from beamflow.doctor import check_flink_classpath
from beamflow.flink_rest import FlinkRest
from beamflow.services import ServiceState
from beamflow.services.beam_patches import RESIDUALS_STATE_ID, RUNNER_PATCHES, SDF_RESIDUALS_JAR
from beamflow.services.flink import FlinkService, compile_java
from beamflow.services.paths import cache_dir

pytestmark = pytest.mark.flink

PROBE_SOURCES = Path(__file__).resolve().parent / "java" / "sdfprobe"
DEFERRALS = 200


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> tuple[FlinkService, Path]:
    service = FlinkService(tmp_path_factory.mktemp("flink-probe"), cache_dir())
    return service, compile_java(PROBE_SOURCES, service.job_server_classpath(), cache_dir())


def _state_ids(classpath: list[str]) -> tuple[int, str]:
    result = subprocess.run(
        ["java", "-cp", ":".join(classpath), "beamflow.probe.SdfResidualProbe", str(DEFERRALS)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    found = re.search(r"deferrals=(\d+) state_ids=(\d+) first=(\S+)", result.stdout)
    assert found, result.stdout
    assert int(found[1]) == DEFERRALS
    return int(found[2]), found[3]


def test_beam_2_62_keeps_one_state_per_deferral(probe: tuple[FlinkService, Path]) -> None:
    service, classes = probe
    count, first = _state_ids([str(classes), f"{service.job_server_classpath()}/*"])
    assert count == DEFERRALS, "Beam's own handler no longer leaks a state per deferral: is the patch still needed?"
    assert first.startswith("sdf_checkpoint:")


def test_the_patched_runner_keeps_one_state_in_all(probe: tuple[FlinkService, Path]) -> None:
    service, classes = probe
    jar = service.sdf_residuals_jar()
    count, first = _state_ids([str(jar), str(classes), f"{service.job_server_classpath()}/*"])
    assert (count, first) == (1, RESIDUALS_STATE_ID)


def test_doctor_reads_the_fix_from_the_running_cluster(flink: ServiceState) -> None:
    rest = FlinkRest(f"http://127.0.0.1:{flink.ports['rest']}")
    classpath = rest.jobmanager_classpath()
    assert check_flink_classpath(classpath, 4) == []
    without = [entry for entry in classpath if not entry.endswith(SDF_RESIDUALS_JAR)]
    assert [f.code for f in check_flink_classpath(without, 4)] == ["sdf-residual-state-grows"]


def test_every_patch_site_is_in_the_sources() -> None:
    # The jar above was built, so every site matched exactly once; a patch that changed nothing would be a no-op.
    assert all(patch.old != patch.new for patch in RUNNER_PATCHES)

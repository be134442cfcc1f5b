"""RocksDB's MANIFEST bounded (beamflow.flink.BoundedManifestOptionsFactory), shown to matter.

The probe does to a RocksDB what Flink does to a keyed operator's at every checkpoint (a few entries written and
removed in a few column families, then a flush) 300 times: with RocksDB's defaults the MANIFEST grows by every flush
(Flink uploads it whole with every incremental checkpoint), with beamflow's factory at conf/flink.yaml's bound it
rolls over and stays small. Then the running cluster: its config names the factory, so doctor finds nothing.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from beamflow.doctor import check_flink_state_config
from beamflow.flink_rest import FlinkRest
from beamflow.services import ServiceState
from beamflow.services.flink import FlinkService, compile_java
from beamflow.services.paths import cache_dir

pytestmark = pytest.mark.flink

PROBE_SOURCES = Path(__file__).resolve().parent / "java" / "manifestprobe"
CONF = Path(__file__).resolve().parents[2] / "conf" / "flink.yaml"
ROUNDS = 300


@pytest.fixture(scope="module")
def classpath(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    service = FlinkService(tmp_path_factory.mktemp("flink-manifest"), cache_dir())
    probe = compile_java(PROBE_SOURCES, service.job_server_classpath(), cache_dir())
    return [str(service.rocksdb_options_jar()), str(probe), f"{service.job_server_classpath()}/*"]


def _manifest_bytes(classpath: list[str], db: Path, bound: str) -> int:
    result = subprocess.run(
        ["java", "-cp", ":".join(classpath), "beamflow.probe.ManifestProbe", str(db), str(ROUNDS), bound],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    found = re.search(r"rounds=(\d+) manifest_bytes=(\d+) manifests=1", result.stdout)
    assert found, result.stdout
    return int(found[2])


def _shipped_bound() -> int:
    return int(yaml.safe_load(CONF.read_text())["flink"]["rocksdb_max_manifest_bytes"])


def test_rocksdb_defaults_let_the_manifest_grow_with_every_flush(classpath: list[str], tmp_path: Path) -> None:
    grown = _manifest_bytes(classpath, tmp_path / "db", "none")
    assert grown > 4 * _shipped_bound(), "RocksDB rolled its MANIFEST over by itself: is the factory still needed?"


def test_the_factory_keeps_the_manifest_under_its_bound(classpath: list[str], tmp_path: Path) -> None:
    bound = _shipped_bound()
    # A roll-over happens at the first write past the bound, and starts the new file with a snapshot (a few KB here).
    assert _manifest_bytes(classpath, tmp_path / "db", str(bound)) <= bound + 8192


def test_the_local_cluster_runs_with_the_factory(flink: ServiceState) -> None:
    config = FlinkRest(f"http://127.0.0.1:{flink.ports['rest']}").config()
    assert config.get("state.backend.rocksdb.options-factory") == "beamflow.flink.BoundedManifestOptionsFactory"
    assert check_flink_state_config(config, 10_000) == []
    without = {k: v for k, v in config.items() if k != "state.backend.rocksdb.options-factory"}
    assert [f.code for f in check_flink_state_config(without, 10_000)] == ["rocksdb-manifest-grows"]

"""ServiceSet.prefetch: installs run in parallel where they may, never two into one Maven repository at once, and a
service's own ``up`` waits for its install in progress (in this process or another) instead of running a second one
beside it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import beamflow.services as services
from beamflow.services import ServiceSet, ServiceState
from beamflow.services.base import LocalService

RECORD: list[tuple[str, float, float]] = []
_RECORD_LOCK = threading.Lock()


class _Recording(LocalService):
    """Installs by sleeping, and records when; starts nothing (the scheduling is under test, not a server)."""

    def install(self) -> None:
        start = time.monotonic()
        time.sleep(0.3)
        with _RECORD_LOCK:
            RECORD.append((self.name, start, time.monotonic()))

    def _start(self) -> ServiceState:
        return ServiceState(name=self.name, pids=[], ports={})

    def ready(self, state: ServiceState) -> bool:
        return True


class Kafka(_Recording):
    name = "kafka"


class Postgres(_Recording):
    name = "postgres"


class Registry(_Recording):
    name = "registry"


class Flink(_Recording):
    name = "flink"


def _overlap(a: str, b: str) -> bool:
    (_, a0, a1), (_, b0, b1) = (next(r for r in RECORD if r[0] == n) for n in (a, b))
    return a0 < b1 and b0 < a1


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> ServiceSet:
    RECORD.clear()
    for name, cls in {"kafka": Kafka, "postgres": Postgres, "registry": Registry, "flink": Flink}.items():
        monkeypatch.setitem(services.SERVICES, name, f"{__name__}:{cls.__name__}")
    return ServiceSet(data=tmp_path / "data", cache=tmp_path / "cache")


def test_prefetch_overlaps_installs_but_never_two_users_of_one_maven_repository(recording: ServiceSet) -> None:
    for thread in recording.prefetch(["kafka", "postgres", "registry", "flink"]):
        thread.join(10)
    assert sorted(r[0] for r in RECORD) == ["flink", "kafka", "postgres", "registry"]
    assert not _overlap("kafka", "registry")  # one shared Maven repository (Maven does not lock it across processes)
    assert _overlap("flink", "kafka") and _overlap("postgres", "kafka")


def test_up_waits_for_the_install_in_progress_and_installs_once_more_only_after_it(recording: ServiceSet) -> None:
    threads = recording.prefetch(["flink"])
    time.sleep(0.05)
    recording.get("flink").up()  # blocks on the prefetch's install lock
    for thread in threads:
        thread.join(10)
    installs = sorted((start, end) for name, start, end in RECORD if name == "flink")
    assert len(installs) == 2 and installs[1][0] >= installs[0][1]


def test_up_waits_for_an_install_of_the_same_cache_in_another_process(recording: ServiceSet) -> None:
    holder = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from beamflow.services.base import install_lock\n"
        "with install_lock('flink', Path(sys.argv[1])):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(1.5)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", holder, str(recording.cache)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        held_at = time.monotonic()
        recording.get("flink").up()
    finally:
        proc.wait(30)
    [(_, started, _)] = [r for r in RECORD if r[0] == "flink"]
    assert started - held_at >= 1.0  # the other process's install was waited for


def test_modules_needing_nothing_run_first_then_by_the_last_ready_service_they_need() -> None:
    from tests.conftest import module_order

    needs = {
        "e2e": {"kafka", "registry", "tmp_path"},
        "flink_drills": {"flink", "kafka"},
        "unit_a": {"tmp_path"},
        "postgres_only": {"postgres"},
        "prism_stream": {"prism", "kafka"},
        "kafka_only": {"kafka", "postgres"},
        "unit_b": set(),
    }
    assert module_order(needs) == [
        "unit_a",
        "unit_b",
        "postgres_only",
        "kafka_only",
        "prism_stream",
        "e2e",
        "flink_drills",
    ]

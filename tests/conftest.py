"""Session fixtures: one fresh set of real services for the whole test run, stopped at its end.

Each service fixture returns the service's ``ServiceState`` (ports, connection info). Services start on first use, so a
run that selects only unit tests starts nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from beamflow.kafka.pool import PROCESS_POOL
from beamflow.services import ServiceSet, ServiceState
from beamflow.services.paths import cache_dir, project_root

pytest_plugins: list[str] = []
SERVICE_FIXTURES = ("kafka", "postgres", "registry", "flink")


def _test_data() -> Path:
    return Path(os.environ.get("BEAMFLOW_TEST_DATA", project_root() / ".data" / "test"))


def pytest_collection_finish(session: pytest.Session) -> None:
    # The services the selected tests use are installed in the background from the start (on a fresh machine: minutes
    # of downloads and builds each, otherwise stamp checks), so the first tests do not wait for all of them in turn.
    needed = {name for item in session.items for name in getattr(item, "fixturenames", ()) if name in SERVICE_FIXTURES}
    if needed:
        ServiceSet(data=_test_data(), cache=cache_dir()).prefetch([n for n in SERVICE_FIXTURES if n in needed])


@pytest.fixture(scope="session")
def service_set() -> Iterator[ServiceSet]:
    data = _test_data()
    shutil.rmtree(data, ignore_errors=True)
    services = ServiceSet(data=data, cache=cache_dir())
    started: list[str] = []
    services.started = started  # type: ignore[attr-defined]
    yield services
    # kafka-python clients left in finished pipelines keep reconnecting in background threads; once the broker is
    # gone they would log into pytest's closed capture streams. Their reconnect noise says nothing about the run.
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    logging.raiseExceptions = False
    # The reads' pooled consumers (confluent-kafka) would log every failed reconnect to stderr until the process ends.
    PROCESS_POOL.close()
    # Stop in reverse start order; no orphan JVMs or postgres after the run.
    if started:
        services.down(started)


@pytest.fixture(autouse=True, scope="module")
def _close_pooled_consumers() -> Iterator[None]:
    """The reads' pooled consumers closed as each test module ends. Left to the pool's reaper, a module's consumers
    were closed about two minutes later, during another module's test: a kafka-python consumer's close logs at INFO,
    and a CLI test capturing stderr then found those lines in the CLI's output (a flaky failure in CI)."""
    yield
    PROCESS_POOL.close()


def _up(service_set: ServiceSet, name: str) -> ServiceState:
    state = service_set.get(name).up()
    started: list[str] = service_set.started  # type: ignore[attr-defined]
    if name not in started:
        started.append(name)
    return state


@pytest.fixture(scope="session")
def kafka(service_set: ServiceSet) -> ServiceState:
    return _up(service_set, "kafka")


@pytest.fixture(scope="session")
def postgres(service_set: ServiceSet) -> ServiceState:
    return _up(service_set, "postgres")


@pytest.fixture(scope="session")
def registry(service_set: ServiceSet) -> ServiceState:
    return _up(service_set, "registry")


@pytest.fixture(scope="session")
def flink(service_set: ServiceSet) -> ServiceState:
    return _up(service_set, "flink")

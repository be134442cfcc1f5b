"""Session fixtures: one fresh set of real services for the whole test run, stopped at its end.

Each service fixture returns the service's ``ServiceState`` (ports, connection info). Services start on first use, so a
run that selects only unit tests starts nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from beamflow.kafka.pool import PROCESS_POOL
from beamflow.services import ServiceSet, ServiceState
from beamflow.services.paths import cache_dir, project_root
from runners.prism import ensure_prism
from tests.tiers import TIERS

pytest_plugins: list[str] = []
SERVICE_FIXTURES = ("kafka", "postgres", "registry", "flink")
# What a test may wait for, in the order each is ready on a fresh machine (a bare clone on 2 cores, the prefetch's
# threads side by side: PostgreSQL from Debian's packages and Kafka within a minute, Prism's Go build about a minute,
# the registry's Quarkus build at 77 s, Flink's distribution, jars and boot build at 167 s; see
# pytest_collection_modifyitems).
READY_ORDER = ("postgres", "kafka", "prism", "registry", "flink")


def _test_data() -> Path:
    return Path(os.environ.get("BEAMFLOW_TEST_DATA", project_root() / ".data" / "test"))


def pytest_collection_finish(session: pytest.Session) -> None:
    # The services the selected tests use are installed in the background from the start (on a fresh machine: minutes
    # of downloads and builds each, otherwise stamp checks), so the first tests do not wait for all of them in turn.
    if session.config.option.collectonly:
        return  # nothing will run
    needed = {name for item in session.items for name in getattr(item, "fixturenames", ()) if name in READY_ORDER}
    if needed & set(SERVICE_FIXTURES):
        ServiceSet(data=_test_data(), cache=cache_dir()).prefetch([n for n in SERVICE_FIXTURES if n in needed])
    if "prism" in needed:
        threading.Thread(target=_build_prism, name="prefetch-prism", daemon=True).start()


def _build_prism() -> None:
    try:
        ensure_prism()
    except Exception as exc:  # the prism fixture builds again and raises it where it is needed
        logging.getLogger(__name__).warning("prefetching prism failed: %s", exc)


def module_order(needs: dict[str, set[str]]) -> list[str]:
    """Test modules (each with the services it needs) in the order they should run: modules needing nothing first,
    then by the last-ready service each needs (``READY_ORDER``), otherwise as collected.

    On a fresh machine the prefetch installs everything in the background; run in collection order, the first
    end-to-end test waited about four minutes for the registry while the unit tests, which need nothing, came last.
    Whole modules move, never single tests, so a module's fixtures are set up once.
    """
    rank = {name: i + 1 for i, name in enumerate(READY_ORDER)}
    return sorted(needs, key=lambda module: max((rank[n] for n in needs[module] if n in rank), default=0))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tier",
        choices=("all", *TIERS),
        default="all",
        help="run only the modules that need the Flink cluster (flink) or only the others (other); tests/tiers.py "
        "runs both side by side",
    )


def in_tier(tier: str, needs: set[str]) -> bool:
    """Whether a module needing ``needs`` belongs to ``tier``: whole modules, by whether any test needs Flink."""
    return tier == "all" or (tier == "flink") == ("flink" in needs)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    needs: dict[str, set[str]] = {}
    for item in items:
        needs.setdefault(str(item.path), set()).update(getattr(item, "fixturenames", ()))
    tier = config.getoption("tier")
    if tier != "all":
        deselected = [item for item in items if not in_tier(tier, needs[str(item.path)])]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if in_tier(tier, needs[str(item.path)])]
        needs = {module: need for module, need in needs.items() if in_tier(tier, need)}
    position = {module: i for i, module in enumerate(module_order(needs))}
    items.sort(key=lambda item: position[str(item.path)])  # stable: each module's tests keep their order


_MODULE_SECONDS: dict[str, float] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    start = time.monotonic()
    yield
    module = item.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + time.monotonic() - start


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Each module's wall time, its fixtures' setup and teardown included: the figures to split the tiers by
    (tests/tiers.py)."""
    if not _MODULE_SECONDS:
        return
    terminalreporter.section("slowest modules (setup, calls and teardown)")
    slowest = sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])
    for module, seconds in slowest[:12]:
        terminalreporter.write_line(f"{seconds:8.1f}s {module}")
    terminalreporter.write_line(f"{sum(_MODULE_SECONDS.values()):8.1f}s in all {len(slowest)} modules")


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


@pytest.fixture(scope="session")
def prism() -> Path:
    """Prism, Beam's portable local runner, built from the Go module proxy (``runners.prism``); tests on it take this
    fixture so the build is prefetched and scheduled like the services'."""
    return ensure_prism()

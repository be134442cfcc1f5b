"""Real local services on 127.0.0.1, started by beamflow itself: tests, the demo and benchmarks all use these.

``ServiceSet`` names them; each lives in its own module and follows ``base.LocalService``.
"""

from __future__ import annotations

import importlib
import logging
import threading
from pathlib import Path
from typing import Any

from beamflow.services.base import LocalService, ServiceError, ServiceState, install_lock
from beamflow.services.paths import cache_dir, data_dir

__all__ = ["SERVICES", "LocalService", "ServiceError", "ServiceSet", "ServiceState"]

# name -> "module:Class", in start order.
SERVICES: dict[str, str] = {
    "kafka": "beamflow.services.kafka:KafkaService",
    "postgres": "beamflow.services.postgres:PostgresService",
    "registry": "beamflow.services.registry:RegistryService",
    "flink": "beamflow.services.flink:FlinkService",
}


class ServiceSet:
    """The local services under one data folder."""

    def __init__(self, data: Path | None = None, cache: Path | None = None) -> None:
        self.data = data or data_dir()
        self.cache = cache or cache_dir()

    def get(self, name: str) -> LocalService:
        try:
            spec = SERVICES[name]
        except KeyError:
            raise ServiceError(f"unknown service {name!r}; known: {', '.join(SERVICES)}") from None
        module_name, _, cls_name = spec.partition(":")
        cls = getattr(importlib.import_module(module_name), cls_name)
        service: LocalService = cls(self.data, self.cache)
        return service

    def prefetch(self, names: list[str]) -> list[threading.Thread]:
        """Installs ``names`` in background threads (each service's ``up`` then waits for its own install to end).

        On a fresh machine the installs are downloads and builds that take minutes each; run one after the other
        they delay the first test by all of them. Three threads: PostgreSQL (Debian's packages), Flink (its own
        Maven repository, ``fetch.FLINK_MAVEN_REPO``), and Kafka then the registry (one shared Maven repository,
        which Maven does not lock across processes, so never two at once). A failed prefetch is only logged: ``up``
        installs again and raises the real error where it is needed.
        """
        groups = [[n for n in names if n in group] for group in (["postgres"], ["flink"], ["kafka", "registry"])]
        threads = []
        for group in filter(None, groups):
            thread = threading.Thread(target=self._install_all, args=(group,), name=f"prefetch-{'+'.join(group)}")
            thread.daemon = True
            thread.start()
            threads.append(thread)
        return threads

    def _install_all(self, names: list[str]) -> None:
        for name in names:
            try:
                service = self.get(name)
                with install_lock(name, service.cache_dir):
                    service.install()
            except Exception as exc:  # up() installs again and raises it where it is needed
                logging.getLogger(__name__).warning("prefetching %s failed: %s", name, exc)

    def up(self, names: list[str] | None = None) -> dict[str, ServiceState]:
        """Starts ``names`` (all by default) in order; what they lack is installed in parallel first."""
        names = names or list(SERVICES)
        self.prefetch(names)
        return {name: self.get(name).up() for name in names}

    def down(self, names: list[str] | None = None) -> None:
        for name in reversed(names or list(SERVICES)):
            self.get(name).down()

    def status(self, names: list[str] | None = None) -> list[dict[str, Any]]:
        return [self.get(name).status() for name in (names or list(SERVICES))]

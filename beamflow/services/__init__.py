"""Real local services on 127.0.0.1, started by beamflow itself: tests, the demo and benchmarks all use these.

``ServiceSet`` names them; each lives in its own module and follows ``base.LocalService``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from beamflow.services.base import LocalService, ServiceError, ServiceState
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

    def up(self, names: list[str] | None = None) -> dict[str, ServiceState]:
        return {name: self.get(name).up() for name in (names or list(SERVICES))}

    def down(self, names: list[str] | None = None) -> None:
        for name in reversed(names or list(SERVICES)):
            self.get(name).down()

    def status(self, names: list[str] | None = None) -> list[dict[str, Any]]:
        return [self.get(name).status() for name in (names or list(SERVICES))]

"""Job configuration: a YAML file, overridden by ``--set section.key=value`` flags, with ``auto`` endpoints.

``auto`` means "the local service beamflow started": Kafka's bootstrap, PostgreSQL's DSN, the registry's URL and the
Flink job server are read from the running services' state (``beamflow services up``), so the same file works on a
laptop and, with real addresses filled in, in a deployment.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

__all__ = ["apply_overrides", "load_config", "resolve_auto"]


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_overrides(config: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Applies ``a.b.c=value`` strings; values are parsed as YAML scalars (numbers, booleans, null, lists)."""
    out = copy.deepcopy(config)
    for item in overrides:
        path, sep, raw = item.partition("=")
        if not sep or not path:
            raise ValueError(f"override {item!r} is not of the form section.key=value")
        node = out
        keys = path.split(".")
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ValueError(f"override {item!r}: {key} is not a section")
            node = child
        node[keys[-1]] = yaml.safe_load(raw) if raw else ""
    return out


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    text = Path(path).read_text()
    loaded = yaml.safe_load(text) or {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: the top level must be a mapping of sections")
    base_path = loaded.pop("extends", None)
    if base_path:
        loaded = _merge(load_config(Path(path).parent / base_path), loaded)
    return apply_overrides(loaded, overrides)


def resolve_auto(config: dict[str, Any], services: Any = None) -> dict[str, Any]:
    """Replaces ``auto`` endpoints with the local services' addresses, starting the services that are needed."""
    from beamflow.services import ServiceSet

    out = copy.deepcopy(config)
    services = services or ServiceSet()

    def need(name: str) -> Any:
        return services.get(name).up()

    kafka = out.get("kafka", {})
    if kafka.get("bootstrap") == "auto":
        kafka["bootstrap"] = need("kafka").info["bootstrap"]
    registry = out.get("registry", {})
    if registry.get("url") == "auto":
        registry["url"] = need("registry").info["url"]
    postgres = out.get("postgres", {})
    if postgres.get("dsn") == "auto":
        postgres["dsn"] = need("postgres").info["dsn"]
    iceberg = out.get("iceberg", {})
    catalog = iceberg.get("catalog", {})
    if catalog.get("uri") == "auto":
        catalog["uri"] = f"sqlite:///{services.data / 'iceberg' / 'catalog.db'}"
    if catalog.get("warehouse") == "auto":
        catalog["warehouse"] = f"file://{services.data / 'iceberg' / 'warehouse'}"
    if catalog.get("uri", "").startswith("sqlite:///") or catalog.get("warehouse", "").startswith("file://"):
        (services.data / "iceberg" / "warehouse").mkdir(parents=True, exist_ok=True)
    flink = out.get("flink", {})
    environment = flink.get("environment")
    local_process = environment == "PROCESS" or (isinstance(environment, dict) and environment.get("command") == "auto")
    if "auto" in (flink.get("job_endpoint"), flink.get("master"), flink.get("files_to_stage")) or local_process:
        state = need("flink")
        if flink.get("job_endpoint") == "auto":
            flink["job_endpoint"] = f"127.0.0.1:{state.ports['job']}"
            # So a detached submission can wait until Flink itself runs the job (runners.flink.wait_until_running).
            flink.setdefault("rest_url", f"http://127.0.0.1:{state.ports['rest']}")
        if flink.get("master") == "auto":
            flink["master"] = f"127.0.0.1:{state.ports['rest']}"
        if flink.get("files_to_stage") == "auto":
            # The local cluster has Beam's runner jars on its classpath: a job ships only an empty marker jar.
            flink["files_to_stage"] = [state.info["marker_jar"]]
        if local_process:
            # Beam's boot, which each local TaskManager runs to start its own Python workers.
            flink["environment"] = {"type": "PROCESS", "command": state.info["boot"]}
    return out

"""Job configuration: a YAML file, overridden by ``--set section.key=value`` flags, read into frozen dataclasses.

``load_job_config(path, overrides)`` returns a ``JobConfig``: one frozen dataclass per section (``kafka``,
``registry``, ``postgres``, ``iceberg``, ``dead_letters``, ``dedup``, ``sessions``, ``lookups``, ``kafka_sink``,
``cells``, ``flink``, ``job``), whose field
defaults are the only defaults of the job's settings. A key that no section has is refused with its name and the
nearest valid one (``kafka.partiton: unknown key; did you mean 'partitions'?``), and a value of the wrong type with
the key and the type it needs, so a typo in a YAML file or a ``--set`` flag fails at load time instead of silently
meaning the default. ``load_config`` returns the same, validated, as a plain dict (for code that indexes sections).

``auto`` means "the local service beamflow started": Kafka's bootstrap, PostgreSQL's DSN, the registry's URL and the
Flink job server are read from the running services' state by ``resolve_auto``, so the same file works on a laptop
and, with real addresses filled in, in a deployment. ``resolve_auto`` never starts a service: a caller that wants
them started says so (``start_services(config)``, as ``python -m pipelines.clicks`` and ``beamflow demo`` do), and an
``auto`` whose service is not running is refused in one line naming the command that starts it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, Union

import yaml

__all__ = [
    "AUTO",
    "CellsConfig",
    "ConfigError",
    "DeadLettersConfig",
    "DedupConfig",
    "FlinkConfig",
    "IcebergCatalog",
    "IcebergConfig",
    "JobConfig",
    "JobSection",
    "KafkaConfig",
    "KafkaSinkConfig",
    "LookupConfig",
    "PostgresConfig",
    "RegistryConfig",
    "SessionsConfig",
    "apply_overrides",
    "as_job_config",
    "auto_services",
    "load_config",
    "load_job_config",
    "local_iceberg_catalog",
    "required",
    "resolve_auto",
    "start_services",
]

AUTO = "auto"


class ConfigError(ValueError):
    """A configuration that cannot be used; the message is one line naming the key.

    Keys and values come from the user: characters that are not printable (newlines, carriage returns, escapes)
    are shown escaped, so the message stays one line and cannot rewrite the terminal.
    """

    def __init__(self, message: str) -> None:
        super().__init__("".join(c if c.isprintable() else repr(c)[1:-1] for c in str(message)))


@dataclass(frozen=True)
class JobSection:
    name: str = "beamflow"


@dataclass(frozen=True)
class KafkaConfig:
    topic: str
    group_id: str
    bootstrap: str = AUTO
    partitions: int | None = None  # the topic's partition count (doctor compares parallelism; the demo creates it)
    backend: str = "confluent"  # confluent (librdkafka) | kafka-python
    start: str = "earliest"  # for a group without committed offsets: earliest | latest
    bounded: bool = False  # stop at the end offsets seen at start
    max_delay_ms: int = 0
    idle_timeout_ms: int | None = None  # None: a quiet partition holds the watermark back for ever
    max_bundle_records: int = 2000
    # A bounded run on the local runner reads at most this many records of each partition, commits, and the next run
    # goes on from there, until the end offsets seen when the command started: its memory stays that of one such
    # run whatever the backlog (FnApiRunner keeps each stage's output until the next stage ran). None: one run.
    run_records_per_partition: int | None = None
    # A bounded run on the local runner splits the topic's partitions over this many processes, each a local run of
    # its own partitions (FnApiRunner runs on one core, and more than one of its workers drops a splittable read's
    # residuals). The sinks, the dedup's first copies and the sessions take concurrent writers.
    local_processes: int = 1
    local_process_records: int = 50_000  # ... one process per this many records of backlog, up to local_processes
    # Read only these partitions (None: all); a local run split over processes sets it for each of them.
    only_partitions: tuple[int, ...] | None = None
    consumer_config: dict[str, Any] = field(default_factory=dict)  # passed to the consumer (ReadFromKafka)

    def __post_init__(self) -> None:
        for key in ("local_processes", "local_process_records"):
            if getattr(self, key) < 1:
                raise ConfigError(f"kafka.{key} must be at least 1, not {getattr(self, key)}")
        if self.run_records_per_partition is not None and self.run_records_per_partition < 1:
            raise ConfigError(
                f"kafka.run_records_per_partition must be at least 1 (or null), not {self.run_records_per_partition}"
            )


@dataclass(frozen=True)
class RegistryConfig:
    url: str = AUTO
    subject: str | None = None  # None: <kafka.topic>-value (the registry's topic naming)
    ca_file: str | None = None  # an https:// registry: the PEM CA file it is verified with (None: the system's CAs)


@dataclass(frozen=True)
class PostgresConfig:
    dsn: str = AUTO
    sessions_table: str = "sessions"
    dead_letters_table: str = "dead_letters"
    quarantine_table: str = "duplicate_events"
    first_copies_table: str | None = None  # None: <quarantine_table>_first_copies

    @property
    def first_copies(self) -> str:
        """The dedup's table of first copies."""
        return self.first_copies_table or f"{self.quarantine_table}_first_copies"


@dataclass(frozen=True)
class IcebergCatalog:
    uri: str = AUTO  # auto: SQLite under the local data folder
    warehouse: str = AUTO


@dataclass(frozen=True)
class IcebergConfig:
    table: str
    sink_id: str | None = None  # stable across restarts; doctor refuses none or a run id
    catalog: IcebergCatalog = field(default_factory=IcebergCatalog)
    # The most event ids each committer (one per worker) keeps in memory to tell new rows from replays, 33 MB a
    # million 32-character ids (sorted fixed-width arrays, beamflow.iceberg.known_keys); past it the minutes the
    # batches needed least recently are dropped and scanned again if a replay or a late event needs them. Sized to
    # hold the stream's lateness (rate x how late events come), no minute is scanned twice.
    known_keys_max: int = 1_000_000

    def __post_init__(self) -> None:
        if self.known_keys_max < 1:
            raise ConfigError(f"iceberg.known_keys_max must be at least 1, not {self.known_keys_max}")


@dataclass(frozen=True)
class DeadLettersConfig:
    sink: str = "postgres"  # postgres | kafka
    topic: str | None = None  # for sink kafka; None: <kafka.topic>-dlq


@dataclass(frozen=True)
class DedupConfig:
    ttl_s: int = 86400
    strategy: str = "auto"  # auto | store | state | grouped

    @property
    def in_runner_state(self) -> bool:
        """The first copies live in the runner's own state (``state``, ``grouped``), seen by one process only: not
        across a local run split over processes, nor across bounded runs."""
        return self.strategy in ("state", "grouped")


@dataclass(frozen=True)
class SessionsConfig:
    gap_s: int = 600
    allowed_lateness_s: int = 0
    hot_keys: tuple[str, ...] = ()
    fanout: int = 16
    batch_rows: int = 500  # WriteSessions merges its buffered rows at this many, and always at the bundle's end
    route_by_user: bool = True  # a stream's session inputs pass a keyed route by user before their partials


@dataclass(frozen=True)
class LookupConfig:
    """One dimension lookup (``transforms.Enrich`` over ``PostgresTableLookup``): a ``lookups:`` entry, by name.

    The element's ``key_field`` is looked up in ``table``'s ``key_column`` (None: the same name) and the row's
    ``columns`` are joined onto it. ``on_missing``: ``pass`` (the columns as None) or ``dead_letter``.
    """

    table: str
    key_field: str
    columns: tuple[str, ...]
    key_column: str | None = None
    on_missing: str = "pass"
    max_batch_size: int = 500
    max_in_flight: int = 4
    cache_size: int = 100_000  # entries per worker; 0: no cache
    cache_ttl_s: float = 300.0
    missing_ttl_s: float = 30.0
    timeout_s: float = 5.0  # per statement (server-side) and per connect


@dataclass(frozen=True)
class KafkaSinkConfig:
    """Results written to a Kafka topic (``transforms.WriteToKafka``)."""

    topic: str
    bootstrap: str | None = None  # None: kafka.bootstrap (the cluster the job reads); auto: the local Kafka
    partitions: int | None = None  # the topic's partition count where a job or its demo creates it
    mode: str = "exactly-once"  # exactly-once | at-least-once
    sink_group: str | None = None  # stable across restarts (the transactional ids and markers); None: <topic>-sink
    ledger_table: str = "kafka_sink_ledger"  # exactly-once: the record ids written, in postgres.dsn
    shards: int = 4  # exactly-once: transactional producers, one per shard
    producer_config: dict[str, Any] = field(default_factory=dict)  # librdkafka settings over the sink's defaults
    timestamps: str = "event-time"  # event-time | producer (a backfill of events older than the topic's retention)

    @property
    def group(self) -> str:
        return self.sink_group or f"{self.topic}-sink"


@dataclass(frozen=True)
class CellsConfig:
    """Results written as versioned cells (``transforms.WriteVersionedCells``, buffered mutations)."""

    table: str
    salt_buckets: int | None = 16  # row keys prefixed with a stable bucket byte; None: unsalted
    max_cells: int = 10_000
    max_bytes: int = 8 * 1024 * 1024
    max_seconds: float = 5.0


@dataclass(frozen=True)
class FlinkConfig:
    """The ``flink:`` section; ``runners/flink.py`` says where each key goes (job option or cluster config.yaml).

    None means "not set": the runner's or the cluster's own default applies.
    """

    job_endpoint: str | None = None
    master: str | None = None
    rest_url: str | None = None
    job_name: str | None = None
    streaming: bool = True
    parallelism: int | None = None
    max_parallelism: int | None = None
    sdk_worker_parallelism: int | None = None
    task_slots: int | None = None
    checkpointing_interval_ms: int | None = None
    checkpointing_mode: str | None = None
    checkpoint_timeout_ms: int | None = None
    min_pause_between_checkpoints_ms: int | None = None
    tolerable_failed_checkpoints: int | None = None
    fail_on_checkpointing_errors: bool | None = None
    unaligned_checkpoints: bool | None = None
    finish_bundle_before_checkpointing: bool | None = None
    retained_checkpoints: bool | None = None
    retained_checkpoints_count: int | None = None
    state_backend: str | None = None
    incremental: bool | None = None
    rocksdb_max_manifest_bytes: int | None = None
    shutdown_sources_after_idle_ms: int | None = None
    max_bundle_size: int | None = None
    max_bundle_time_ms: int | None = None
    object_reuse: bool | None = None
    restart_strategy: dict[str, Any] | None = None
    environment: Any = "LOOPBACK"  # LOOPBACK | PROCESS | {type: PROCESS, command: ...} | {type: EXTERNAL, config: ...}
    files_to_stage: Any = None  # auto | [paths]
    savepoint_path: str | None = None
    allow_non_restored_state: bool | None = None
    experiments: tuple[str, ...] | None = None  # Beam experiments, passed to both the runner and the SDK workers
    worker_settings: bool = True  # the Python SDK workers' speed settings (runners.worker_settings); false: Beam's own

    def settings(self) -> dict[str, Any]:
        """The keys that are set, as a mapping (what ``runners.flink`` reads)."""
        return {k: v for k, v in _to_dict(self).items() if v is not None}


@dataclass(frozen=True)
class JobConfig:
    """A job's configuration. Sections a file does not have are None (``flink`` too when it is empty)."""

    job: JobSection = field(default_factory=JobSection)
    kafka: KafkaConfig | None = None
    registry: RegistryConfig | None = None
    postgres: PostgresConfig | None = None
    iceberg: IcebergConfig | None = None
    dead_letters: DeadLettersConfig = field(default_factory=DeadLettersConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    sessions: SessionsConfig = field(default_factory=SessionsConfig)
    lookups: dict[str, LookupConfig] = field(default_factory=dict)  # name -> lookup, applied in this order
    kafka_sink: KafkaSinkConfig | None = None
    cells: CellsConfig | None = None
    flink: FlinkConfig | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> JobConfig:
        """Validates a loaded YAML mapping: unknown keys and wrong types raise ``ConfigError`` naming the key."""
        sections = {k: v for k, v in raw.items() if not (k == "flink" and not v)}
        return _build(cls, sections, "")

    def to_dict(self) -> dict[str, Any]:
        """The whole configuration (every key, defaults included) as plain dicts and lists."""
        return _to_dict(self)

    def with_flink(self, **changes: Any) -> JobConfig:
        return dataclasses.replace(self, flink=dataclasses.replace(self.flink or FlinkConfig(), **changes))


T = TypeVar("T")


def required(section: T | None, name: str) -> T:
    """``section``, or a ConfigError saying the job needs it."""
    if section is None:
        raise ConfigError(f"the configuration has no {name}: section, which this job needs")
    return section


def as_job_config(config: JobConfig | Mapping[str, Any]) -> JobConfig:
    return config if isinstance(config, JobConfig) else JobConfig.from_dict(config)


def _to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: _to_dict(v) for k, v in obj.items()}
    return copy.deepcopy(obj)


def _build(cls: type[T], raw: Any, path: str) -> T:
    where = path or "the configuration"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be a mapping of keys, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            name = f"{path}.{key}" if path else str(key)
            near = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"did you mean {near[0]!r}?" if near else f"valid keys: {', '.join(sorted(fields))}"
            raise ConfigError(f"{name}: unknown {'key' if path else 'section'}; {hint}")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        key = f"{path}.{name}" if path else name
        if name in raw:
            values[name] = _convert(hints[name], raw[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{key} is required")
    return cls(**values)


def _convert(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _convert(inner, value, key)
    if hint is Any:
        return copy.deepcopy(value)
    if dataclasses.is_dataclass(hint):
        return _build(hint, {} if value is None else value, key)  # type: ignore[arg-type]
    if value is None:
        raise ConfigError(f"{key} must be set (null is not allowed)")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key} must be a string, got {value!r}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        (item,) = typing.get_args(hint)[:1]
        return tuple(_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        item = typing.get_args(hint)[1]
        if dataclasses.is_dataclass(item):  # named sections of one kind (lookups): each checked as a section
            return {str(k): _convert(item, v, f"{key}.{k}") for k, v in value.items()}
        return copy.deepcopy(dict(value))
    raise TypeError(f"{key}: no conversion for {hint!r}")  # a field type this module does not handle yet


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
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        node = out
        keys = path.split(".")
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {key} is not a section")
            node = child
        node[keys[-1]] = _yaml(raw, f"override {path}") if raw else ""
    return out


def _yaml(text: str, where: str) -> Any:
    """YAML's safe subset (no tags that build objects); a syntax error as one ConfigError line."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or type(exc).__name__
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{where} is not valid YAML: {problem}{at}") from None


def _load_raw(path: str | Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    resolved = Path(path).resolve()
    if resolved in seen:
        raise ConfigError(f"{path}: extends itself (through {' -> '.join(p.name for p in seen)})")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or type(exc).__name__}") from None
    loaded = _yaml(text, str(path)) or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base_path = loaded.pop("extends", None)
    if base_path:
        if not isinstance(base_path, str):
            raise ConfigError(f"{path}: extends must name a file, got {base_path!r}")
        loaded = _merge(_load_raw(Path(path).parent / base_path, (*seen, resolved)), loaded)
    return loaded


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The YAML file (with ``extends``) plus overrides, validated against ``JobConfig``, as the file's own dict."""
    config = apply_overrides(_load_raw(path), overrides)
    try:
        JobConfig.from_dict(config)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return config


def load_job_config(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """The YAML file (with ``extends``) plus ``--set`` overrides, as a typed ``JobConfig``."""
    try:
        return JobConfig.from_dict(apply_overrides(_load_raw(path), overrides))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


# Where ``auto`` may stand, and the local service that answers it.
def _auto_keys(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(key, service) for every ``auto`` in the config that a running local service fills in."""
    out: list[tuple[str, str]] = []
    for section, key, service in (
        ("kafka", "bootstrap", "kafka"),
        ("kafka_sink", "bootstrap", "kafka"),
        ("registry", "url", "registry"),
        ("postgres", "dsn", "postgres"),
    ):
        if (config.get(section) or {}).get(key) == AUTO:
            out.append((f"{section}.{key}", service))
    flink = config.get("flink") or {}
    for key in ("job_endpoint", "master", "files_to_stage"):
        if flink.get(key) == AUTO:
            out.append((f"flink.{key}", "flink"))
    environment = flink.get("environment")
    if environment == "PROCESS" or (isinstance(environment, Mapping) and environment.get("command") == AUTO):
        out.append(("flink.environment", "flink"))
    return out


def auto_services(config: JobConfig | Mapping[str, Any]) -> list[str]:
    """The local services the config's ``auto`` endpoints name, in start order."""
    raw = config.to_dict() if isinstance(config, JobConfig) else config
    from beamflow.services import SERVICES

    wanted = {service for _, service in _auto_keys(raw)}
    return [name for name in SERVICES if name in wanted]


def start_services(config: JobConfig | Mapping[str, Any], services: Any = None) -> list[str]:
    """Starts the local services the config's ``auto`` endpoints name (no-op for those already running)."""
    from beamflow.services import ServiceSet

    services = services or ServiceSet()
    names = auto_services(config)
    if names:
        services.up(names)
    return names


def local_iceberg_catalog(data: Path | None = None) -> IcebergCatalog:
    """What ``iceberg.catalog`` ``auto`` means: a SQLite catalog and a warehouse folder under the local data folder
    (``BEAMFLOW_DATA``, default ``.data``)."""
    from beamflow.services.paths import data_dir

    data = data or data_dir()
    return IcebergCatalog(
        uri=f"sqlite:///{data / 'iceberg' / 'catalog.db'}", warehouse=f"file://{data / 'iceberg' / 'warehouse'}"
    )


C = TypeVar("C", JobConfig, dict[str, Any])


def resolve_auto(config: C, services: Any = None) -> C:
    """Replaces ``auto`` endpoints with the running local services' addresses. Starts nothing: an ``auto`` whose
    service is not running raises ConfigError naming the key and ``beamflow services up NAME``."""
    if isinstance(config, JobConfig):
        return JobConfig.from_dict(resolve_auto(config.to_dict(), services))  # type: ignore[return-value]
    from beamflow.services import ServiceSet

    out = copy.deepcopy(config)
    services = services or ServiceSet()
    states: dict[str, Any] = {}
    for key, name in _auto_keys(out):
        if name not in states:
            state = services.get(name).state()
            if state is None or not state.alive():
                raise ConfigError(
                    f"{key} is auto but the local {name} is not running under {services.data}: "
                    f"start it with `beamflow services up {name}` (or give {key} a real address)"
                )
            states[name] = state

    for section in ("kafka", "kafka_sink"):
        kafka = out.get(section) or {}
        if kafka.get("bootstrap") == AUTO:
            kafka["bootstrap"] = states["kafka"].info["bootstrap"]
    registry = out.get("registry") or {}
    if registry.get("url") == AUTO:
        registry["url"] = states["registry"].info["url"]
    postgres = out.get("postgres") or {}
    if postgres.get("dsn") == AUTO:
        postgres["dsn"] = states["postgres"].info["dsn"]
    catalog = (out.get("iceberg") or {}).get("catalog") or {}
    local = local_iceberg_catalog(services.data)
    if catalog.get("uri") == AUTO:
        catalog["uri"] = local.uri
    if catalog.get("warehouse") == AUTO:
        catalog["warehouse"] = local.warehouse
    if str(catalog.get("uri") or "").startswith("sqlite:///") or str(catalog.get("warehouse") or "").startswith(
        "file://"
    ):
        (services.data / "iceberg" / "warehouse").mkdir(parents=True, exist_ok=True)
    flink = out.get("flink") or {}
    if "flink" in states:
        state = states["flink"]
        if flink.get("job_endpoint") == AUTO:
            flink["job_endpoint"] = f"127.0.0.1:{state.ports['job']}"
            # So a detached submission can wait until Flink itself runs the job (runners.flink.wait_until_running).
            if not flink.get("rest_url"):
                flink["rest_url"] = f"http://127.0.0.1:{state.ports['rest']}"
        if flink.get("master") == AUTO:
            flink["master"] = f"127.0.0.1:{state.ports['rest']}"
        if flink.get("files_to_stage") == AUTO:
            # The local cluster has Beam's runner jars on its classpath: a job ships only an empty marker jar.
            flink["files_to_stage"] = [state.info["marker_jar"]]
        environment = flink.get("environment")
        if environment == "PROCESS" or (isinstance(environment, Mapping) and environment.get("command") == AUTO):
            # Beam's boot, which each local TaskManager runs to start its own Python workers (an `env` is kept).
            given = dict(environment) if isinstance(environment, Mapping) else {}
            flink["environment"] = {**given, "type": "PROCESS", "command": state.info["boot"]}
    return out

"""PipelineOptions for Beam's FlinkRunner, from the ``flink:`` section of a beamflow conf YAML plus command-line flags.

Where each setting goes (verified against Beam 2.62's job server, whose ``DescribePipelineOptions`` lists the
Flink-side options the Python SDK then accepts as flags, and against a Flink 1.19.3 session cluster):

``flink:`` key -> pipeline option sent to the job server [cluster config.yaml written by FlinkService]:

- job_endpoint -> ``--job_endpoint=host:port`` (the job server)
- master -> ``--flink_master`` (used only when Beam starts its own job server, which needs ``--flink_job_server_jar``)
- parallelism, max_parallelism -> ``--parallelism``, ``--max_parallelism`` [``parallelism.default``]
- checkpointing_interval_ms -> ``--checkpointing_interval``; checkpointing_mode -> ``--checkpointing_mode``
- checkpoint_timeout_ms -> ``--checkpoint_timeout_millis``
- min_pause_between_checkpoints_ms -> ``--min_pause_between_checkpoints``
- unaligned_checkpoints -> ``--unaligned_checkpoint_enabled``
- fail_on_checkpointing_errors: false -> ``--fail_on_checkpointing_errors`` (a bare flag meaning *false*: the job
  server declares it default-true, so the SDK parses it as store_false); Beam's default fails the job on the first
  failed checkpoint (Flink's tolerable failed checkpoints = 0)
- retained_checkpoints (bool) -> ``--externalized_checkpoints_enabled``,
  ``--retain_externalized_checkpoints_on_cancellation``
  [``execution.checkpointing.externalized-checkpoint-retention: RETAIN_ON_CANCELLATION``]
- retained_checkpoints_count -> (no option) [``state.checkpoints.num-retained``]
- tolerable_failed_checkpoints -> (no option) [``execution.checkpointing.tolerable-failed-checkpoints``, which the job
  server's environment reads from the cluster's config.yaml and which then overrides Beam's fail-on-first-failure]
- state_backend -> (left to the cluster, see below) [``state.backend.type: rocksdb|hashmap``]
- incremental -> (no option) [``state.backend.incremental``]
- rocksdb_max_manifest_bytes -> (no option) [``state.backend.rocksdb.options-factory:
  beamflow.flink.BoundedManifestOptionsFactory``, ``beamflow.rocksdb.max-manifest-file-size``; the factory's jar is in
  the local cluster's lib/, a deployment puts it in its image]
- restart_strategy fixed-delay -> ``--number_of_execution_retries``, ``--execution_retry_delay``
  [``restart-strategy.*``, any type]
- environment -> ``--environment_type``, ``--environment_config``
- savepoint_path, allow_non_restored_state -> ``--savepoint_path``, ``--allow_non_restored_state`` (restore)
- shutdown_sources_after_idle_ms -> ``--shutdown_sources_after_idle_ms`` (a bounded source in a checkpointed streaming
  job otherwise never finishes). Measured on Beam 2.62 + Flink 1.19.3: with checkpointing on, output that fires only at
  the end-of-input watermark (a global-window ``CombinePerKey`` over a bounded ``Create``) was missing in 3 of 4 runs,
  and present without checkpointing; element-wise output was always complete. Tests of bounded input on Flink should
  check element-wise results, not end-of-input windows.
- max_bundle_size, max_bundle_time_ms -> ``--max_bundle_size``, ``--max_bundle_time_mills``
- experiments -> ``--experiments`` (repeated): Beam experiments, read by the runner and by the SDK workers alike
- worker_settings (default true) -> ``--beam_plugins=runners.worker_plugin``: each Python SDK worker Beam starts
  applies ``runners.worker_settings`` (state sampler period, garbage collector) before its first bundle; and PROCESS
  workers start with ``WORKER_ENV`` (``MALLOC_ARENA_MAX=2``), which an allocator reads before any Python runs
- environment ``{type: PROCESS, command: ..., env: {NAME: value}}`` -> the boot process's environment (over
  ``WORKER_ENV``), through ``--environment_config``
- finish_bundle_before_checkpointing -> ``--finish_bundle_before_checkpointing``
- files_to_stage -> ``--files_to_stage`` (repeated): the jars the job ships, on beamflow's job server; Beam's own
  ``FlinkJobServerDriver`` ignores it and ships its classpath

The state backend: Beam's own ``--state_backend`` knows only ``rocksdb`` and ``filesystem`` (the deprecated
``RocksDBStateBackend``/``FsStateBackend``, needing ``--state_backend_storage_path``); the cluster's
``state.backend.type: rocksdb|hashmap`` with ``state.backend.incremental`` and ``state.checkpoints.dir`` is the modern
equivalent and applies to every job that does not set one, so ``cluster_settings`` returns it for ``FlinkService``.
The job server reads the same config.yaml (``--flink-conf-dir``), so checkpoint retention configured there applies too.

Locally (``FlinkService``), ``job_endpoint: auto`` points the job at the job server it started, ``environment:
PROCESS`` at Beam's ``boot`` it built (each TaskManager starts its own Python SDK workers with it), and
``files_to_stage: auto`` at the one empty marker jar. That jar is all a job ships: Beam's runner jars are on that
cluster's classpath, and its job server (``beamflow.launcher.LoopbackJobServer``) stages only ``--files_to_stage``.
Beam 2.62's own ``FlinkJobServerDriver`` ignores ``--files_to_stage`` and uploads its whole classpath (165 jars, 190
MB) with every job. ``options_for_service`` fills all three in for a ``ServiceState``.

Deployments: PROCESS with ``{type: PROCESS, command: /opt/apache/beam/boot}`` where every TaskManager's image has
boot, this project and apache-beam of the submitter's exact version; or an EXTERNAL worker pool beside each
TaskManager::

    python -m runners.worker_pool --port 50000     # Beam's worker pool, bound to 127.0.0.1 (see runners/worker_pool.py)

with ``environment: {type: EXTERNAL, config: "localhost:50000"}`` (the address is resolved on the TaskManager, so
``localhost`` means "the pool next to me"). ``LOOPBACK`` runs the workers inside the submitting process: for debugging
only (one interpreter for every slot, and the job dies with the submitter). ``DOCKER`` needs Docker on every
TaskManager. ``docs/deploying.md`` maps the local shape onto a cluster.

Command-line flags override the YAML: ``flink_options(conf["flink"], sys.argv[1:])``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from apache_beam.options.pipeline_options import PipelineOptions

from beamflow.config import FlinkConfig, JobConfig
from beamflow.services.flink import rocksdb_manifest_settings

_LOG = logging.getLogger(__name__)

__all__ = [
    "WORKER_ENV",
    "SubmissionError",
    "check_reachable",
    "cluster_settings",
    "environment_kind",
    "failed_submission",
    "flink_flags",
    "flink_options",
    "options_for_service",
    "service_settings",
    "wait_until_running",
    "worker_pool_problem",
]

# conf key -> pipeline flag, for plain values passed through as ``--flag=value``.
_VALUE_FLAGS: dict[str, str] = {
    "job_endpoint": "job_endpoint",
    "master": "flink_master",
    "parallelism": "parallelism",
    "max_parallelism": "max_parallelism",
    "checkpointing_interval_ms": "checkpointing_interval",
    "checkpointing_mode": "checkpointing_mode",
    "checkpoint_timeout_ms": "checkpoint_timeout_millis",
    "min_pause_between_checkpoints_ms": "min_pause_between_checkpoints",
    "shutdown_sources_after_idle_ms": "shutdown_sources_after_idle_ms",
    "max_bundle_size": "max_bundle_size",
    "max_bundle_time_ms": "max_bundle_time_mills",
    "savepoint_path": "savepoint_path",
    "sdk_worker_parallelism": "sdk_worker_parallelism",
    "job_name": "job_name",
}
# conf key -> boolean flags set when the key is true.
_BOOL_FLAGS: dict[str, tuple[str, ...]] = {
    "unaligned_checkpoints": ("unaligned_checkpoint_enabled",),
    "retained_checkpoints": ("externalized_checkpoints_enabled", "retain_externalized_checkpoints_on_cancellation"),
    "allow_non_restored_state": ("allow_non_restored_state",),
    "finish_bundle_before_checkpointing": ("finish_bundle_before_checkpointing",),
    "object_reuse": ("object_reuse",),
}
# Keys that only the cluster's config.yaml can carry (see cluster_settings); accepted here so one section configures
# both sides.
_CLUSTER_ONLY = {
    "state_backend",
    "incremental",
    "rocksdb_max_manifest_bytes",
    "retained_checkpoints_count",
    "task_slots",
    "tolerable_failed_checkpoints",
}
# Handled by flink_flags or cluster_settings themselves.
_OTHER = {
    "environment",
    "restart_strategy",
    "streaming",
    "files_to_stage",
    "fail_on_checkpointing_errors",
    "rest_url",
    "experiments",
    "worker_settings",
}
# The keys of the flink: section are FlinkConfig's fields (beamflow/config.py); each one goes somewhere here.
_KNOWN = set(_VALUE_FLAGS) | set(_BOOL_FLAGS) | _CLUSTER_ONLY | _OTHER
_STATE_BACKENDS = {"rocksdb", "hashmap"}
# The PROCESS workers' environment under worker_settings. glibc gives each thread that allocates an arena of its own, up
# to eight per core; a worker has some 40 Python threads and as many native ones (gRPC, librdkafka), and a heap spread
# over 13-14 arenas holds freed memory it cannot hand back. Measured in one soak, the two TaskManagers' workers side by
# side (benchmarks.soak --second-tm-env, 1,500 records/s, minutes 12-39): glibc's free-but-held memory went 47 -> 76 MB
# with the default arenas and 11 -> 23 MB with two; RSS grew 27 and 19 MB (docs/streaming.md).
WORKER_ENV = {"MALLOC_ARENA_MAX": "2"}


def _section(config: FlinkConfig | Mapping[str, Any]) -> Mapping[str, Any]:
    """A flink: section as the keys that are set; a mapping is validated against FlinkConfig (unknown keys are named,
    with the nearest known one)."""
    if isinstance(config, FlinkConfig):
        return config.settings()
    flink = JobConfig.from_dict({"flink": dict(config)}).flink
    return {k: config[k] for k in config} if flink is not None else {}


def flink_flags(config: FlinkConfig | Mapping[str, Any]) -> list[str]:
    """The ``--flag=value`` list for a ``flink:`` config section; raises ValueError naming any unknown key."""
    config = _section(config)
    flags = ["--runner=FlinkRunner"]
    if config.get("streaming", True):
        flags.append("--streaming")
    for key, flag in _VALUE_FLAGS.items():
        value = config.get(key)
        if value is not None and value != "":
            flags.append(f"--{flag}={value}")
    for key, bool_flags in _BOOL_FLAGS.items():
        if config.get(key):
            flags.extend(f"--{flag}" for flag in bool_flags)
    if config.get("fail_on_checkpointing_errors") is False:
        # The job server describes this boolean with default true, so the SDK parses the bare flag as "false".
        flags.append("--fail_on_checkpointing_errors")
    flags.extend(_environment_flags(config.get("environment", "LOOPBACK"), bool(config.get("worker_settings", True))))
    restart = config.get("restart_strategy")
    if restart:
        flags.extend(_restart_flags(restart))
    for path in config.get("files_to_stage") or ():
        flags.append(f"--files_to_stage={path}")
    for experiment in config.get("experiments") or ():
        flags.append(f"--experiments={experiment}")
    if config.get("worker_settings", True):
        from runners.worker_settings import PLUGIN

        flags.append(f"--beam_plugins={PLUGIN}")  # the workers' speed settings, applied as each worker starts
    backend = config.get("state_backend")
    if backend is not None and backend not in _STATE_BACKENDS:
        raise ValueError(f"state_backend must be one of {sorted(_STATE_BACKENDS)}, got {backend!r}")
    return flags


def flink_options(config: FlinkConfig | Mapping[str, Any], argv: Sequence[str] = ()) -> PipelineOptions:
    """PipelineOptions for FlinkRunner: the config section first, then ``argv`` (later flags win)."""
    return PipelineOptions([*flink_flags(config), *argv])


def cluster_settings(config: FlinkConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The config.yaml entries a ``flink:`` section implies for the cluster (``FlinkService(settings=...)``)."""
    config = _section(config)
    settings: dict[str, Any] = {}
    if config.get("state_backend"):
        settings["state.backend.type"] = config["state_backend"]
    if config.get("incremental") is not None:
        settings["state.backend.incremental"] = bool(config["incremental"])
    if config.get("rocksdb_max_manifest_bytes"):
        settings.update(rocksdb_manifest_settings(int(config["rocksdb_max_manifest_bytes"])))
    if config.get("retained_checkpoints_count"):
        settings["state.checkpoints.num-retained"] = int(config["retained_checkpoints_count"])
    if config.get("retained_checkpoints"):
        settings["execution.checkpointing.externalized-checkpoint-retention"] = "RETAIN_ON_CANCELLATION"
    if config.get("tolerable_failed_checkpoints") is not None:
        # Beam 2.62 has no job option for it (fail_on_checkpointing_errors is all or nothing); set on the cluster,
        # which the job server's environment reads, it also overrides Beam's "fail on the first failed checkpoint".
        settings["execution.checkpointing.tolerable-failed-checkpoints"] = int(config["tolerable_failed_checkpoints"])
    if config.get("task_slots"):
        settings["taskmanager.numberOfTaskSlots"] = int(config["task_slots"])
    if config.get("parallelism"):
        settings["parallelism.default"] = int(config["parallelism"])
    restart = config.get("restart_strategy")
    if isinstance(restart, Mapping):
        kind = str(restart.get("type", "fixed-delay"))
        settings["restart-strategy.type"] = kind
        if kind == "fixed-delay":
            settings["restart-strategy.fixed-delay.attempts"] = int(restart.get("attempts", 3))
            settings["restart-strategy.fixed-delay.delay"] = f"{int(restart.get('delay_ms', 10000))} ms"
        elif kind == "exponential-delay":
            settings["restart-strategy.exponential-delay.initial-backoff"] = (
                f"{int(restart.get('initial_backoff_ms', 1000))} ms"
            )
            settings["restart-strategy.exponential-delay.max-backoff"] = (
                f"{int(restart.get('max_backoff_ms', 60000))} ms"
            )
    return settings


def options_for_service(
    state: Any, config: Mapping[str, Any] | None = None, argv: Sequence[str] = ()
) -> PipelineOptions:
    """Options for the local ``FlinkService`` (its ``ServiceState``): its job endpoint, PROCESS workers beside each
    TaskManager (Beam's boot), and only the empty marker jar staged (the job server ships nothing else; Beam's runner
    jars are on the cluster's classpath)."""
    merged: dict[str, Any] = {**service_settings(state), **(config or {})}
    return flink_options(merged, argv)


def service_settings(state: Any) -> dict[str, Any]:
    """The ``flink:`` settings that point a job at the local ``FlinkService``."""
    return {
        "job_endpoint": state.info.get("job_endpoint") or f"127.0.0.1:{state.ports['job']}",
        "environment": {"type": "PROCESS", "command": state.info["boot"]},
        "files_to_stage": [state.info["marker_jar"]],
    }


def environment_kind(environment: Any) -> str:
    """LOOPBACK, EXTERNAL, PROCESS or DOCKER, from a ``flink.environment`` setting (a name or a mapping)."""
    kind = environment.get("type", "LOOPBACK") if isinstance(environment, Mapping) else environment
    return str(kind).upper()


def _environment_flags(environment: Any, worker_settings: bool = True) -> list[str]:
    if not isinstance(environment, str | Mapping):
        raise ValueError(
            "environment must be LOOPBACK, PROCESS, {type: PROCESS, command: /path/to/boot} or "
            f"{{type: EXTERNAL, config: host:port}}, got {environment!r}"
        )
    kind = environment_kind(environment)
    settings = environment if isinstance(environment, Mapping) else {}
    if kind not in {"LOOPBACK", "EXTERNAL", "PROCESS", "DOCKER"}:
        raise ValueError(f"unknown environment type {kind!r}")
    flags = [f"--environment_type={kind}"]
    if kind == "LOOPBACK":
        from runners.worker_pool import bind_loopback_worker_pool

        # Beam's in-process pool binds [::]; beamflow's binds 127.0.0.1 (runners/worker_pool.py says why and how).
        bind_loopback_worker_pool()
    if kind == "PROCESS":
        command = settings.get("command")
        if not command:
            raise ValueError(
                "environment PROCESS needs command: the path of Beam's Python boot binary on every TaskManager "
                "(locally `flink.environment: PROCESS` with `flink.job_endpoint: auto` fills in the local one)"
            )
        env = settings.get("env") or {}
        if not isinstance(env, Mapping) or not all(isinstance(v, str | int) for v in env.values()):
            raise ValueError(f"environment env must map variable names to strings, got {env!r}")
        env = {**(WORKER_ENV if worker_settings else {}), **{str(k): str(v) for k, v in env.items()}}
        payload: dict[str, Any] = {"command": str(command)}
        if env:
            payload["env"] = env  # Beam's boot is started with these, and the Python worker inherits them
        flags.append("--environment_config=" + json.dumps(payload))
        return flags
    address = settings.get("config")
    if kind == "EXTERNAL" and not address:
        raise ValueError("environment EXTERNAL needs config: host:port of a worker pool beside each TaskManager")
    if address:
        flags.append(f"--environment_config={address}")
    return flags


def _restart_flags(restart: Any) -> list[str]:
    """Beam's job-level restart options express only a fixed delay; other strategies are cluster settings."""
    if not isinstance(restart, Mapping):
        raise ValueError(f"restart_strategy must be a mapping like {{type: fixed-delay, attempts: 3}}, got {restart!r}")
    if str(restart.get("type", "fixed-delay")) != "fixed-delay":
        return []
    flags = [f"--number_of_execution_retries={int(restart.get('attempts', 3))}"]
    if restart.get("delay_ms") is not None:
        flags.append(f"--execution_retry_delay={int(restart['delay_ms'])}")
    return flags


class SubmissionError(RuntimeError):
    """A job could not be handed to the Flink cluster; the message is one line saying what to fix."""


def check_reachable(config: FlinkConfig | Mapping[str, Any], timeout_s: float = 5.0) -> None:
    """Before submitting: the job server answers, and an EXTERNAL worker pool listens (else one clear line).

    Without this, an endpoint that does not answer surfaces a minute later as a bare ``grpc.FutureTimeoutError``.
    """
    config = _section(config)
    endpoint = str(config.get("job_endpoint") or "")
    if not endpoint or endpoint == "auto":
        raise SubmissionError(
            "flink.job_endpoint is not set: `auto` means the local job server (`beamflow services up flink`), "
            "a deployment names its host:port"
        )
    if not _answers(endpoint, timeout_s):
        raise SubmissionError(
            f"the Beam job server at {endpoint} (flink.job_endpoint) does not answer; start it "
            "(`beamflow services up flink` locally) or set flink.job_endpoint to the one that runs"
        )
    environment = config.get("environment", "LOOPBACK")
    if environment_kind(environment) == "EXTERNAL" and isinstance(environment, Mapping):
        pool = str(environment.get("config") or "")
        # The TaskManagers resolve this address on their own hosts; here it can be checked only when they are local.
        host = pool.rsplit(":", 1)[0]
        if host in ("localhost", "127.0.0.1", "::1"):
            problem = worker_pool_problem(pool, timeout_s)
            if problem:
                raise SubmissionError(problem)


def worker_pool_problem(pool: str, timeout_s: float = 5.0) -> str | None:
    """Why the worker pool at ``pool`` cannot run this submitter's pipeline, in one line; None when it can.

    Down: nothing listens. Mismatched: its workers run another apache-beam or Python version than this process
    (pickled functions and Beam's protos do not cross versions: the job would fail on the TaskManagers, or hang).
    A pool that is not beamflow's (``runners.worker_pool``) cannot say its versions; that is logged, not refused.
    """
    import grpc

    from runners.worker_pool import local_versions, pool_versions

    start = "python -m runners.worker_pool --port " + pool.rsplit(":", 1)[-1]
    if not _answers(pool, timeout_s):
        return (
            f"no Python worker pool answers at {pool} (flink.environment.config); start one beside each "
            f"TaskManager: {start}"
        )
    try:
        theirs = pool_versions(pool, timeout_s)
    except grpc.RpcError as exc:
        return f"the Python worker pool at {pool} (flink.environment.config) does not answer gRPC: {exc.code()}"
    if theirs is None:
        _LOG.warning(
            "the worker pool at %s is not beamflow's runners.worker_pool: its apache-beam version is unchecked "
            "(it must be %s)",
            pool,
            local_versions()["apache_beam"],
        )
        return None
    ours = local_versions()
    differ = [f"{k} {theirs.get(k)} (here {v})" for k, v in ours.items() if theirs.get(k) != v]
    if differ:
        return (
            f"the Python worker pool at {pool} (flink.environment.config) runs {', '.join(differ)}: its workers "
            f"cannot run this pipeline; restart it from this environment: {start}"
        )
    return None


def _answers(address: str, timeout_s: float) -> bool:
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def wait_until_running(
    result: Any, job_name: str | None = None, rest_url: str | None = None, timeout_s: float = 300.0
) -> str:
    """After ``pipeline.run()`` on the job server: waits until the job runs (or ended), returns its state.

    A detached submission returns here: the job lives on the cluster with its workers beside the TaskManagers, so the
    submitting process may exit (LOOPBACK workers would die with it, so LOOPBACK jobs are always waited for). Beam's
    job server says RUNNING as soon as it starts handing the job to Flink, 15-20 s before Flink has it; with the
    cluster's REST address (``flink.rest_url``) this also waits until Flink runs a job of that name.
    """
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        state = str(result.state)
        if state in ("DONE", "FAILED", "CANCELLED", "UPDATED", "DRAINED"):
            return state
        if state == "RUNNING" and (not rest_url or not job_name or _flink_runs(rest_url, job_name)):
            return state
        if time.monotonic() > deadline:
            raise SubmissionError(f"the job did not start within {timeout_s:.0f}s (last state {state})")
        time.sleep(1.0)


# Flink's message when a savepoint holds the state of an operator the new job graph lacks.
_UNMAPPED_STATE = "Cannot map checkpoint/savepoint state"


def failed_submission(state: str, job_name: str | None, rest_url: str | None) -> str:
    """The one line to exit with when a detached job ended as it started (``FAILED``, ``CANCELLED``), else "".

    Beam's job server says only FAILED; the reason is in Flink's job exceptions (a savepoint that does not fit the
    program, a missing checkpoint folder, a class not found), so it is fetched and named here, with what to do for
    the savepoint case.
    """
    if state not in ("FAILED", "CANCELLED"):
        return ""
    cause = ""
    if rest_url and job_name:
        from beamflow.flink_rest import FlinkRest

        try:
            rest = FlinkRest(rest_url, timeout=10)
            newest = next((job for job in rest.jobs() if job.name == job_name), None)
            cause = rest.failure_cause(newest.job_id) if newest is not None else ""
        except Exception as exc:  # the cluster's REST API is down too: say so rather than hide the state
            cause = f"(its reason could not be read from {rest_url}: {type(exc).__name__})"
    line = f"job {job_name} is {state} on the Flink cluster" + (f": {cause}" if cause else "")
    if _UNMAPPED_STATE in cause:
        line += (
            ". The savepoint holds state of an operator this job does not have: another job's savepoint, or one "
            "taken at parallelism 1 on a runner without beamflow's Impulse patch (docs/deploying.md, 'Changing the "
            "parallelism through a savepoint': start that job afresh, it continues from its group's committed offsets)"
        )
    return line


def _flink_runs(rest_url: str, job_name: str) -> bool:
    from beamflow.flink_rest import FlinkRest

    try:
        return any(job.name == job_name and job.state == "RUNNING" for job in FlinkRest(rest_url, timeout=5).jobs())
    except Exception:  # the REST API may be slow under load: keep waiting until the deadline
        return False

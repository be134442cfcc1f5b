"""A real Flink session cluster on 127.0.0.1 (one JobManager, two TaskManagers) plus Beam's Flink job server.

Everything is fetched from the registries the project may use and laid out under the cache:

* the Flink distribution from PyPI: ``apache-flink`` (a wheel holding ``pyflink/bin`` and ``pyflink/conf``) and
  ``apache-flink-libraries`` (an sdist holding ``deps/lib``, ``deps/opt``, ``deps/plugins`` and
  ``deps/bin/bash-java-utils.jar``), unpacked into ``<cache>/flink-<version>`` (a FLINK_HOME). Neither is installed
  into the Python environment (``apache-flink`` pins an old apache-beam).
* Beam's Flink job server from Maven Central: the prebuilt ``beam-runners-flink-<v>-job-server`` shadow jar is not
  served there, so the runner artifact ``beam-runners-flink-1.19`` is resolved with its runtime dependencies and
  ``org.apache.beam.runners.flink.FlinkJobServerDriver`` is run from that classpath.

The production worker shape, locally: each TaskManager starts its own Python SDK workers through Beam's PROCESS
environment (Beam's ``boot`` binary, built from the Go module proxy, runs ``sdk_worker_main`` with this project's
interpreter), so the workers live beside their TaskManager, die with it, and leave the submitting process free to
exit (detached submission). Beam's runner jars sit on the cluster's own classpath (``<data>/flink/lib``, Flink's
``FLINK_LIB_DIR``, for the JobManager and the TaskManagers alike), and the job server stages only the job's
``--files_to_stage`` (the one empty marker jar), not its own classpath as Beam 2.62's invoker does (165 jars, 190 MB
uploaded to the blob store with every job and downloaded by each TaskManager running it: measured here, 29-37 s of
upload per submission and 400 MB of blobs per job, against 0.2 s and 181 bytes per store with the marker jar).

The processes are started in the foreground (``bin/jobmanager.sh start-foreground`` and ``bin/taskmanager.sh
start-foreground`` exec the JVM), each in its own process group so ``down()`` leaves no JVM behind. Every port is
picked free and bound to 127.0.0.1; configuration lives in ``<data>/flink/conf/config.yaml`` (FLINK_CONF_DIR for the
cluster and the job server alike, so cluster-side defaults such as the state backend, checkpoint storage and retention
also apply to jobs the job server builds).

Loopback only, Beam's servers included. Beam 2.62 binds its gRPC servers with ``NettyServerBuilder.forPort``, every
interface, whatever ``--job-host`` says, and offers no option for it; two small Java classes of beamflow's own
(``beamflow/services/java/``, compiled with ``javac`` against the job server's classpath at setup, cached under
``<cache>/beamflow-java/`` by a hash of their sources, rebuilt when missing) close that:

* the job server runs ``beamflow.launcher.LoopbackJobServer`` instead of ``FlinkJobServerDriver``: the same arguments
  and driver code (``JobServerDriver``'s protected constructor), with job and artifact servers built by a loopback
  server factory (the expansion server binds ``--job-host`` itself), and ``StageNothingFlinkJobInvoker``: Beam's
  ``FlinkJobInvoker`` handing ``FlinkPipelineRunner`` the job's ``--files_to_stage`` instead of the job server's
  classpath (see above);
* the TaskManagers' Fn API servers for the Python workers come from ``ServerFactory.createDefault()``, which no
  option or hook reaches: ``0-beamflow-loopback-fn-servers.jar`` holds beamflow's own
  ``org.apache.beam.sdk.fn.server.ServerFactory`` (Beam's public API, binding 127.0.0.1). It is first on the
  cluster's classpath: Flink's ``config.sh`` (``constructFlinkClassPath``) puts every jar of ``lib/`` on the JVM's
  classpath in sorted order (``0-`` first), flink-dist last, and Beam's jars are in ``lib/`` only (not in Flink's
  own lib), so the application class loader finds beamflow's class first. A job ships no Beam jar, so its
  child-first user-code class loader has no ServerFactory of its own and delegates to that one. (Beam's own invoker
  shipped the job server's classpath, where the jar is first too.) Only that class changes, only on this cluster.

One fix of Beam's own rides the same way: ``0-beamflow-sdf-residuals.jar`` (``beamflow.services.beam_patches``) holds
Beam 2.62's three runner classes patched so a deferring splittable DoFn's residuals live in one map state instead of a
new keyed state per deferral (apache/beam#27648), first in ``lib/`` and on the job server's classpath.

``tests/flink/test_loopback_only.py`` lists every listening socket of the services with a job running.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from beamflow.flink_rest import FlinkRest
from beamflow.services.base import (
    LocalService,
    ServiceError,
    ServiceState,
    free_port,
    pid_alive,
    port_open,
    start_process,
    stop_process_group,
    wait_for_port,
    wait_until,
)
from beamflow.services.beam_patches import SDF_RESIDUALS_JAR, sdf_residual_sources
from beamflow.services.fetch import FLINK_MAVEN_REPO, maven_classpath, pypi_download
from beamflow.services.gobuild import go_install
from beamflow.services.paths import project_root

__all__ = [
    "BEAM_VERSION",
    "FLINK_VERSION",
    "FlinkService",
    "compile_java",
    "java_jar",
    "python_workers",
    "rocksdb_manifest_settings",
    "runner_jars",
]

FLINK_VERSION = "1.19.3"
BEAM_VERSION = "2.62.0"
# The runner is built against Flink 1.19.0; the client side of a 1.19.x cluster is wire compatible.
JOB_SERVER_COORDINATES = (
    f"org.apache.beam:beam-runners-flink-1.19:{BEAM_VERSION}",
    # Beam's "--state_backend=rocksdb" and the cluster's "state.backend.type: rocksdb" both load RocksDB classes in
    # the job server, where the graph is built; the runner leaves that dependency to the user.
    "org.apache.flink:flink-statebackend-rocksdb:1.19.0",
    # The runner logs through slf4j 1.7 (its resolved API version); without a binding its logs are lost.
    "org.slf4j:slf4j-simple:1.7.30",
)
# Beam's FlinkJobServerDriver, with its job and artifact servers bound to loopback (java/launcher/, see above).
JOB_SERVER_MAIN = "beamflow.launcher.LoopbackJobServer"
# Java sources of beamflow's own, compiled at setup (one folder per class folder or jar).
JAVA_SOURCES = Path(__file__).resolve().parent / "java"
# First in the cluster's lib/ (sorted by name): its ServerFactory is loaded ahead of Beam's.
FN_SERVERS_JAR = "0-beamflow-loopback-fn-servers.jar"
LAUNCHER_JAR = "beamflow-loopback-job-server.jar"
# RocksDB options that bound each state instance's MANIFEST (java/rocksdb/, see BoundedManifestOptionsFactory).
ROCKSDB_OPTIONS_JAR = "beamflow-rocksdb-options.jar"
ROCKSDB_OPTIONS_FACTORY = "beamflow.flink.BoundedManifestOptionsFactory"
# conf/flink.yaml's rocksdb_max_manifest_bytes, the local cluster's default.
ROCKSDB_MAX_MANIFEST_BYTES = 16384


def rocksdb_manifest_settings(max_bytes: int) -> dict[str, str]:
    """config.yaml entries that bound each RocksDB instance's MANIFEST at ``max_bytes`` (a roll-over threshold):
    without them RocksDB's 1 GB default lets it grow by a version edit per checkpoint flush, and Flink uploads it
    whole with every incremental checkpoint (``java/rocksdb/.../BoundedManifestOptionsFactory.java``)."""
    return {
        "state.backend.rocksdb.options-factory": ROCKSDB_OPTIONS_FACTORY,
        "beamflow.rocksdb.max-manifest-file-size": f"{max_bytes} bytes",
    }


# Beam's Python SDK container entry point (boot.go), the PROCESS environment's command.
BOOT_PACKAGE = "github.com/apache/beam/sdks/v2/python/container"
BOOT_VERSION = f"v{BEAM_VERSION}"
TASKMANAGERS = 2

# Cluster-wide defaults written into config.yaml; overridable through FlinkService(settings=...).
DEFAULT_SETTINGS: dict[str, Any] = {
    # Two TaskManagers with two slots each: a parallelism-2 job gets one subtask of every vertex per TaskManager (the
    # spread-out rule), so each TaskManager's Python workers run half the job, on their own interpreter.
    "taskmanager.numberOfTaskSlots": 2,
    "cluster.evenly-spread-out-slots": True,
    "parallelism.default": 1,
    "jobmanager.memory.process.size": "1024m",
    "taskmanager.memory.process.size": "1536m",
    "state.backend.type": "rocksdb",
    "state.backend.incremental": True,
    **rocksdb_manifest_settings(ROCKSDB_MAX_MANIFEST_BYTES),
    "state.checkpoints.num-retained": 3,
    "execution.checkpointing.externalized-checkpoint-retention": "RETAIN_ON_CANCELLATION",
    # conf/flink.yaml's tolerable_failed_checkpoints: one slow checkpoint must not restart the job (Beam's default).
    "execution.checkpointing.tolerable-failed-checkpoints": 3,
    "restart-strategy.type": "fixed-delay",
    "restart-strategy.fixed-delay.attempts": 20,
    "restart-strategy.fixed-delay.delay": "2 s",
    # A SIGKILLed TaskManager is noticed by heartbeat; the default (50 s) makes failure drills slow.
    "heartbeat.interval": 2000,
    "heartbeat.timeout": 15000,
    "jobmanager.execution.failover-strategy": "region",
    # Aligned checkpoint barriers queue behind the records already in the network buffers; on a backlog every buffer
    # is full and Python stages drain them slowly. Debloating sizes the buffers to about one second of each
    # channel's throughput, which bounds how long a barrier waits at each exchange.
    "taskmanager.network.memory.buffer-debloat.enabled": True,
    # Batch jobs (a bounded clicks run with streaming: false): every blocking result partition asks this many network
    # buffers up front; Flink's 512 exceeded the local TaskManager's 4,096 at parallelism 2 ("Insufficient number of
    # network buffers") and made the job fail over once.
    "taskmanager.network.sort-shuffle.min-buffers": 64,
    # A thread dump (web UI, REST) shows 8 frames per thread by default: too few to see where a task thread waits
    # inside Beam's runner (the SDK harness, the bundle, the state backend).
    "cluster.thread-dump.stacktrace-max-depth": 48,
}


class FlinkService(LocalService):
    """Flink session cluster (JobManager + TaskManager) and Beam's Flink job server, all on 127.0.0.1.

    State: ``ports`` holds ``rest`` (Flink REST/web UI), ``job`` (Beam job endpoint for ``--job_endpoint``),
    ``artifact``, ``expansion`` and the cluster's internal ports; ``info`` holds ``flink_home``, ``conf_dir``,
    ``checkpoints_dir``, ``savepoints_dir``, ``job_server_classpath`` and the role of each pid.
    """

    name = "flink"

    def __init__(
        self,
        data_dir: Path,
        cache_dir: Path,
        settings: dict[str, Any] | None = None,
        taskmanagers: int = TASKMANAGERS,
    ) -> None:
        super().__init__(data_dir, cache_dir)
        self.settings = {**DEFAULT_SETTINGS, **(settings or {})}
        if taskmanagers < 1:
            raise ValueError("a Flink cluster needs at least one TaskManager")
        self.taskmanagers = taskmanagers

    # -- paths ------------------------------------------------------------------------------------------------
    @property
    def flink_home(self) -> Path:
        return self.cache_dir / f"flink-{FLINK_VERSION}"

    @property
    def conf_dir(self) -> Path:
        return self.home / "conf"

    @property
    def checkpoints_dir(self) -> Path:
        return self.home / "checkpoints"

    @property
    def savepoints_dir(self) -> Path:
        return self.home / "savepoints"

    @property
    def log_dir(self) -> Path:
        return self.home / "log"

    @property
    def lib_dir(self) -> Path:
        """The cluster's classpath (FLINK_LIB_DIR): Flink's own lib plus Beam's runner jars."""
        return self.home / "lib"

    @property
    def marker_jar(self) -> Path:
        """The empty jar a job names in ``--files_to_stage``: all it ships (Beam's jars are in ``lib_dir``)."""
        return self.home / "job-jars" / "beamflow-job.jar"

    # -- install ----------------------------------------------------------------------------------------------
    def install(self) -> None:
        self._install_distribution()
        self.job_server_classpath()
        self.launcher_jar()
        self.fn_servers_jar()
        self.sdf_residuals_jar()
        self.rocksdb_options_jar()
        self.boot_binary()

    def launcher_jar(self) -> Path:
        """``beamflow.launcher.LoopbackJobServer`` (with its job invoker) compiled against the job server's
        classpath, as a jar on the job server's classpath."""
        return java_jar(JAVA_SOURCES / "launcher", self.job_server_classpath(), self.cache_dir, LAUNCHER_JAR)

    def fn_servers_jar(self) -> Path:
        """beamflow's loopback ``ServerFactory`` for the TaskManagers, as a jar to put first in ``lib/``."""
        return java_jar(JAVA_SOURCES / "fnservers", self.job_server_classpath(), self.cache_dir, FN_SERVERS_JAR)

    def rocksdb_options_jar(self) -> Path:
        """``beamflow.flink.BoundedManifestOptionsFactory`` (RocksDB's MANIFEST bounded, so incremental checkpoints
        stop growing with every flush), as a jar in ``lib/`` and on the job server's classpath."""
        return java_jar(JAVA_SOURCES / "rocksdb", self.job_server_classpath(), self.cache_dir, ROCKSDB_OPTIONS_JAR)

    def sdf_residuals_jar(self) -> Path:
        """Beam's runner classes patched so a deferring read's state stays bounded (``beam_patches``), as a jar to put
        first in ``lib/`` and on the job server's classpath (the operator is serialized there, run here)."""
        sources = sdf_residual_sources(BEAM_VERSION, self.cache_dir)
        return java_jar(sources, self.job_server_classpath(), self.cache_dir, SDF_RESIDUALS_JAR)

    def boot_binary(self) -> Path:
        """Beam's Python SDK ``boot`` (the PROCESS environment's command), built once from the Go module proxy."""
        return go_install(BOOT_PACKAGE, BOOT_VERSION, "container", self.cache_dir)

    def job_server_classpath(self) -> Path:
        """The folder of Beam's Flink job server jars (the runner with its runtime dependencies), resolved once."""
        return maven_classpath(
            f"beam-flink-job-server-{BEAM_VERSION}-flink-1.19", JOB_SERVER_COORDINATES, self.cache_dir, FLINK_MAVEN_REPO
        )

    def _install_distribution(self) -> Path:
        home = self.flink_home
        stamp = home / ".complete"
        if stamp.exists():
            return home
        wheel = pypi_download(f"apache-flink=={FLINK_VERSION}", self.cache_dir)
        sdist = self._download_libraries_sdist()
        staging = home.with_name(home.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                for part in ("bin", "conf"):
                    prefix = f"pyflink/{part}/"
                    if member.startswith(prefix) and not member.endswith("/"):
                        target = staging / part / member[len(prefix) :]
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(zf.read(member))
        with tarfile.open(sdist) as tf:
            for info in tf:
                parts = Path(info.name).parts
                if len(parts) < 4 or parts[1] != "deps" or not info.isfile():
                    continue
                section, rest = parts[2], parts[3:]
                if section not in {"lib", "opt", "plugins", "bin"} or (section == "opt" and rest[0] == "python"):
                    continue  # opt/python is PyFlink's own Python deps; not needed to run a cluster
                target = staging.joinpath(section, *rest)
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tf.extractfile(info)
                if source is None:
                    continue
                with source, open(target, "wb") as out:
                    shutil.copyfileobj(source, out)
        for script in (staging / "bin").iterdir():
            if script.suffix == ".sh" or script.name == "flink":
                script.chmod(0o755)
        if not (staging / "lib" / f"flink-dist-{FLINK_VERSION}.jar").exists():
            raise ServiceError(f"{sdist.name} has no deps/lib/flink-dist-{FLINK_VERSION}.jar; cannot lay out Flink")
        shutil.rmtree(home, ignore_errors=True)
        staging.rename(home)
        stamp.write_text(f"apache-flink=={FLINK_VERSION}\n")
        return home

    def _download_libraries_sdist(self) -> Path:
        """``apache-flink-libraries`` is an sdist: pip must build its metadata, which needs build isolation.

        (``fetch.pypi_download`` passes ``--no-build-isolation``, which fails here: the venv has no ``wheel``.)
        """
        target = self.cache_dir / "pypi"
        target.mkdir(parents=True, exist_ok=True)
        name = f"apache-flink-libraries-{FLINK_VERSION}.tar.gz"
        if (target / name).exists():
            return target / name
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(target),
             f"apache-flink-libraries=={FLINK_VERSION}"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if result.returncode != 0 or not (target / name).exists():
            raise ServiceError(
                f"pip could not download apache-flink-libraries=={FLINK_VERSION}: {result.stderr[-2000:]}"
            )
        return target / name

    # -- configuration ----------------------------------------------------------------------------------------
    def _java_opts(self) -> str:
        template = yaml.safe_load((self.flink_home / "conf" / "config.yaml").read_text()) or {}
        opts = _flatten(template).get("env.java.opts.all", "")
        return str(opts)

    def write_config(self, ports: dict[str, int]) -> Path:
        """Writes FLINK_CONF_DIR (config.yaml + log4j files) for these ports; returns the folder."""
        conf = self.conf_dir
        conf.mkdir(parents=True, exist_ok=True)
        for folder in (self.checkpoints_dir, self.savepoints_dir, self.log_dir, self.home / "tmp"):
            folder.mkdir(parents=True, exist_ok=True)
        for template in (self.flink_home / "conf").glob("log4j*.properties"):
            shutil.copy(template, conf / template.name)
        # The JobManager's metric fetcher logs why a TaskManager's metrics did not arrive only at DEBUG (a few lines
        # every 10 s while someone reads metrics): `beamflow status` once showed no Beam metric at all for a running
        # job after TaskManager restarts, and INFO said nothing. start-foreground reads log4j-console.properties.
        for name in ("log4j-console.properties", "log4j.properties"):
            with (conf / name).open("a") as log4j:
                log4j.write(
                    "\nlogger.beamflow_metric_fetcher.name = org.apache.flink.runtime.rest.handler.legacy.metrics\n"
                    "logger.beamflow_metric_fetcher.level = DEBUG\n"
                )
        settings: dict[str, Any] = {
            "env.java.opts.all": self._java_opts(),
            "jobmanager.rpc.address": "127.0.0.1",
            "jobmanager.rpc.port": ports["jobmanager_rpc"],
            "jobmanager.bind-host": "127.0.0.1",
            "taskmanager.host": "127.0.0.1",
            "taskmanager.bind-host": "127.0.0.1",
            "rest.address": "127.0.0.1",
            "rest.bind-address": "127.0.0.1",
            "rest.port": ports["rest"],
            "blob.server.port": ports["blob"],
            "queryable-state.enable": False,
            "io.tmp.dirs": str(self.home / "tmp"),
            "web.tmpdir": str(self.home / "tmp" / "web"),
            "blob.storage.directory": str(self.home / "tmp" / "blob"),
            "state.checkpoints.dir": self.checkpoints_dir.as_uri(),
            "state.savepoints.dir": self.savepoints_dir.as_uri(),
            **self.settings,
        }
        (conf / "config.yaml").write_text(yaml.safe_dump(settings, sort_keys=True))
        (conf / "masters").write_text(f"127.0.0.1:{ports['rest']}\n")
        (conf / "workers").write_text("127.0.0.1\n")
        self._write_lib()
        return conf

    def _write_lib(self) -> None:
        """FLINK_LIB_DIR: links to Flink's lib and to Beam's runner jars; and the empty jar a job stages instead."""
        shutil.rmtree(self.lib_dir, ignore_errors=True)
        self.lib_dir.mkdir(parents=True)
        for jar in [*sorted((self.flink_home / "lib").glob("*.jar")), *runner_jars(self.job_server_classpath())]:
            (self.lib_dir / jar.name).symlink_to(jar)
        # Sorted first on the classpath: the TaskManagers' Fn API servers bind loopback (see the module docstring).
        (self.lib_dir / FN_SERVERS_JAR).symlink_to(self.fn_servers_jar())
        # Also first: the SDF residual fix (apache/beam#27648, see beamflow.services.beam_patches).
        (self.lib_dir / SDF_RESIDUALS_JAR).symlink_to(self.sdf_residuals_jar())
        (self.lib_dir / ROCKSDB_OPTIONS_JAR).symlink_to(self.rocksdb_options_jar())
        self.marker_jar.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(self.marker_jar, "w") as jar_file:
            jar_file.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\nCreated-By: beamflow\n")

    def _env(self) -> dict[str, str]:
        python_bin = os.path.dirname(sys.executable)
        return {
            "FLINK_HOME": str(self.flink_home),
            "FLINK_CONF_DIR": str(self.conf_dir),
            "FLINK_LOG_DIR": str(self.log_dir),
            "FLINK_LIB_DIR": str(self.lib_dir),
            # config.sh writes the JVM's pid file here when daemonizing; keep it out of /tmp.
            "FLINK_PID_DIR": str(self.home / "tmp"),
            # For the PROCESS environment: boot runs `python -m ...sdk_worker_main` found on PATH, in that Python
            # itself (not a fresh venv per worker): this interpreter, which has beamflow and apache-beam installed.
            "PATH": python_bin + os.pathsep + os.environ.get("PATH", ""),
            "RUN_PYTHON_SDK_IN_DEFAULT_ENVIRONMENT": "1",
            # The job's own modules: beamflow, transforms, runners and pipelines are installed; tests and benchmarks
            # define DoFns too, and workers import what the submitter pickled by reference.
            "PYTHONPATH": str(project_root()),
        }

    # -- processes --------------------------------------------------------------------------------------------
    def _start_jobmanager(self, ports: dict[str, int]) -> int:
        argv = [
            str(self.flink_home / "bin" / "jobmanager.sh"), "start-foreground",
            "-D", f"metrics.internal.query-service.port={ports['jobmanager_query']}",
        ]  # fmt: skip
        return start_process(argv, self.log_dir / "jobmanager.out", env=self._env(), cwd=self.home).pid

    def _start_taskmanager(self, ports: dict[str, int], index: int = 1) -> int:
        """TaskManager ``index`` (1-based) on its own ports, with its own id and log files."""
        suffix = "" if index == 1 else f"_{index}"
        argv = [
            str(self.flink_home / "bin" / "taskmanager.sh"), "start-foreground",
            # Unique per start: a restarted TaskManager must register as new (the JobManager keeps listing the killed
            # one until its heartbeat times out, and restart() waits for a registration it did not know).
            "-D", f"taskmanager.resource-id=taskmanager-{index}-{uuid.uuid4().hex[:6]}",
            "-D", f"taskmanager.rpc.port={ports['taskmanager_rpc' + suffix]}",
            "-D", f"taskmanager.data.port={ports['taskmanager_data' + suffix]}",
            "-D", f"metrics.internal.query-service.port={ports['taskmanager_query' + suffix]}",
        ]  # fmt: skip
        return start_process(argv, self.log_dir / f"taskmanager-{index}.out", env=self._env(), cwd=self.home).pid

    def _start_job_server(self, ports: dict[str, int]) -> int:
        classpath = self.job_server_classpath()
        argv = [
            "java", *self._java_opts().split(), "-Xmx768m",
            "-Dorg.slf4j.simpleLogger.defaultLogLevel=info",
            "-Dorg.slf4j.simpleLogger.showDateTime=true",
            "-Dorg.slf4j.simpleLogger.dateTimeFormat=yyyy-MM-dd HH:mm:ss.SSS",
            # The fn-servers jar first: beamflow's ServerFactory is the one any Fn API server of the job server
            # binds with. (Jobs ship only their --files_to_stage: StageNothingFlinkJobInvoker, not this classpath.)
            "-cp", os.pathsep.join(
                [
                    str(self.fn_servers_jar()),
                    str(self.sdf_residuals_jar()),
                    str(self.launcher_jar()),
                    str(self.rocksdb_options_jar()),
                    f"{classpath}/*",
                ]
            ),
            JOB_SERVER_MAIN,
            f"--flink-master=127.0.0.1:{ports['rest']}",
            f"--flink-conf-dir={self.conf_dir}",
            "--job-host=127.0.0.1",
            f"--job-port={ports['job']}",
            f"--artifact-port={ports['artifact']}",
            f"--expansion-port={ports['expansion']}",
            f"--artifacts-dir={self.home / 'artifacts'}",
        ]  # fmt: skip
        return start_process(argv, self.log_dir / "jobserver.out", env=self._env(), cwd=self.home).pid

    def _start(self) -> ServiceState:
        names = ["rest", "jobmanager_rpc", "blob", "jobmanager_query", "job", "artifact", "expansion"]
        for index in range(1, self.taskmanagers + 1):
            suffix = "" if index == 1 else f"_{index}"
            names += [f"taskmanager_rpc{suffix}", f"taskmanager_data{suffix}", f"taskmanager_query{suffix}"]
        ports: dict[str, int] = {}
        while len(ports) < len(names):  # free_port can hand back the same number twice
            port = free_port()
            if port not in ports.values():
                ports[names[len(ports)]] = port
        self.write_config(ports)
        timings: dict[str, float] = {}
        started = time.monotonic()
        roles: dict[str, int] = {}
        state = ServiceState(name=self.name, ports=ports)
        try:
            roles["jobmanager"] = self._start_jobmanager(ports)
            for index in range(1, self.taskmanagers + 1):
                roles[_taskmanager_role(index)] = self._start_taskmanager(ports, index)
            # The job server talks to the cluster only when a job is submitted, so all three JVMs boot together.
            roles["job_server"] = self._start_job_server(ports)
            state.pids = list(roles.values())
            rest = FlinkRest(f"http://127.0.0.1:{ports['rest']}")
            _wait(
                lambda: _cluster_ready(rest, roles, self.taskmanagers, self._slots()),
                180, f"Flink REST /overview on 127.0.0.1:{ports['rest']}",
            )  # fmt: skip
            timings["cluster_s"] = round(time.monotonic() - started, 1)
            _wait(
                lambda: _alive(roles) and port_open(ports["job"]),
                180, f"Beam Flink job server on 127.0.0.1:{ports['job']}",
            )  # fmt: skip
            timings["total_s"] = round(time.monotonic() - started, 1)
        except BaseException as exc:
            for pid in reversed(state.pids):
                stop_process_group(pid, timeout=10)
            if isinstance(exc, ServiceError):
                raise ServiceError(f"{exc} (logs in {self.log_dir})") from exc
            raise
        state.info = {
            "flink_home": str(self.flink_home),
            "conf_dir": str(self.conf_dir),
            "checkpoints_dir": str(self.checkpoints_dir),
            "savepoints_dir": str(self.savepoints_dir),
            "log_dir": str(self.log_dir),
            "rest_url": f"http://127.0.0.1:{ports['rest']}",
            "job_endpoint": f"127.0.0.1:{ports['job']}",
            "job_server_classpath": str(self.job_server_classpath()),
            # PROCESS environment: {"type": "PROCESS", "config": {"command": boot}} (runners/flink.py).
            "boot": str(self.boot_binary()),
            "marker_jar": str(self.marker_jar),
            "taskmanagers": self.taskmanagers,
            "roles": roles,
            "startup": timings,
            "flink_version": FLINK_VERSION,
            "beam_version": BEAM_VERSION,
        }
        return state

    def ready(self, state: ServiceState) -> bool:
        rest = FlinkRest(f"http://127.0.0.1:{state.ports['rest']}", timeout=5)
        roles = state.info.get("roles", {})
        expected = int(state.info.get("taskmanagers", 1))
        return _cluster_ready(rest, roles, expected, self._slots()) and port_open(state.ports["job"])

    # -- failure drills ---------------------------------------------------------------------------------------
    def kill(self, role: str) -> int:
        """SIGKILLs one process like a crash (its process group: a TaskManager's Python workers die with it).

        Roles: ``jobmanager``, ``taskmanager`` (the first; ``taskmanager-2`` ... the others) or ``job_server``.
        Returns the pid.
        """
        state = self._require_state()
        roles: dict[str, int] = state.info.get("roles", {})
        role = _canonical_role(role)
        if role not in roles:
            raise ServiceError(f"unknown Flink role {role!r}; known: {', '.join(roles)}")
        pid = roles[role]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        wait_until(lambda: not pid_alive(pid), 30, f"{role} pid {pid} to die")
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
        return pid

    def restart(self, role: str, wait: bool = True) -> ServiceState:
        """Starts ``role`` again on the same ports (after ``kill``); with ``wait``, until the cluster answers again."""
        state = self._require_state()
        roles: dict[str, int] = dict(state.info.get("roles", {}))
        role = _canonical_role(role)
        old = roles.get(role)
        if old is not None and pid_alive(old):
            raise ServiceError(f"{role} (pid {old}) is still running; kill it first")
        starters: dict[str, Callable[[dict[str, int]], int]] = {
            "jobmanager": self._start_jobmanager,
            "job_server": self._start_job_server,
        }
        taskmanager_index = {_taskmanager_role(i): i for i in range(1, int(state.info.get("taskmanagers", 1)) + 1)}
        for tm_role, index in taskmanager_index.items():
            starters[tm_role] = functools.partial(self._start_taskmanager, index=index)
        start = starters.get(role)
        if start is None:
            raise ServiceError(f"unknown Flink role {role!r}; known: {', '.join(starters)}")
        rest = FlinkRest(f"http://127.0.0.1:{state.ports['rest']}")
        known_taskmanagers: set[str] = set()
        if role in taskmanager_index:
            with contextlib.suppress(Exception):  # the JobManager may be down too
                known_taskmanagers = {tm["id"] for tm in rest.taskmanagers()}
        roles[role] = start(state.ports)
        state.info["roles"] = roles
        state.pids = list(roles.values())
        state.save(self.state_path)
        if wait:
            if role == "job_server":
                wait_for_port(state.ports["job"], 180, "Beam Flink job server")
            elif role in taskmanager_index:
                # The JobManager still lists the killed TaskManager until its heartbeat times out: wait for a new one.
                try:
                    _wait(
                        lambda: _alive(roles) and bool({tm["id"] for tm in rest.taskmanagers()} - known_taskmanagers),
                        180, "the restarted TaskManager to register",
                    )  # fmt: skip
                except ServiceError as exc:
                    # Its log says why (a port taken while it was down, a refused registration): keep it in the error,
                    # since later tests reuse the data folder and the log with it.
                    log = self.log_dir / f"taskmanager-{taskmanager_index[role]}.out"
                    tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
                    raise ServiceError(f"{exc}; {log.name} tail:\n{tail}") from exc
            else:
                expected = int(state.info.get("taskmanagers", 1))
                _wait(
                    lambda: _cluster_ready(rest, roles, expected, self._slots()),
                    180,
                    f"Flink cluster after restarting the {role}",
                )
        return state

    def kill_taskmanager(self) -> int:
        return self.kill("taskmanager")

    def restart_taskmanager(self, wait: bool = True) -> ServiceState:
        return self.restart("taskmanager", wait)

    def kill_jobmanager(self) -> int:
        return self.kill("jobmanager")

    def restart_jobmanager(self, wait: bool = True) -> ServiceState:
        return self.restart("jobmanager", wait)

    def _slots(self) -> int:
        return int(self.settings["taskmanager.numberOfTaskSlots"])

    def rest(self) -> FlinkRest:
        return FlinkRest(f"http://127.0.0.1:{self._require_state().ports['rest']}")

    def _require_state(self) -> ServiceState:
        state = self.state()
        if state is None or not state.ports:
            raise ServiceError(f"Flink is not running under {self.home}; start it with `beamflow services up flink`")
        return state


def compile_java(sources: Path, classpath: Path, cache_dir: Path) -> Path:
    """``javac`` of every ``.java`` under ``sources`` against ``classpath/*``; returns the class folder.

    Cached under ``<cache>/beamflow-java/<folder>-<hash>/classes``, the hash over the sources, the classpath's name and
    javac's version: an edited source or another Beam is compiled afresh, a missing folder is rebuilt.
    """
    files = sorted(sources.rglob("*.java"))
    if not files:
        raise ServiceError(f"no Java sources under {sources}")
    javac = shutil.which("javac")
    if javac is None:
        raise ServiceError("compiling beamflow's job-server launcher needs `javac` (a JDK 17, Debian's openjdk-17-jdk)")
    version = subprocess.run([javac, "-version"], capture_output=True, text=True, check=False)
    digest = hashlib.sha256((version.stdout + version.stderr + Path(classpath).name).encode())
    for path in files:
        digest.update(path.relative_to(sources).as_posix().encode() + b"\0" + path.read_bytes())
    target = cache_dir / "beamflow-java" / f"{sources.name}-{digest.hexdigest()[:16]}"
    classes = target / "classes"
    if (target / ".complete").exists() and classes.is_dir():
        return classes
    shutil.rmtree(target, ignore_errors=True)
    staging = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "classes").mkdir(parents=True)
    result = subprocess.run(
        [javac, "--release", "17", "-nowarn", "-encoding", "UTF-8", "-d", str(staging / "classes"),
         "-cp", f"{classpath}/*", *map(str, files)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise ServiceError(f"javac failed on {sources}:\n{(result.stdout + result.stderr)[-3000:]}")
    (staging / ".complete").write_text("\n".join(p.name for p in files) + "\n")
    try:
        staging.rename(target)
    except OSError:  # another process built the same hash meanwhile
        shutil.rmtree(staging, ignore_errors=True)
    return classes


def java_jar(sources: Path, classpath: Path, cache_dir: Path, name: str) -> Path:
    """``compile_java``'s classes as the jar ``name`` beside them (built once per hash)."""
    classes = compile_java(sources, classpath, cache_dir)
    jar = classes.parent / name
    if not jar.exists():
        partial = jar.with_name(f"{name}.partial-{os.getpid()}")
        with zipfile.ZipFile(partial, "w") as out:
            out.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\nCreated-By: beamflow\n")
            for path in sorted(classes.rglob("*.class")):
                out.write(path, path.relative_to(classes).as_posix())
        partial.replace(jar)
    return jar


def python_workers(flink: ServiceState, job_name: str) -> list[int]:
    """Pids of the job's Python SDK workers under this cluster's TaskManagers (PROCESS: TaskManager -> boot ->
    ``sdk_worker_main``), told apart from other jobs' by the pipeline options boot hands them (``PIPELINE_OPTIONS``)."""
    taskmanagers = {pid for role, pid in flink.info.get("roles", {}).items() if role.startswith("taskmanager")}
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if b"sdk_worker_main" not in (proc / "cmdline").read_bytes():
                continue
            if job_name.encode() not in (proc / "environ").read_bytes():
                continue
            pid = int(proc.name)
            ancestor = pid
            while ancestor > 1 and ancestor not in taskmanagers:
                ancestor = int((Path("/proc") / str(ancestor) / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ancestor in taskmanagers:
                found.append(pid)
        except (OSError, ValueError, IndexError):
            continue
    return found


def _alive(roles: dict[str, int]) -> bool:
    dead = [role for role, pid in roles.items() if not pid_alive(pid)]
    if dead:
        raise ServiceError(f"Flink {', '.join(dead)} exited")
    return True


def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Like ``wait_until``, but a ServiceError from ``check`` (a process died) ends the wait at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except ServiceError:
            raise
        except Exception as exc:  # connection refused while the JVM boots
            if time.monotonic() > deadline:
                raise ServiceError(f"timed out after {timeout:.0f}s waiting for {what}: {exc}") from exc
        if time.monotonic() > deadline:
            raise ServiceError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)


def _cluster_ready(rest: FlinkRest, roles: dict[str, int], taskmanagers: int = 1, slots: int = 1) -> bool:
    _alive(roles)
    overview = rest.overview()
    # A TaskManager is listed before its slots are: ready means every TaskManager with every slot.
    return int(overview.get("taskmanagers", 0)) >= taskmanagers and int(overview.get("slots-total", 0)) >= (
        taskmanagers * slots
    )


def _taskmanager_role(index: int) -> str:
    """``taskmanager`` for the first (the name drills and older states use), ``taskmanager-<n>`` for the others."""
    return "taskmanager" if index == 1 else f"taskmanager-{index}"


def _canonical_role(role: str) -> str:
    return "taskmanager" if role == "taskmanager-1" else role


def runner_jars(job_server_classpath: Path) -> list[Path]:
    """The job server's jars a Flink cluster lacks: all but Flink's own, RocksDB's native library and logging.

    ``FlinkService`` puts these on the cluster's classpath, so jobs need not ship them.
    """
    skip = ("flink-", "frocksdbjni-", "slf4j-", "scala-")
    return sorted(p for p in Path(job_server_classpath).glob("*.jar") if not p.name.startswith(skip))


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested YAML (Flink's standard config.yaml) to the flat ``a.b.c`` keys Flink also accepts."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat

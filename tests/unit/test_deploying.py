"""docs/deploying: the example deployment files parse, carry what the Flink Kubernetes Operator needs, agree with the
job config's flink: section, and the worker-pool sidecar's command really listens where the TaskManager looks."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from beamflow.config import load_config, load_job_config
from beamflow.doctor import RULES, Job
from runners.flink import cluster_settings, flink_flags

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DEPLOYING = ROOT / "docs" / "deploying"
DOC = ROOT / "docs" / "deploying.md"
YAML_FILES = sorted([*DEPLOYING.glob("*.yaml"), *DEPLOYING.glob("*.yml")])

# Flink settings a checkpointed, restartable deployment must spell out (docs/deploying.md, "Checkpoints ...").
CHECKPOINT_KEYS = (
    "state.backend.type",
    "state.backend.incremental",
    "state.checkpoints.dir",
    "state.savepoints.dir",
    "state.checkpoints.num-retained",
    "execution.checkpointing.externalized-checkpoint-retention",
    "execution.checkpointing.tolerable-failed-checkpoints",
    "restart-strategy.type",
    "high-availability.type",
    "high-availability.storageDir",
)


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _flink_deployments() -> dict[str, dict[str, Any]]:
    return {
        path.name: doc
        for path in YAML_FILES
        for doc in _documents(path)
        if isinstance(doc, dict) and doc.get("kind") == "FlinkDeployment"
    }


def _containers(pod_template: dict[str, Any]) -> list[dict[str, Any]]:
    return list((pod_template.get("spec") or {}).get("containers") or [])


def test_every_yaml_under_docs_deploying_parses() -> None:
    assert YAML_FILES, "docs/deploying has no YAML files"
    for path in YAML_FILES:
        documents = _documents(path)
        assert documents, f"{path.name} is empty"
        for doc in documents:
            assert isinstance(doc, dict), f"{path.name}: every document must be a mapping"


def test_flink_deployments_have_what_the_operator_requires() -> None:
    deployments = _flink_deployments()
    assert {"flink-session.yaml", "flink-session-external.yaml"} <= set(deployments)
    for name, doc in deployments.items():
        assert doc["apiVersion"] == "flink.apache.org/v1beta1", name
        assert doc["metadata"]["name"], name
        spec = doc["spec"]
        assert spec["flinkVersion"] == "v1_19", name
        assert spec["image"], name
        assert "job" not in spec, f"{name}: a session cluster has no job spec"
        assert spec.get("mode", "native") in {"native", "standalone"}, name
        config = spec["flinkConfiguration"]
        # The CRD declares flinkConfiguration as a map of string to string in every operator release with v1_19.
        for key, value in config.items():
            assert isinstance(value, str), f"{name}: flinkConfiguration[{key!r}] must be a string, got {value!r}"
        for key in CHECKPOINT_KEYS:
            assert config.get(key), f"{name}: flinkConfiguration lacks {key}"
        assert config["state.checkpoints.dir"].startswith("s3://")
        assert config["state.savepoints.dir"].startswith("s3://")
        assert config["high-availability.storageDir"].startswith("s3://")
        assert config["high-availability.type"] == "kubernetes"
        assert config["execution.checkpointing.externalized-checkpoint-retention"] == "RETAIN_ON_CANCELLATION"
        assert config["cluster.evenly-spread-out-slots"] == "true"
        assert int(config["taskmanager.numberOfTaskSlots"]) >= 1
        task_manager = spec["taskManager"]
        assert task_manager["resource"]["memory"] and task_manager["resource"]["cpu"], name
        containers = _containers(task_manager["podTemplate"])
        assert containers[0]["name"] == "flink-main-container", f"{name}: the operator's main container name"
        env = [e for c in containers for e in c.get("env", [])]
        plugins = [e.get("value", "") for e in env if e["name"] == "ENABLE_BUILT_IN_PLUGINS"]
        assert any(re.fullmatch(r"flink-s3-fs-(presto|hadoop)-1\.19\.\d+\.jar", p) for p in plugins), name


def test_external_variant_runs_the_worker_pool_as_a_taskmanager_sidecar() -> None:
    spec = _flink_deployments()["flink-session-external.yaml"]["spec"]
    containers = {c["name"]: c for c in _containers(spec["taskManager"]["podTemplate"])}
    assert "flink-main-container" in containers
    sidecars = [c for name, c in containers.items() if name != "flink-main-container"]
    assert len(sidecars) == 1
    command = [*sidecars[0].get("command", []), *sidecars[0].get("args", [])]
    assert command[:3] == ["python", "-m", "runners.worker_pool"]
    assert command[command.index("--port") + 1] == "50000"
    assert "--host" not in command, "the pool must stay on loopback: the TaskManager reaches it as localhost"
    # The PROCESS variant has no sidecar: boot runs inside the TaskManager container.
    process_spec = _flink_deployments()["flink-session.yaml"]["spec"]
    assert [c["name"] for c in _containers(process_spec["taskManager"]["podTemplate"])] == ["flink-main-container"]


def test_job_server_deployment_and_service_agree() -> None:
    docs = {doc["kind"]: doc for doc in _documents(DEPLOYING / "job-server.yaml")}
    assert {"Deployment", "Service", "PersistentVolumeClaim", "ConfigMap"} <= set(docs)
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    argv = [*container.get("command", []), *container.get("args", [])]
    # beamflow's launcher, as the local job server runs it (FlinkJobServerDriver's options; one bound address;
    # nothing shipped per job), from the jar the image builds (docs/deploying/Dockerfile).
    main_class = "beamflow.launcher.LoopbackJobServer"
    assert main_class in argv
    assert "org.apache.beam.runners.flink.FlinkJobServerDriver" not in argv
    jvm_args = argv[: argv.index(main_class)]
    classpath = jvm_args[jvm_args.index("-cp") + 1].split(":")
    dockerfile = (DEPLOYING / "Dockerfile").read_text()
    assert classpath[0] == "/opt/beam/beamflow-loopback-job-server.jar" and classpath[0] in dockerfile
    assert "/opt/flink/lib/0-beamflow-loopback-fn-servers.jar" in dockerfile
    # The SDF residual fix (apache/beam#27648): ahead of Beam's jars for the job server and the TaskManagers alike.
    fix = "/opt/flink/lib/0-beamflow-sdf-residuals.jar"
    assert f"COPY --from=java /out-sdfresiduals.jar {fix}" in dockerfile
    assert classpath.index(fix) < classpath.index("/opt/beam/job-server/*")
    bind = [a for a in jvm_args if a.startswith("-Dbeamflow.job-server.bind-address=")]
    assert bind == ["-Dbeamflow.job-server.bind-address=$(POD_IP)"], "one named address, never the wildcard"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # The driver's arguments (the JVM's module flags come before the main class).
    driver_args = argv[argv.index(main_class) + 1 :]
    flags = dict(arg.split("=", 1) for arg in driver_args)
    # FlinkJobServerDriver's own option names (its usage text in beam-runners-flink-1.19:2.62.0).
    assert set(flags) <= {
        "--flink-master", "--flink-conf-dir", "--job-host", "--job-port", "--artifact-port", "--expansion-port",
        "--artifacts-dir", "--clean-artifacts-per-job", "--history-size",
    }  # fmt: skip
    session = _flink_deployments()["flink-session.yaml"]
    assert flags["--flink-master"].split(".")[0] == f"{session['metadata']['name']}-rest"
    assert flags["--flink-master"].endswith(":8081")
    service = docs["Service"]
    assert flags["--job-host"].split(".")[0] == service["metadata"]["name"]
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert str(ports["job"]) == flags["--job-port"] and str(ports["artifact"]) == flags["--artifact-port"]
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    conf = yaml.safe_load(docs["ConfigMap"]["data"]["config.yaml"])
    assert conf["execution.checkpointing.tolerable-failed-checkpoints"] >= 1


def test_job_config_example_loads_and_its_flink_section_is_accepted() -> None:
    config = load_config(DEPLOYING / "clicks-prod.yaml")
    local = load_config(ROOT / "conf" / "clicks.yaml")
    assert set(config) == set(local), "the deployment config has the sections of conf/clicks.yaml"
    assert set(config["flink"]) <= set(local["flink"]) | {"job_name", "task_slots", "sdk_worker_parallelism"}
    assert "auto" not in yaml.safe_dump(config), "a deployment names its endpoints"
    flags = flink_flags(config["flink"])  # raises ValueError on an unknown key
    assert "--streaming" in flags
    assert "--environment_type=PROCESS" in flags
    assert "--externalized_checkpoints_enabled" in flags
    assert config["iceberg"]["catalog"]["uri"].startswith("postgresql+psycopg2://")
    assert config["iceberg"]["catalog"]["warehouse"].startswith("s3://")
    for dsn in (config["postgres"]["dsn"], config["iceberg"]["catalog"]["uri"]):
        assert ":" not in dsn.split("://", 1)[1].split("@", 1)[0], f"password in {dsn!r}; use PGPASSWORD"
    # The cluster-side half of the flink: section is what the FlinkDeployment configures.
    deployed = _flink_deployments()["flink-session.yaml"]["spec"]["flinkConfiguration"]
    for key, value in cluster_settings(config["flink"]).items():
        if key in deployed:
            assert deployed[key].lower() == str(value).lower(), f"{key}: {deployed[key]!r} != {value!r}"
    # And the EXTERNAL form the doc tells people to pass with --set is accepted too.
    external = load_config(
        DEPLOYING / "clicks-prod.yaml", ['flink.environment={type: EXTERNAL, config: "localhost:50000"}']
    )
    assert "--environment_config=localhost:50000" in flink_flags(external["flink"])


def test_doctor_finds_nothing_wrong_with_the_job_config_example() -> None:
    # The example long shipped the first wave's 100,000-element / 10 s bundles (every checkpoint stalled on a backlog),
    # a 120 s checkpoint timeout and plaintext Kafka with nothing saying so: doctor's static rules now vet it.
    config = load_job_config(DEPLOYING / "clicks-prod.yaml")
    findings = [f for rule in RULES if (f := rule(Job(config, config.kafka.partitions if config.kafka else None)))]
    assert [f"{f.severity} {f.code}" for f in findings if f.severity != "info"] == []


def test_every_secret_the_job_config_names_is_set_where_its_python_workers_run() -> None:
    references = set(re.findall(r"env:([A-Z_][A-Z0-9_]*)", (DEPLOYING / "clicks-prod.yaml").read_text()))
    assert "KAFKA_PASSWORD" in references
    for name, deployment in _flink_deployments().items():
        containers = {c["name"]: c for c in _containers(deployment["spec"]["taskManager"]["podTemplate"])}
        # PROCESS: the workers are the TaskManager's children; EXTERNAL: they run in the worker-pool sidecar.
        workers = [c for n, c in containers.items() if n != "flink-main-container"] or [
            containers["flink-main-container"]
        ]
        for container in workers:
            env = {e["name"]: e for e in container.get("env", [])}
            for reference in references | {"PGPASSWORD"}:
                assert reference in env and "secretKeyRef" in env[reference].get("valueFrom", {}), (name, reference)


def test_doc_references_every_example_file() -> None:
    text = DOC.read_text()
    for path in DEPLOYING.iterdir():
        assert f"deploying/{path.name}" in text, f"docs/deploying.md does not mention {path.name}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_sidecar_command_listens_on_loopback() -> None:
    """`python -m runners.worker_pool --port N`, as the sidecar runs it: prints its address and accepts connections."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "runners.worker_pool", "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + 60
        lines: list[str] = []
        expected = f"listening on 127.0.0.1:{port}"
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if expected in line:
                break
        assert any(expected in line for line in lines), f"no {expected!r} in: {''.join(lines)[-2000:]}"
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
        if process.stdout is not None:
            with contextlib.suppress(Exception):
                process.stdout.close()


def test_maintenance_cronjob_compacts_the_job_configs_table_sorted_by_its_key_time() -> None:
    """The CronJob's command is one ``beamflow`` accepts, on the table and catalog of ``clicks-prod.yaml``, sorted by
    the column the sink's key lookups filter on (so they stay pruned after the rewrite)."""
    from beamflow.cli import build_parser

    (cronjob,) = _documents(DEPLOYING / "iceberg-maintenance.yaml")
    assert cronjob["kind"] == "CronJob" and cronjob["spec"]["concurrencyPolicy"] == "Forbid"
    (container,) = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:3] == ["python", "-m", "beamflow"]
    args = build_parser().parse_args(command[3:])
    iceberg = load_config(DEPLOYING / "clicks-prod.yaml")["iceberg"]
    assert (args.iceberg_action, args.table) == ("compact", iceberg["table"])
    assert (args.warehouse, args.catalog_uri) == (iceberg["catalog"]["warehouse"], iceberg["catalog"]["uri"])
    assert args.sort_by == "event_time" and 'key_time_column="event_time"' in (ROOT / "pipelines/clicks.py").read_text()
    assert args.row_group_rows == 100_000
    assert {e["name"] for e in container["env"]} == {"PGPASSWORD"}

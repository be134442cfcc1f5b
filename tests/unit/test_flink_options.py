"""runners/flink.py: the flink: conf section becomes FlinkRunner pipeline options and cluster settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from runners.flink import WORKER_ENV, cluster_settings, flink_flags, flink_options

pytestmark = pytest.mark.unit

CONF = Path(__file__).resolve().parents[2] / "conf" / "flink.yaml"


def test_example_conf_maps_to_job_server_options_and_cluster_settings() -> None:
    section = yaml.safe_load(CONF.read_text())["flink"]
    # `auto` and the bare PROCESS are the local services' (resolve_auto fills them in); a deployment names them.
    assert section["job_endpoint"] == "auto" and section["environment"] == "PROCESS"
    with pytest.raises(ValueError, match="boot"):
        flink_flags(section)
    section.update(environment={"type": "PROCESS", "command": "/opt/apache/beam/boot"}, files_to_stage=["/j.jar"])
    flags = flink_flags(section)
    assert "--runner=FlinkRunner" in flags
    assert "--streaming" in flags
    assert "--checkpointing_interval=10000" in flags
    assert "--checkpoint_timeout_millis=30000" in flags
    assert "--max_bundle_size=3000" in flags and "--max_bundle_time_mills=1000" in flags
    assert "--min_pause_between_checkpoints=2000" in flags
    assert "--externalized_checkpoints_enabled" in flags
    assert "--environment_type=PROCESS" in flags
    assert '--environment_config={"command": "/opt/apache/beam/boot", "env": {"MALLOC_ARENA_MAX": "2"}}' in flags
    assert "--files_to_stage=/j.jar" in flags
    assert "--number_of_execution_retries=10" in flags
    settings = cluster_settings(section)
    assert settings["state.backend.type"] == "rocksdb"
    assert settings["state.backend.incremental"] is True
    assert settings["state.checkpoints.num-retained"] == 3
    assert settings["execution.checkpointing.tolerable-failed-checkpoints"] == 3
    assert settings["state.backend.rocksdb.options-factory"] == "beamflow.flink.BoundedManifestOptionsFactory"
    assert settings["beamflow.rocksdb.max-manifest-file-size"] == "16384 bytes"
    from beamflow.services.flink import DEFAULT_SETTINGS

    assert DEFAULT_SETTINGS["beamflow.rocksdb.max-manifest-file-size"] == "16384 bytes"  # the local cluster = the conf
    assert "state.backend.rocksdb.options-factory" not in cluster_settings(
        {**section, "rocksdb_max_manifest_bytes": None}
    )
    experiments = flink_flags({**section, "experiments": ["data_buffer_size_limit=65536", "use_runner_v2"]})
    assert [f for f in experiments if f.startswith("--experiments")] == [
        "--experiments=data_buffer_size_limit=65536",
        "--experiments=use_runner_v2",
    ]


def test_command_line_overrides_the_conf() -> None:
    options = flink_options({"parallelism": 2, "checkpointing_interval_ms": 1000}, ["--parallelism=4"])
    everything = options.get_all_options(retain_unknown_options=True)
    assert everything["parallelism"] == 4
    assert everything["checkpointing_interval"] == "1000"


def test_external_environment_needs_an_address_and_unknown_keys_are_refused() -> None:
    flags = flink_flags({"environment": {"type": "EXTERNAL", "config": "localhost:50000"}})
    assert "--environment_config=localhost:50000" in flags
    with pytest.raises(ValueError, match="host:port"):
        flink_flags({"environment": "EXTERNAL"})
    with pytest.raises(ValueError, match="checkpoint_intervall"):
        flink_flags({"checkpoint_intervall": 5})
    with pytest.raises(ValueError, match="state_backend"):
        flink_flags({"state_backend": "memory"})


def test_workers_get_the_speed_settings_plugin_unless_switched_off() -> None:
    from runners.flink import flink_flags

    for environment in ("LOOPBACK", {"type": "PROCESS", "command": "/boot"}, {"type": "EXTERNAL", "config": "h:1"}):
        assert "--beam_plugins=runners.worker_plugin" in flink_flags({"environment": environment})
        assert not [f for f in flink_flags({"environment": environment, "worker_settings": False}) if "plugin" in f]


def test_the_plugin_applies_the_worker_settings_where_beam_imports_it_and_nowhere_else() -> None:
    import json
    import subprocess
    import sys

    probe = (
        "import gc, json\n"
        "from apache_beam.runners.worker import sdk_worker_main, statesampler\n"
        "import runners.worker_settings, runners.flink, runners.direct\n"
        "before = [list(gc.get_threshold()), list(statesampler.StateSampler.__init__.__defaults__)]\n"
        "sdk_worker_main._import_beam_plugins(['runners.worker_plugin'])\n"
        "after = [list(gc.get_threshold()), list(statesampler.StateSampler.__init__.__defaults__)]\n"
        "print(json.dumps([before, after, gc.get_freeze_count() > 0]))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    before, after, frozen = json.loads(out.strip().splitlines()[-1])
    from runners.worker_settings import SAMPLING_PERIOD_MS, WORKER_GC_THRESHOLDS

    assert before == [[700, 10, 10], [200]]  # importing beamflow's runner modules changes nothing
    assert after == [list(WORKER_GC_THRESHOLDS), [SAMPLING_PERIOD_MS]]
    assert frozen


def test_root_cause_is_the_innermost_caused_by_of_a_java_trace() -> None:
    from beamflow.flink_rest import root_cause

    trace = (
        "org.apache.flink.runtime.client.JobInitializationException: Could not start the JobMaster.\n"
        "\tat org.apache.flink.runtime.jobmaster.DefaultJobMasterServiceProcess.lambda$new$0(X.java:97)\n"
        "Caused by: java.util.concurrent.CompletionException: java.lang.IllegalStateException: Failed to rollback\n"
        "\tat java.base/java.util.concurrent.CompletableFuture.encodeThrowable(CompletableFuture.java:315)\n"
        "Caused by: java.lang.IllegalStateException: Cannot map checkpoint/savepoint state for operator cbc3 to the "
        "new program\n"
        "\t... 7 more\n"
    )
    assert root_cause(trace) == (
        "java.lang.IllegalStateException: Cannot map checkpoint/savepoint state for operator cbc3 to the new program"
    )
    assert root_cause("java.lang.RuntimeException: boom\n\tat a.b(C.java:1)\n") == "java.lang.RuntimeException: boom"
    assert root_cause("") == ""


def test_a_detached_job_that_ended_as_it_started_is_a_failed_submission_with_a_hint_for_savepoints() -> None:
    from runners.flink import failed_submission

    assert failed_submission("RUNNING", "j", None) == ""
    assert failed_submission("DONE", "j", None) == ""  # a bounded job that already finished
    assert failed_submission("FAILED", "j", None) == "job j is FAILED on the Flink cluster"
    line = failed_submission("CANCELLED", "j", "http://127.0.0.1:1")  # nothing listens: the line still says why not
    assert line.startswith("job j is CANCELLED on the Flink cluster: (its reason could not be read from"), line


def test_process_workers_start_with_the_worker_env_which_the_job_can_extend_or_switch_off() -> None:
    def config_of(flags: list[str]) -> dict[str, Any]:
        return json.loads(next(f for f in flags if f.startswith("--environment_config=")).split("=", 1)[1])

    process = {"type": "PROCESS", "command": "/boot"}
    assert config_of(flink_flags({"environment": process}))["env"] == WORKER_ENV == {"MALLOC_ARENA_MAX": "2"}
    extended = flink_flags({"environment": {**process, "env": {"MALLOC_ARENA_MAX": 4, "TZ": "UTC"}}})
    assert config_of(extended)["env"] == {"MALLOC_ARENA_MAX": "4", "TZ": "UTC"}
    # worker_settings: false leaves Beam's defaults, the allocator's included.
    assert "env" not in config_of(flink_flags({"environment": process, "worker_settings": False}))
    with pytest.raises(ValueError, match="env"):
        flink_flags({"environment": {**process, "env": ["MALLOC_ARENA_MAX=2"]}})

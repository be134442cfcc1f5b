"""A detached submission whose job fails as it starts exits non-zero with Flink's reason, not 0 with "FAILED".

Seen while restoring a savepoint across a runner upgrade: Beam's job server reported FAILED, the submitter logged
"job ... is FAILED on the Flink cluster; this process may exit" and exited 0, so a deployment script would have taken
a job that never ran for a running one. Flink's reason (here the savepoint that is not there) is four causes deep in
the job's exceptions.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from beamflow.kafka.admin import create_topic
from beamflow.services import ServiceSet, ServiceState
from tests.flink.drill_support import drill_config

pytestmark = pytest.mark.flink

ROOT = Path(__file__).resolve().parents[2]


def test_a_job_that_fails_as_it_starts_fails_the_submission_with_flinks_reason(
    kafka: ServiceState,
    postgres: ServiceState,
    registry: ServiceState,
    flink: ServiceState,
    service_set: ServiceSet,
    tmp_path: Path,
) -> None:
    config = drill_config("failsub", kafka, postgres, registry, flink, service_set.data)
    create_topic(config["kafka"]["bootstrap"], config["kafka"]["topic"], int(config["kafka"]["partitions"]))
    conf = tmp_path / "job.yaml"
    conf.write_text(yaml.safe_dump(config))
    missing = f"file://{tmp_path / 'no-such-savepoint'}"
    argv = [sys.executable, "-m", "pipelines.clicks", "--runner=FlinkRunner", f"--conf={conf}"]
    done = subprocess.run(
        [*argv, f"--savepoint_path={missing}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode != 0, f"the submitter exited 0 for a job that never ran:\n{done.stderr[-2000:]}"
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"beamflow: job {config['job']['name']} is FAILED on the Flink cluster: "), last
    assert missing in last and "Cannot find checkpoint or savepoint" in last, last  # Flink's own reason, one line
    # `beamflow flink jobs` says the same under the failed job.
    listed = subprocess.run(
        [sys.executable, "-m", "beamflow", "flink", "--rest", flink.info["rest_url"], "jobs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr[-2000:]
    lines = listed.stdout.splitlines()
    row = next(i for i, line in enumerate(lines) if line.rstrip().endswith(config["job"]["name"]))
    assert " FAILED " in lines[row] and lines[row + 1].strip().startswith("failed: java.io.FileNotFoundException"), (
        listed.stdout
    )

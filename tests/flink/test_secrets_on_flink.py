"""On the Flink cluster, a referenced password is resolved only in the Python workers beside the TaskManagers.

A job writes rows to PostgreSQL as a role of the scram group (password logins over TLS only) whose DSN names a file
holding a sentinel password. The rows arrive (so the workers read the secret and logged in); while the job runs, the
sentinel is searched in what Flink and Beam keep and show: the job's configuration and plan in the web UI's REST API,
``beamflow status`` and ``beamflow flink jobs``, the JobManager's, TaskManagers' and job server's logs, the job
server's staged artifacts and the cluster's blob and temp files (raw bytes: the pickled DoFns there are compressed,
which ``tests/unit/test_secrets.py`` opens and searches).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import apache_beam as beam
import psycopg
import pytest
from apache_beam.runners.runner import PipelineState
from psycopg import sql

from beamflow.flink_rest import FlinkRest
from beamflow.postgres.table import TableSpec
from beamflow.services import ServiceSet, ServiceState
from beamflow.services.base import wait_until
from beamflow.services.postgres import SCRAM_GROUP
from runners.flink import options_for_service
from transforms import WriteToPostgres

pytestmark = pytest.mark.flink

ROOT = Path(__file__).resolve().parents[2]
SENTINEL = f"Sentinel-{uuid.uuid4().hex}-flink"


class HoldOpen(beam.DoFn):
    """Passes rows on; the first waits until the test has searched everything (or 120 s)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def process(self, row: dict[str, object]) -> Iterator[dict[str, object]]:
        Path(self.folder, "started").write_text("")
        deadline = time.monotonic() + 120
        while not Path(self.folder, "release").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        yield row


@pytest.fixture
def sentinel_role(postgres: ServiceState, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    role = f"sentinel_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres.info["dsn"], autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
                sql.Identifier(role), sql.Literal(SENTINEL), sql.Identifier(SCRAM_GROUP)
            )
        )
    secret = tmp_path / "pg-password"
    secret.write_text(SENTINEL)
    yield role, secret
    with psycopg.connect(postgres.info["dsn"], autocommit=True) as conn:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def _files_holding(folder: Path, needle: bytes) -> list[str]:
    found = []
    for path in folder.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink() and needle in path.read_bytes():
                found.append(str(path))
        except OSError:
            continue
    return found


def test_a_referenced_password_is_nowhere_in_flink(
    postgres: ServiceState,
    flink: ServiceState,
    service_set: ServiceSet,
    sentinel_role: tuple[str, Path],
    tmp_path: Path,
) -> None:
    role, secret = sentinel_role
    table = f"flink_secret_{uuid.uuid4().hex[:6]}"
    dsn = (
        f"postgresql://{role}@127.0.0.1:{postgres.ports['postgres']}/beamflow?password=file:{secret}"
        f"&sslmode=verify-full&sslrootcert={postgres.info['tls_cert']}"
    )
    gate = tmp_path / "gate"
    gate.mkdir()
    job_name = f"beamflow-secret-{uuid.uuid4().hex[:8]}"
    options = options_for_service(
        flink,
        {
            "job_name": job_name,
            "parallelism": 1,
            "checkpointing_interval_ms": 1000,
            "shutdown_sources_after_idle_ms": 1000,
        },
    )
    spec = TableSpec(table, key=("id",), columns={"id": "bigint", "name": "text"})
    pipeline = beam.Pipeline(options=options)
    rows = pipeline | beam.Create([{"id": i, "name": f"n{i}"} for i in range(5)]) | beam.ParDo(HoldOpen(str(gate)))
    _ = rows | WriteToPostgres(dsn, spec, create=True)
    result = pipeline.run()
    rest = FlinkRest(flink.info["rest_url"])
    try:
        wait_until(lambda: (gate / "started").exists(), 240, "the job's first row in a Python worker")
        job = next(j for j in rest.jobs() if j.name == job_name)
        shown = {
            "job config (web UI)": json.dumps(rest._request("GET", f"/jobs/{job.job_id}/config")),
            "job plan (web UI)": json.dumps(rest._request("GET", f"/jobs/{job.job_id}/plan")),
            "job details (web UI)": json.dumps(rest._request("GET", f"/jobs/{job.job_id}")),
        }
        env = {**os.environ, "BEAMFLOW_DATA": str(service_set.data)}
        for name, argv in (
            ("beamflow status", ["status", "--job", job_name]),
            ("beamflow flink jobs", ["flink", "jobs"]),
        ):
            done = subprocess.run(
                [sys.executable, "-m", "beamflow", *argv],
                capture_output=True,
                text=True,
                env=env,
                cwd=ROOT,
                timeout=120,
            )
            assert done.returncode == 0, (name, done.stdout, done.stderr)
            shown[name] = done.stdout + done.stderr
    finally:
        (gate / "release").write_text("")
    assert result.wait_until_finish() == PipelineState.DONE
    with psycopg.connect(postgres.info["dsn"]) as conn:
        owner = conn.execute("SELECT tableowner FROM pg_tables WHERE tablename = %s", (table,)).fetchone()
        count = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()
    assert owner == (role,) and count == (5,)  # the workers resolved the file and logged in as the sentinel role

    home = Path(flink.info["log_dir"]).parent
    needle = SENTINEL.encode()
    kept = {
        "logs (JobManager, TaskManagers, job server)": _files_holding(Path(flink.info["log_dir"]), needle),
        "job server artifacts": _files_holding(home / "artifacts", needle),
        "blob store and temp files": _files_holding(home / "tmp", needle),
    }
    leaked = [where for where, text in shown.items() if SENTINEL in text] + [w for w, files in kept.items() if files]
    assert not leaked, {**{w: shown[w] for w in shown if SENTINEL in shown[w]}, **kept}

"""A SIGKILL of ``python -m pipelines.clicks`` after its sinks hold every row and before its offset commit: the rerun
(which reads those events again, plus new ones) still leaves exactly the sessions of one run over everything.

The job runs as a real subprocess. Only in this test, a ``sitecustomize`` on its path makes the commit step wait on a
file barrier (it writes ``<barrier>.reached`` first), so the kill lands exactly between the sinks and the commit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

import pipelines.clicks as clicks
from beamflow.config import load_config, resolve_auto
from beamflow.generate import TrafficSpec, avro_click_encoder, generate_traffic, produce_traffic
from beamflow.kafka.admin import create_topic, end_offsets
from beamflow.kafka.client import open_consumer
from beamflow.kafka.record import TopicPartition
from beamflow.services import ServiceSet, ServiceState
from pipelines.clicks_demo import audit_job, continuing, expected_sessions, stored_sessions

pytestmark = pytest.mark.services

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "conf" / "clicks.yaml")

SITECUSTOMIZE = textwrap.dedent(
    """
    import os
    if os.environ.get("BEAMFLOW_TEST_COMMIT_BARRIER"):
        import pathlib
        import time

        from transforms import commit_offsets_after

        _original = commit_offsets_after._CommitFn.process

        def process(self, highest, *sinks_done):
            barrier = pathlib.Path(os.environ["BEAMFLOW_TEST_COMMIT_BARRIER"])
            pathlib.Path(str(barrier) + ".reached").write_text(repr(dict(highest)))
            while not barrier.exists():
                time.sleep(0.1)
            yield from _original(self, highest, *sinks_done)

        commit_offsets_after._CommitFn.process = process
    """
)


def _overrides(run: str, suffix: str, config: dict[str, Any]) -> list[str]:
    return [
        f"kafka.topic=clicks-{run}",
        f"kafka.group_id=clicks-{run}{suffix}",
        f"iceberg.table=beamflow.impressions_{run}{suffix}",
        f"postgres.sessions_table=sessions_{run}{suffix}",
        f"postgres.dead_letters_table=dead_{run}{suffix}",
        f"postgres.quarantine_table=quarantine_{run}{suffix}",
        f"kafka.bootstrap={config['kafka']['bootstrap']}",
        f"registry.url={config['registry']['url']}",
        f"postgres.dsn={config['postgres']['dsn']}",
        f"iceberg.catalog.uri={config['iceberg']['catalog']['uri']}",
        f"iceberg.catalog.warehouse={config['iceberg']['catalog']['warehouse']}",
    ]


def _job(overrides: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "pipelines.clicks"]
    for item in overrides:
        args += ["--set", item]
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _committed(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int | None]:
    client = open_consumer("confluent", bootstrap, group)
    try:
        return {p: client.committed(TopicPartition(topic, p)) for p in range(partitions)}
    finally:
        client.close()


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (a split run's), from ``/proc``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if ppid == pid:
                found.append(int(entry.name))
    return found


def _wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{p}").exists() and "Z" not in _state(p) for p in pids):
        assert time.monotonic() < deadline, f"the run's processes {pids} outlived the killed command"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def _sessions(dsn: str, table: str) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            sql.SQL("SELECT * FROM {} ORDER BY user_id, session_start").format(sql.Identifier(table))
        ).fetchall()


@pytest.mark.parametrize("processes", [1, 2], ids=["one-process", "split-in-two"])
def test_a_kill_between_the_sinks_and_the_commit_reruns_exactly(
    kafka: ServiceState,
    postgres: ServiceState,
    registry: ServiceState,
    service_set: ServiceSet,
    tmp_path: Path,
    processes: int,
) -> None:
    """``split-in-two``: the job and its rerun split over two processes (``kafka.local_processes``), each stopped at
    its own commit; the kill of the command kills both (they die with it), and the rerun's processes write exactly
    once what both left."""
    run = uuid.uuid4().hex[:6]
    split = [f"kafka.local_processes={processes}", "kafka.local_process_records=1"]
    base = resolve_auto(load_config(CONF, ["flink=null"]), service_set)  # the local runner's job: no Flink
    config = resolve_auto(load_config(CONF, [*_overrides(run, "", base), "flink=null"]), service_set)
    bootstrap, topic, dsn = config["kafka"]["bootstrap"], config["kafka"]["topic"], config["postgres"]["dsn"]
    create_topic(bootstrap, topic, 4)
    encoder = avro_click_encoder(config["registry"]["url"], config["registry"]["subject"])
    now = int(time.time() * 1000)
    first = generate_traffic(TrafficSpec(events=1500, users=150, start_ms=now - 3_600_000, seed=21), encoder)
    produce_traffic(bootstrap, topic, first)

    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    barrier = tmp_path / "commit-barrier"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "BEAMFLOW_TEST_COMMIT_BARRIER": str(barrier)}
    job = _job([*_overrides(run, "", base), *split], env)
    reached = Path(str(barrier) + ".reached")
    try:
        deadline = time.monotonic() + 300
        while not reached.exists():
            assert job.poll() is None, (job.stderr.read() if job.stderr else b"").decode()[-3000:]
            assert time.monotonic() < deadline, "the job never reached its commit"
            time.sleep(0.2)
        # Every sink finished (the commit step runs only then) and the group has no offsets yet: kill it here.
        assert len(stored_sessions(config)) > 0
        assert _committed(bootstrap, config["kafka"]["group_id"], topic, 4) == dict.fromkeys(range(4))
        parts = _children(job.pid)
        assert len(parts) >= 2 if processes == 2 else not parts  # two processes (and the spawner's tracker)
        job.send_signal(signal.SIGKILL)
        job.wait(30)
        _wait_gone(parts)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(30)
    assert job.returncode == -signal.SIGKILL
    assert _committed(bootstrap, config["kafka"]["group_id"], topic, 4) == dict.fromkeys(range(4))

    # More traffic, continuing the first batch's event time; the rerun reads the first batch again and the second.
    second = generate_traffic(continuing(TrafficSpec(events=1500, users=150, seed=21), first), encoder)
    produce_traffic(bootstrap, topic, second)
    rerun = _job([*_overrides(run, "", base), *split], {**os.environ, "PYTHONPATH": str(ROOT)})
    assert rerun.wait(600) == 0, (rerun.stderr.read() if rerun.stderr else b"").decode()[-3000:]

    assert _committed(bootstrap, config["kafka"]["group_id"], topic, 4) == end_offsets(bootstrap, topic)
    stored = stored_sessions(config)
    assert stored == expected_sessions([first, second], int(config["sessions"]["gap_s"]) * 1000)
    assert sum(s[5] for s in stored) == 3000  # every event counted once, though the first 1,500 were read twice
    audit = audit_job(config)
    assert audit["postgres_duplicate_ids"] == 0
    assert audit["iceberg_rows"] == audit["iceberg_distinct_ids"] == 3000

    # And row for row (offsets included) what one run over everything writes to fresh tables.
    once = resolve_auto(load_config(CONF, [*_overrides(run, "_once", base), "flink=null"]), service_set)
    clicks.run_with_config(once)
    assert _sessions(dsn, f"sessions_{run}") == _sessions(dsn, f"sessions_{run}_once")

"""Every command of the README's tables, run as a new user types it (tests/e2e/readme_commands.py reads them from the
README), against this session's real services: ``BEAMFLOW_DATA`` is the session's data folder, so ``auto`` endpoints
and the local Iceberg catalog are the fixtures'. The Flink commands run in the flink tier, on the clicks job submitted
as the README says (``python -m pipelines.clicks --runner=FlinkRunner``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from beamflow.flink_rest import TERMINAL_STATES, FlinkRest
from beamflow.services import ServiceSet, ServiceState
from tests.e2e.readme_commands import (
    FLINK_PREFIXES,
    NOT_RUN,
    ROOT,
    ReadmeCommand,
    placeholders_left,
    readme_commands,
    written_commands,
)

COMMAND_TIMEOUT_S = 600  # generous: a loaded 2-core machine; the outcome is the exit code, not the time


def _env(data: Path) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    return {**os.environ, "BEAMFLOW_DATA": str(data), "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"}


def _run(command: ReadmeCommand, data: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(command.argv),
        cwd=ROOT,
        env=_env(data),
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )


def _failure(command: ReadmeCommand, done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (done.stderr + done.stdout).splitlines() if not line.startswith("%")]
    return f"`{command.line}` (README: `{command.text}`) exited {done.returncode}:\n" + "\n".join(lines[-15:])


def _flink(command: ReadmeCommand) -> bool:
    return command.line.startswith(FLINK_PREFIXES)


@pytest.mark.unit
def test_every_readme_placeholder_has_a_value() -> None:
    commands = readme_commands()
    assert {c.line for c in commands} >= {"./run demo", "beamflow iceberg audit beamflow.impressions"}
    assert {c: placeholders_left(c) for c in commands if placeholders_left(c)} == {}
    assert set(NOT_RUN) <= set(written_commands()), "NOT_RUN names a command the README no longer has"
    # A new table row is picked up without touching the test: expanded, filled, run.
    extra = "| command | what |\n|---|---|\n| `beamflow frob expire\\|compact TABLE [--x N]` | new |\n"
    assert [c.line for c in readme_commands(extra)] == [
        "beamflow frob expire beamflow.impressions",
        "beamflow frob compact beamflow.impressions",
    ]


@pytest.mark.services
def test_readme_commands_run_as_written(
    kafka: ServiceState, postgres: ServiceState, registry: ServiceState, service_set: ServiceSet
) -> None:
    # `beamflow services up|down` of the README get a data folder of their own (inside the session's, which the
    # postgres OS user can traverse), so they neither restart nor stop the session's services.
    own = service_set.data / "readme-services"
    failures: list[str] = []
    ran: list[str] = []
    try:
        for command in readme_commands():
            if command.line in NOT_RUN or _flink(command):
                continue
            data = own if command.argv[:2] == ("beamflow", "services") else service_set.data
            done = _run(command, data)
            ran.append(command.line)
            if done.returncode != 0:
                failures.append(_failure(command, done))
            elif command.line == "./run demo":
                # The demo's summary says what it leaves running, where the data is and the one command that stops it.
                assert "demo: OK" in done.stdout
                assert f"data (topic, tables, Iceberg warehouse, service logs): {service_set.data}" in done.stdout
                assert "stop them with: BEAMFLOW_DATA=" in done.stdout and "services down kafka postgres registry" in (
                    done.stdout
                )
    finally:
        subprocess.run(["beamflow", "services", "down"], cwd=ROOT, env=_env(own), capture_output=True, check=False)
        shutil.rmtree(own, ignore_errors=True)
    assert failures == [], "\n\n".join(failures)
    assert "python -m pipelines.clicks" in ran and "beamflow services down postgres" in ran

    # A table that does not exist: one line and exit code 2, not a traceback.
    missing = _run(ReadmeCommand("", ("beamflow", "iceberg", "audit", "beamflow.no_such_table")), service_set.data)
    assert missing.returncode == 2
    assert missing.stderr.strip().count("\n") == 0 and "no table 'beamflow.no_such_table'" in missing.stderr


def _wait_for_checkpoint(rest: FlinkRest, timeout_s: float = 600.0) -> None:
    """Until the job has completed a checkpoint (a savepoint before that is declined by Flink)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        running = [j for j in rest.jobs() if j.state == "RUNNING"]
        if running and rest.checkpoints(running[0].job_id).get("counts", {}).get("completed", 0) > 0:
            return
        time.sleep(1.0)
    raise AssertionError(f"no completed checkpoint within {timeout_s:.0f}s")


@pytest.mark.flink
def test_readme_flink_commands_run_as_written(
    kafka: ServiceState, postgres: ServiceState, registry: ServiceState, flink: ServiceState, service_set: ServiceSet
) -> None:
    data = service_set.data
    rest = FlinkRest(f"http://127.0.0.1:{flink.ports['rest']}")
    # Traffic on the conf's topic, then the job as "Running on Flink" submits it (detached: returns once it runs).
    submit = "python -m pipelines.clicks --runner=FlinkRunner"
    steps = [
        ReadmeCommand("beamflow generate --events N ...", ("beamflow", "generate", "--events", "300")),
        ReadmeCommand(submit, tuple(submit.split())),
    ]
    try:
        for command in steps:
            done = _run(command, data)
            assert done.returncode == 0, _failure(command, done)
        _wait_for_checkpoint(rest)
        failures = []
        # In README order, except that the job is cancelled last (`beamflow status` needs it running).
        flink_commands = sorted(
            filter(_flink, readme_commands()), key=lambda c: c.argv[:3] == ("beamflow", "flink", "cancel")
        )
        for command in flink_commands:
            done = _run(command, data)
            if done.returncode != 0:
                failures.append(_failure(command, done))
        assert failures == [], "\n\n".join(failures)
        deadline = time.monotonic() + 300
        while any(job.state not in TERMINAL_STATES for job in rest.jobs()):  # `beamflow flink cancel` ends it
            assert time.monotonic() < deadline, f"jobs still running after the cancel: {rest.jobs()}"
            time.sleep(1.0)
    finally:
        for job in rest.jobs():
            if job.state not in TERMINAL_STATES:
                rest.cancel(job.job_id)

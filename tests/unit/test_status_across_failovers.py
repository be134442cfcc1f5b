"""``beamflow status`` across failovers: sink figures cover every attempt, Beam counters are labelled current-attempt
only; ``beamflow flink savepoint --drain`` refuses in one line with the reason (no services)."""

from __future__ import annotations

import contextlib
import io

import pytest

from beamflow.cli import main as cli_main
from beamflow.cli.flink import DRAIN_REFUSED
from beamflow.cli.status import JobStatus, format_status

pytestmark = pytest.mark.unit


def _status(sinks: dict[str, int] | None, restored: int) -> JobStatus:
    return JobStatus(
        job_id="abc",
        name="clicks",
        state="RUNNING",
        metrics={"beamflow_kafka_records_read": 120.0},
        checkpoints={"completed": 3, "failed": 0, "in_progress": 0, "restored": restored},
        sink_totals=sinks,
    )


def test_sink_totals_are_shown_as_all_attempts_and_beam_counters_as_the_current_attempt() -> None:
    text = format_status(
        _status({"kafka_committed": 1300, "iceberg_rows": 1180, "quarantined": 60, "dead_letters": 10}, restored=3)
    )
    lines = text.splitlines()
    since = next(i for i, line in enumerate(lines) if line.startswith("SINCE THE JOB STARTED"))
    current = next(i for i, line in enumerate(lines) if line.startswith("CURRENT ATTEMPT ONLY"))
    assert "all attempts" in lines[since] and "3 restores so far" in lines[current]
    # The sink figures sit under the all-attempts heading, the Beam counter under the current-attempt one.
    assert since < next(i for i, line in enumerate(lines) if "rows in the Iceberg table" in line) < current
    assert current < next(i for i, line in enumerate(lines) if "records read from Kafka" in line)
    assert "1,180" in text and "1,300" in text
    assert "rows in the sessions table" in text and "n/a" in text  # a sink not (yet) there is shown as unknown


def test_without_a_config_only_the_current_attempt_is_shown() -> None:
    text = format_status(_status(None, restored=1))
    assert "SINCE THE JOB STARTED" not in text and "1 restore so far" in text


def test_savepoint_drain_refuses_in_one_line_with_the_reason() -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        # An address nothing listens on: the refusal must not depend on (or wait for) a cluster.
        code = cli_main(["flink", "--rest", "http://127.0.0.1:9", "savepoint", "job-id", "--stop", "--drain"])
    assert code == 2
    assert err.getvalue().strip() == f"error: {DRAIN_REFUSED}"
    assert "\n" not in DRAIN_REFUSED and "--stop" in DRAIN_REFUSED

"""Issue 8's failure drills: the clicks job streaming on the real local Flink cluster, disrupted mid-stream, audited.

Two jobs carry all drills (submissions cost 30-40 s each on 2 cores, so assertions share them):

* ``live_drill``: one job; its TaskManager SIGKILLed mid-stream (Flink restarts it from the last checkpoint); later the
  Kafka broker restarted; then a second, zombie instance of the same job started against the same topic, group and
  sinks and left running to the end. ``beamflow status`` is read from the running job in between.
* ``restore_drill``: the JobManager SIGKILLed mid-stream and restarted (no HA: the job is gone), the job resubmitted
  from its newest retained checkpoint (seed 003's failover path); later stopped with a savepoint while the producer has
  switched to schema v2, and restored from it with a changed configuration.

Each drill produces generated traffic (duplicate sends and undecodable records included) while the job runs, samples
the group's committed offsets against what the sinks hold, and at the end audits that every record is in exactly the
sink it belongs to, exactly once: unique events in Iceberg (distinct ids == produced events, no duplicate id, no file
referenced twice), duplicate sends in the quarantine table, bad records in the dead-letter table.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from beamflow.cli import main as cli_main
from beamflow.cli.status import JobStatus, collect_status, format_status
from beamflow.flink_rest import FlinkRestError
from beamflow.generate import GeneratedTraffic
from beamflow.kafka.admin import create_topic
from beamflow.services import ServiceSet, ServiceState
from beamflow.services.flink import FlinkService
from tests.flink.drill_support import (
    DrillJob,
    OffsetSample,
    OffsetSampler,
    TrafficFeeder,
    check_exactly_once,
    drill_config,
    latest_retained_checkpoint,
    sink_counts,
    taskmanager_role_running,
    traffic_for,
    wait_for_sinks,
)

# In the default run. `./run test -m drills` runs only the drills.
pytestmark = [pytest.mark.flink, pytest.mark.drills]

EVENTS = 1200
# The Beam metrics the status test reads; each appears once its stage has processed a record in the current attempt.
STATUS_METRICS = {
    "beamflow_kafka_records_read",
    "beamflow_deduplicate_unique",
    "beamflow_deduplicate_duplicates",
    "beamflow_kafka_late_records",
}


@dataclass
class DrillResult:
    config: dict[str, Any]
    traffic: GeneratedTraffic
    problems: list[str]
    samples: list[OffsetSample]
    timings: dict[str, float] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    status: JobStatus | None = None
    status_text: str = ""


def _wait_sent(feeder: TrafficFeeder, share: float, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while feeder.sent < share * len(feeder.records):
        assert feeder.error is None, feeder.error
        assert time.monotonic() < deadline, f"producer stuck at {feeder.sent}"
        time.sleep(0.5)


def _wait_sinks_grow(config: dict[str, Any], than: int, job: DrillJob, timeout: float = 240) -> dict[str, int]:
    """Waits until Iceberg holds more than ``than`` events: the job really processes before it is disrupted."""
    deadline = time.monotonic() + timeout
    while True:
        counts = sink_counts(config)
        if counts["iceberg_distinct_ids"] > than:
            return counts
        if time.monotonic() > deadline:
            raise AssertionError(f"the job processed nothing new in {timeout}s: {counts}\n{job.diagnosis()}")
        time.sleep(2)


def _running_with_new_checkpoint(job: DrillJob, timeout: float = 240) -> None:
    assert job.job_id
    job.rest.wait_for_state(job.job_id, {"RUNNING"}, timeout)
    job.wait_for_checkpoints(1, timeout)


@dataclass(frozen=True)
class DrillServices:
    kafka: ServiceState
    postgres: ServiceState
    registry: ServiceState
    flink: ServiceState
    service_set: ServiceSet

    @property
    def flink_service(self) -> FlinkService:
        service: FlinkService = self.service_set.get("flink")  # type: ignore[assignment]
        return service


@pytest.fixture(scope="module")
def drill_services(
    kafka: ServiceState, postgres: ServiceState, registry: ServiceState, flink: ServiceState, service_set: ServiceSet
) -> DrillServices:
    return DrillServices(kafka, postgres, registry, flink, service_set)


@dataclass
class Drill:
    """One drill's parts: its config and generated traffic, the producer thread, the offset sampler, its records."""

    config: dict[str, Any]
    traffic: GeneratedTraffic
    work: Path
    feeder: TrafficFeeder
    sampler: OffsetSampler
    t0: float = field(default_factory=time.monotonic)
    timings: dict[str, float] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def start(self, job: DrillJob, checkpoints: int) -> None:
        """Submits the first job; traffic starts only once it checkpointed, so a slow start cannot let the job take
        all of it at once (every disruption must fall mid-stream)."""
        job.start()
        self.timings["submit_s"] = round(job.submitted_s, 1)
        self.sampler.start()
        job.wait_for_checkpoints(checkpoints, 180)
        self.feeder.start()


def _new_drill(
    name: str,
    services: DrillServices,
    tmp_path_factory: pytest.TempPathFactory,
    seed: int,
    v2_from: float | None = None,
) -> Drill:
    config = drill_config(
        name, services.kafka, services.postgres, services.registry, services.flink, services.service_set.data
    )
    traffic = traffic_for(config, EVENTS, seed=seed, v2_from=v2_from)
    create_topic(config["kafka"]["bootstrap"], config["kafka"]["topic"], int(config["kafka"]["partitions"]))
    feeder = TrafficFeeder(config, traffic.records, chunks=12, pause_s=3)
    return Drill(config, traffic, tmp_path_factory.mktemp(f"{name}-drill"), feeder, OffsetSampler(config))


def _restored(config: dict[str, Any], work: Path, label: str, path: str, jobs: list[DrillJob]) -> DrillJob:
    """Submits the job restored from a checkpoint or savepoint ``path``; returns once it runs and checkpointed."""
    job = DrillJob(config, work, label, (f"--savepoint_path={path}",))
    jobs.append(job)  # cancelled by the fixture even if the start fails
    job.start()
    _running_with_new_checkpoint(job)
    return job


def _finish(drill: Drill, jobs: list[DrillJob]) -> DrillResult:
    config, traffic, feeder, t0, result_timings = drill.config, drill.traffic, drill.feeder, drill.t0, drill.timings
    feeder.join(300)
    assert feeder.error is None and feeder.sent == len(traffic.records), feeder.error
    result_timings["produced_s"] = round(time.monotonic() - t0, 1)
    counts = wait_for_sinks(config, traffic, timeout=120)
    result_timings["sinks_settled_s"] = round(time.monotonic() - t0, 1)
    samples = drill.sampler.finish()
    notes: dict[str, Any] = {"counts_while_running": counts}
    # End the drill the way an operator ends a streaming job: stop with a draining savepoint (the watermark goes to
    # the end of time, so staged batches and windows flush), then audit. Cancel only if the stop fails.
    for job in jobs:
        assert job.job_id
        try:
            job.rest.stop_with_savepoint(job.job_id, drain=True, timeout=120)
            notes[f"{job.job_name}_stop"] = "drained"
        except FlinkRestError as exc:
            notes[f"{job.job_name}_stop"] = f"drain failed, cancelled: {str(exc)[:200]}"
        job.cancel()
    result_timings["stopped_s"] = round(time.monotonic() - t0, 1)
    problems = check_exactly_once(config, traffic)
    return DrillResult(config, traffic, problems, samples, result_timings, notes)


@pytest.fixture(scope="module")
def live_drill(drill_services: DrillServices, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DrillResult]:
    drill = _new_drill("live", drill_services, tmp_path_factory, seed=21)
    config, work, feeder, timings, notes = drill.config, drill.work, drill.feeder, drill.timings, drill.notes
    flink_service = drill_services.flink_service
    main = DrillJob(config, work, "main")
    zombie = DrillJob(config, work, "zombie")
    try:
        drill.start(main, checkpoints=1)

        # Drill 1: TaskManager SIGKILLed mid-stream; Flink restarts the job from its last checkpoint.
        # The producer holds still until the job has shown it processes and is back from the failure, so the
        # disruption always falls mid-stream, however slowly a loaded machine starts the job.
        _wait_sent(feeder, 0.3)
        feeder.pause()
        notes["before_tm_kill"] = _wait_sinks_grow(config, 0, main)
        started = time.monotonic()
        assert main.job_id
        role = taskmanager_role_running(main.rest, main.job_id)
        notes["killed"] = role
        flink_service.kill(role)  # its Python workers (PROCESS) or the slot's tasks (LOOPBACK) die with it
        flink_service.restart(role)
        _running_with_new_checkpoint(main)
        timings["taskmanager_recovery_s"] = round(time.monotonic() - started, 1)
        feeder.resume()

        # beamflow status against the running job.
        main_id = main.job_id
        assert main_id
        # Flink's operator metrics restart with each task attempt: wait until the restarted stages reported again.
        deadline = time.monotonic() + 120
        status = collect_status(main.rest, main_id, config)
        while not STATUS_METRICS.issubset(status.metrics) and time.monotonic() < deadline:
            time.sleep(3)
            status = collect_status(main.rest, main_id, config)
        status_text = format_status(status)
        conf_path = work / "status.yaml"
        conf_path.write_text(yaml.safe_dump(config))
        with contextlib.redirect_stdout(io.StringIO()) as out:
            exit_code = cli_main(
                ["status", "--rest", drill_services.flink.info["rest_url"], "--job", main_id, f"--conf={conf_path}"]
            )
        notes["status_cli"] = (exit_code, out.getvalue())

        # Drill 2: the broker restarted mid-stream (same port, same log dirs).
        _wait_sent(feeder, 0.55)
        notes["before_broker_restart"] = sink_counts(config)
        started = time.monotonic()
        kafka_service = drill_services.service_set.get("kafka")
        kafka_service.down()
        kafka_service.up()
        _running_with_new_checkpoint(main)
        timings["broker_restart_recovery_s"] = round(time.monotonic() - started, 1)

        # Drill 3: a zombie instance of the same job (same topic, group, sink ids) runs alongside until the end.
        started = time.monotonic()
        zombie.start()
        timings["zombie_submit_s"] = round(time.monotonic() - started, 1)
        notes["zombie_started_at_sent"] = feeder.sent

        result = _finish(drill, [main, zombie])
        result.notes.update(notes)
        result.notes["main_restarts"] = status.checkpoints.get("restored")
        result.status, result.status_text = status, status_text
        timings["total_s"] = round(time.monotonic() - drill.t0, 1)
        print(f"\nlive drill timings {timings}\nnotes {result.notes}\n{status_text}")
        yield result
    finally:
        feeder.resume()
        for job in (main, zombie):
            with contextlib.suppress(Exception):
                job.cancel()


@pytest.fixture(scope="module")
def restore_drill(drill_services: DrillServices, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DrillResult]:
    # The producer switches to schema v2 half-way: between the JobManager drill and the savepoint drill.
    drill = _new_drill("restore", drill_services, tmp_path_factory, seed=22, v2_from=0.5)
    config, work, feeder, timings, notes = drill.config, drill.work, drill.feeder, drill.timings, drill.notes
    flink_service = drill_services.flink_service
    checkpoints_dir = Path(drill_services.flink.info["checkpoints_dir"])
    first = DrillJob(config, work, "first")
    jobs = [first]
    try:
        drill.start(first, checkpoints=2)

        # Drill 4: JobManager SIGKILLed; without HA the restarted JobManager knows no job: resubmit from the newest
        # retained checkpoint (seed 003's failover path).
        _wait_sent(feeder, 0.3)
        feeder.pause()  # see the live drill: the failure falls mid-stream
        notes["before_jm_kill"] = _wait_sinks_grow(config, 0, first)
        started = time.monotonic()
        assert first.job_id
        flink_service.kill_jobmanager()
        first.reap(timeout=5)
        checkpoint = latest_retained_checkpoint(checkpoints_dir, first.job_id)
        notes["restored_checkpoint"] = checkpoint
        flink_service.restart_jobmanager()
        rest = first.rest
        deadline = time.monotonic() + 120  # the TaskManager frees the old job's slots once it notices
        while True:
            overview = rest.overview()
            if overview.get("slots-available") == overview.get("slots-total") and overview.get("taskmanagers"):
                break
            assert time.monotonic() < deadline, overview
            time.sleep(1)
        second = _restored(config, work, "second", checkpoint, jobs)
        timings["jobmanager_restore_s"] = round(time.monotonic() - started, 1)
        feeder.resume()
        assert second.job_id
        notes["second_restored_from"] = second.rest.checkpoints(second.job_id).get("latest", {}).get("restored")

        # Drill 5: stop with a savepoint after the producer switched to schema v2; restore with a changed config.
        _wait_sent(feeder, 0.6)
        feeder.pause()
        notes["before_savepoint"] = _wait_sinks_grow(config, notes["before_jm_kill"]["iceberg_distinct_ids"], second)
        started = time.monotonic()
        try:
            savepoint = second.rest.stop_with_savepoint(second.job_id, timeout=180)
            notes["stop_mode"] = "stop-with-savepoint"
        except FlinkRestError as exc:
            notes["stop_with_savepoint_error"] = str(exc)[:300]
            trigger = second.rest.trigger_savepoint(second.job_id, cancel_job=True)
            savepoint = second.rest.wait_for_savepoint(second.job_id, trigger, timeout=180)
            notes["stop_mode"] = "savepoint-and-cancel"
        notes["savepoint"] = savepoint
        second.reap(timeout=60)
        changed = {**config, "flink": {**config["flink"], "max_bundle_time_ms": 2000}}
        third = _restored(changed, work, "third", savepoint, jobs)
        timings["savepoint_restore_s"] = round(time.monotonic() - started, 1)
        feeder.resume()

        result = _finish(drill, [third])
        result.notes.update(notes)
        timings["total_s"] = round(time.monotonic() - drill.t0, 1)
        print(f"\nrestore drill timings {timings}\nnotes {result.notes}")
        yield result
    finally:
        feeder.resume()
        for job in jobs:
            with contextlib.suppress(Exception):
                job.cancel()


def test_jobmanager_failover_and_savepoint_with_schema_v2_leave_every_record_exactly_once(
    restore_drill: DrillResult,
) -> None:
    assert restore_drill.problems == []
    assert restore_drill.traffic.counts["events_v2"] > 0
    assert restore_drill.notes["restored_checkpoint"].rsplit("/", 1)[-1].startswith("chk-")


def test_taskmanager_kill_broker_restart_and_zombie_leave_every_record_exactly_once(live_drill: DrillResult) -> None:
    assert live_drill.problems == []
    assert live_drill.traffic.counts["duplicate_sends"] > 0 and live_drill.traffic.counts["bad_records"] == 10


def test_committed_offsets_never_run_ahead_of_the_sinks(live_drill: DrillResult, restore_drill: DrillResult) -> None:
    for drill in (live_drill, restore_drill):
        final = drill.samples[-1]
        assert final.committed, "nothing was ever committed to the group"
        # Every sample, taken while the job ran and was disrupted: offsets first, then (strictly after) the sinks.
        assert len(drill.samples) >= 20
        assert [s for s in drill.samples if s.ahead()] == []


def test_status_shows_beam_metrics_and_checkpoints_of_a_running_job(live_drill: DrillResult) -> None:
    status = live_drill.status
    assert status is not None and status.state == "RUNNING"
    assert status.metrics["beamflow_kafka_records_read"] > 0
    assert status.metrics["beamflow_deduplicate_unique"] > 0
    assert "beamflow_deduplicate_duplicates" in status.metrics
    assert "beamflow_kafka_late_records" in status.metrics
    assert status.checkpoints["completed"] >= 1 and status.checkpoints["restored"] >= 1  # after the TaskManager kill
    assert status.kafka_lag is not None and set(status.kafka_lag) == {0, 1}
    assert status.iceberg_commits
    exit_code, printed = live_drill.notes["status_cli"]
    assert exit_code == 0
    for label in ("records read from Kafka", "duplicates quarantined", "checkpoints completed", "Kafka lag", "Iceberg"):
        assert label in live_drill.status_text
        assert label in printed

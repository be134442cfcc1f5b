"""Issue 8's failure drills: the clicks job streaming on the real local Flink cluster, disrupted mid-stream, audited.

Two jobs carry all drills (submissions cost 30-40 s each on 2 cores, so assertions share them):

* ``live_drill``: one job; its TaskManager SIGKILLed mid-stream (Flink restarts it from the last checkpoint); later the
  Kafka broker restarted; then a second, zombie instance of the same job started against the same topic, group and
  sinks and left running to the end. ``beamflow status`` is read from the running job in between.
* ``restore_drill``: the JobManager SIGKILLed mid-stream and restarted (no HA: the job is gone), the job resubmitted
  from its newest retained checkpoint (seed 003's failover path); later stopped with a savepoint while the producer has
  switched to schema v2, and restored from it with a changed configuration, at parallelism 1 instead of 2 and with
  the sessions' keyed route, which the first two jobs ran without (the upgrade of a job started before the route).

Each drill produces generated traffic (duplicate sends and undecodable records included) while the job runs, samples
the group's committed offsets against what the sinks hold, and at the end audits that every record is in exactly the
sink it belongs to, exactly once: unique events in Iceberg (distinct ids == produced events, no duplicate id, no file
referenced twice), duplicate sends in the quarantine table, bad records in the dead-letter table.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from beamflow.cli import main as cli_main
from beamflow.cli.status import JobStatus, collect_status, committed_records, format_status
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
    partition_owners,
    python_workers,
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


def _with_parallelism(config: dict[str, Any], parallelism: int) -> dict[str, Any]:
    return {**config, "flink": {**config["flink"], "parallelism": parallelism}}


def _without_route(config: dict[str, Any]) -> dict[str, Any]:
    """The job graph of a job started before ``sessions.route_by_user`` existed (the sessions fused into the big
    stage, no keyed route): the restore drill upgrades such a job to the routed one through its savepoint."""
    return {**config, "sessions": {**config["sessions"], "route_by_user": False}}


def _routed_sessions(job: DrillJob) -> bool:
    """Whether the running job has the sessions' own keyed stage (the route) rather than sessions in the big stage."""
    assert job.job_id
    names = [str(v.get("name", "")) for v in job.rest.job(job.job_id).get("vertices", [])]
    return any("SessionAggregates" in n and "DecodeAvro" not in n for n in names)


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
    # The sinks hold every record by now (each sink commits per bundle); cancel, then audit. A draining stop would
    # be the operator's way to flush windows, but Beam 2.62 cannot drain a streaming read (DRAIN_REFUSED; the fault
    # drill shows it still fails), and the restore drill covers stop-with-savepoint.
    for job in jobs:
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
    # The first job runs at parallelism 1 and its checkpoint is restored at 2 (scaling out after an outage), whose
    # savepoint is then restored at 1 again: both directions of a rescale, each audited record by record.
    # The first two jobs run the job graph from before the sessions' route; the savepoint is restored into the
    # routed one: the upgrade a running job takes (docs/deploying.md).
    first = DrillJob(_with_parallelism(_without_route(config), 1), work, "first")
    jobs = [first]
    try:
        drill.start(first, checkpoints=2)
        notes["first_parallelism"] = first.parallelism

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
        second = _restored(_without_route(config), work, "second", checkpoint, jobs)
        timings["jobmanager_restore_s"] = round(time.monotonic() - started, 1)
        feeder.resume()
        assert second.job_id
        notes["second_restored_from"] = second.rest.checkpoints(second.job_id).get("latest", {}).get("restored")
        notes["second_parallelism"] = second.parallelism
        notes["second_routed"] = _routed_sessions(second)

        # Drill 5: stop with a savepoint after the producer switched to schema v2; restore with a changed config.
        _wait_sent(feeder, 0.6)
        feeder.pause()
        notes["before_savepoint"] = _wait_sinks_grow(config, notes["before_jm_kill"]["iceberg_distinct_ids"], second)
        # Who read which partition after scaling out (the read's per-subtask counters).
        kafka = config["kafka"]
        notes["second_partition_owners"] = partition_owners(
            second.rest, second.job_id, kafka["topic"], int(kafka["partitions"]), timeout=60
        )
        # The read's counters start over with every attempt, so a job that failed and restarted shows only its last
        # attempt's readers: its failures are part of the evidence (a second reader of a partition made the job
        # fail again and again, on duplicate events in a session, when the restored watcher handed partitions out
        # twice).
        notes["second_failures"] = [
            str(e.get("exceptionName", ""))[:200] for e in second.rest.failure_history(second.job_id)
        ]
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
        # Changed: the bundle time, the parallelism from 2 to 1, and the sessions routed (the config's default).
        # Across 1 the read's Impulse used to get another operator id (Beam gives it no uid, and Flink chains it
        # only at 1), so Flink refused this savepoint; the runner patch (beam_patches.IMPULSE_ID_PATCHES) keeps its
        # id. The route adds an operator and renames the fused stage before it, which holds no keyed state.
        changed = _with_parallelism({**config, "flink": {**config["flink"], "max_bundle_time_ms": 2000}}, 1)
        third = _restored(changed, work, "third", savepoint, jobs)
        notes["third_parallelism"] = third.parallelism
        notes["third_routed"] = _routed_sessions(third)
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


def _recovered(job: DrillJob, config: dict[str, Any], before: int, timeout: float = 300) -> None:
    """Back from a fault: RUNNING, a checkpoint completed after it, and the sinks hold more than ``before``."""
    _running_with_new_checkpoint(job, timeout)
    _wait_sinks_grow(config, before, job, timeout)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    os.killpg(os.getpgid(pid), sig)


def _sampled_variant(
    name: str, services: DrillServices, tmp_path_factory: pytest.TempPathFactory, seed: int, module: str
) -> tuple[Drill, DrillJob]:
    """A variant of the clicks job at parallelism 1 (two of them fit the slots the parallelism-2 job leaves), its
    traffic flowing steadily (a commit runs ahead only while records are in flight), sampled every 0.5 s."""
    variant = _new_drill(name, services, tmp_path_factory, seed=seed)
    variant.config["flink"]["parallelism"] = 1
    variant.feeder = TrafficFeeder(variant.config, variant.traffic.records, chunks=120, pause_s=0.5)
    variant.sampler = OffsetSampler(variant.config, interval_s=0.5)
    return variant, DrillJob(variant.config, variant.work, name, module=module)


@pytest.fixture(scope="module")
def fault_drill(
    drill_services: DrillServices, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[DrillResult, DrillResult, DrillResult]]:
    """One job through three faults in sequence (a Python SDK worker SIGKILLed mid-bundle, the broker SIGSTOPped
    for 30 s, PostgreSQL restarted), and beside it two variants through the same faults, sampled six times as often:
    the broken one (``tests.flink.broken_clicks``: commits as it reads, slow sink), whose holdings check must fail,
    and its control (``tests.flink.slow_sink_clicks``: the same slow sink, the correct read), whose check must pass."""
    drill = _new_drill("faults", drill_services, tmp_path_factory, seed=23)
    broken, broken_job = _sampled_variant("broken", drill_services, tmp_path_factory, 24, "tests.flink.broken_clicks")
    control, control_job = _sampled_variant(
        "control", drill_services, tmp_path_factory, 25, "tests.flink.slow_sink_clicks"
    )
    config, work, feeder, timings, notes = drill.config, drill.work, drill.feeder, drill.timings, drill.notes
    flink_service = drill_services.flink_service
    main = DrillJob(config, work, "main")
    kafka_pid = drill_services.service_set.get("kafka").state().pids[0]  # type: ignore[union-attr]
    feeder.hold_at(0.25, 0.5, 0.75)  # each fault strikes at a hold and traffic resumes after it
    try:
        with ThreadPoolExecutor(3) as pool:  # the submissions at once: each costs 30-40 s on 2 cores
            variants_started = [pool.submit(v.start, j, 1) for v, j in ((broken, broken_job), (control, control_job))]
            drill.start(main, checkpoints=1)
            for started_variant in variants_started:
                started_variant.result()

        # Fault 1: one Python SDK worker of the job SIGKILLed while records flow; its TaskManager lives.
        feeder.wait_held()
        notes["before_worker_kill"] = _wait_sinks_grow(config, 0, main)
        workers = python_workers(flink_service.state(), main.job_name)  # type: ignore[arg-type]
        assert workers, f"no Python SDK worker of {main.job_name} found under the TaskManagers"
        variant_workers = {
            j.job_name: python_workers(flink_service.state(), j.job_name)  # type: ignore[arg-type]
            for j in (broken_job, control_job)
        }
        notes["python_workers"] = {"main": workers, **variant_workers}
        started = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        for pids in variant_workers.values():
            if pids:
                os.kill(pids[0], signal.SIGKILL)
        feeder.resume()
        _recovered(main, config, notes["before_worker_kill"]["iceberg_distinct_ids"])
        timings["python_worker_recovery_s"] = round(time.monotonic() - started, 1)
        notes["restores_after_worker_kill"] = main.rest.checkpoints(str(main.job_id)).get("counts", {}).get("restored")

        # beamflow status after the failover: sink figures since the start, Beam counters of this attempt. Offsets
        # are committed one completed checkpoint after the sinks hold the records, and on a loaded machine the first
        # commit may come after the restore: wait for it (event-driven), so the figure shown is a real one.
        deadline = time.monotonic() + 300
        while committed_records(config) == 0:
            assert time.monotonic() < deadline, "nothing committed to the group 300 s after the worker kill"
            time.sleep(2)
        status = collect_status(main.rest, str(main.job_id), config)
        notes["status_after_failover"] = {"sinks": status.sink_totals, "counters": status.metrics}
        notes["sinks_at_status"] = sink_counts(config)
        status_text = format_status(status)

        # Fault 2: the broker hangs (SIGSTOP) for 30 s, then continues; the producer keeps trying meanwhile.
        feeder.wait_held()
        notes["before_broker_stop"] = sink_counts(config)
        started = time.monotonic()
        _signal_group(kafka_pid, signal.SIGSTOP)
        feeder.resume()
        try:
            time.sleep(30)  # the fault's length, not a wait for an outcome
        finally:
            _signal_group(kafka_pid, signal.SIGCONT)
        resumed = time.monotonic()
        _recovered(main, config, notes["before_broker_stop"]["iceberg_distinct_ids"])
        timings["broker_stop_recovery_after_cont_s"] = round(time.monotonic() - resumed, 1)
        timings["broker_stop_total_s"] = round(time.monotonic() - started, 1)

        # Fault 3: PostgreSQL (dedup store, quarantine, sessions, dead letters) restarted mid-stream.
        feeder.wait_held()
        notes["before_postgres_restart"] = sink_counts(config)
        started = time.monotonic()
        drill_services.service_set.get("postgres").restart()  # type: ignore[attr-defined]
        timings["postgres_down_s"] = round(time.monotonic() - started, 1)
        feeder.resume()
        _recovered(main, config, notes["before_postgres_restart"]["iceberg_distinct_ids"])
        timings["postgres_recovery_s"] = round(time.monotonic() - started, 1)
        notes["restores"] = main.rest.checkpoints(str(main.job_id)).get("counts", {}).get("restored")

        # The control: its traffic done and in its sinks, its samples taken, then the record-by-record audit.
        control.feeder.join(300)
        assert control.feeder.error is None and control.feeder.sent == len(control.traffic.records)
        wait_for_sinks(control.config, control.traffic, timeout=120)
        control_samples = control.sampler.finish()
        control_job.cancel()
        control_result = DrillResult(
            control.config, control.traffic, check_exactly_once(control.config, control.traffic), control_samples
        )

        # The broken variant: its traffic done, its samples taken; then a draining stop, to show why it is refused.
        broken.feeder.join(300)
        broken_samples = broken.sampler.finish()
        assert broken_job.job_id
        started = time.monotonic()
        try:
            broken_job.rest.stop_with_savepoint(broken_job.job_id, drain=True, timeout=120)
            notes["drain"] = "drained"
        except FlinkRestError as exc:
            notes["drain"] = str(exc)[:400]
        timings["drain_attempt_s"] = round(time.monotonic() - started, 1)
        notes["drain_taskmanager_log"] = _taskmanager_log_lines(
            Path(drill_services.flink.info["conf_dir"]).parent, ("watermark hold", "processing-time timers")
        )
        broken_job.cancel()
        broken_result = DrillResult(broken.config, broken.traffic, [], broken_samples)

        result = _finish(drill, [main])
        result.notes.update(notes)
        result.status, result.status_text = status, status_text
        timings["total_s"] = round(time.monotonic() - drill.t0, 1)
        ahead = [s for s in broken_samples if s.ahead()]
        control_ahead = [s for s in control_samples if s.ahead()]
        print(
            f"\nfault drill timings {timings}\nnotes {result.notes}\n{status_text}\n"
            f"broken variant: {len(ahead)} of {len(broken_samples)} samples ahead, e.g. {ahead[:3]}\n"
            f"control (slow sink, correct read): {len(control_ahead)} of {len(control_samples)} samples ahead, "
            f"audit problems {control_result.problems}"
        )
        yield result, broken_result, control_result
    finally:
        feeder.resume()
        with contextlib.suppress(Exception):
            _signal_group(kafka_pid, signal.SIGCONT)
        for job in (main, broken_job, control_job):
            with contextlib.suppress(Exception):
                job.cancel()


def _taskmanager_log_lines(flink_home: Path, needles: tuple[str, ...], limit: int = 5) -> list[str]:
    lines: list[str] = []
    for log in sorted(flink_home.rglob("*taskmanager*.log")) + sorted(flink_home.rglob("*taskmanager*.out")):
        with contextlib.suppress(OSError):
            for line in log.read_text(errors="replace").splitlines():
                if any(n in line for n in needles):
                    lines.append(f"{log.name}: {line.strip()[:300]}")
    return lines[-limit:]


def test_python_worker_kill_broker_hang_and_postgres_restart_leave_every_record_exactly_once(
    fault_drill: tuple[DrillResult, DrillResult, DrillResult],
) -> None:
    drill = fault_drill[0]
    assert drill.problems == []
    assert drill.notes["restores_after_worker_kill"] >= 1  # the killed worker failed its task: a real failover


def test_the_holdings_check_catches_a_read_that_commits_before_its_records_reach_the_sinks(
    fault_drill: tuple[DrillResult, DrillResult, DrillResult],
) -> None:
    _, broken, control = fault_drill
    assert len(broken.samples) >= 20
    ahead = [s for s in broken.samples if s.ahead()]
    assert ahead, "the broken variant's commits never ran ahead of the sinks: the check could not fail"
    # The control runs the same slow sink with the correct read: what the check caught is the early commit.
    assert len(control.samples) >= 20
    assert [s for s in control.samples if s.ahead()] == []
    assert control.problems == []


def test_draining_stop_still_fails_for_the_reason_the_cli_gives(
    fault_drill: tuple[DrillResult, DrillResult, DrillResult],
) -> None:
    drill = fault_drill[0]
    assert drill.notes["drain"] != "drained", "drain works now: drop DRAIN_REFUSED from beamflow flink savepoint"
    assert "CheckpointException" in drill.notes["drain"] or "declined" in drill.notes["drain"].lower()


def test_status_after_a_failover_shows_sink_totals_since_the_start(
    fault_drill: tuple[DrillResult, DrillResult, DrillResult],
) -> None:
    drill = fault_drill[0]
    status = drill.status
    assert status is not None and status.sink_totals is not None
    assert status.checkpoints["restored"] >= 1
    sinks_then = drill.notes["sinks_at_status"]
    # Read from the sinks, not from Beam counters: Iceberg rows at least what Iceberg held when status was read.
    assert 0 < status.sink_totals["iceberg_rows"] <= sinks_then["iceberg_distinct_ids"]
    assert status.sink_totals["kafka_committed"] > 0
    assert "SINCE THE JOB STARTED" in drill.status_text and "CURRENT ATTEMPT ONLY" in drill.status_text


def test_jobmanager_failover_and_savepoint_with_schema_v2_leave_every_record_exactly_once(
    restore_drill: DrillResult,
) -> None:
    assert restore_drill.problems == []
    assert restore_drill.traffic.counts["events_v2"] > 0
    assert restore_drill.notes["restored_checkpoint"].rsplit("/", 1)[-1].startswith("chk-")
    # Rescaled both ways: the checkpoint of a p1 job restored at p2, the savepoint of that p2 job restored at p1.
    notes = restore_drill.notes
    assert (notes["first_parallelism"], notes["second_parallelism"], notes["third_parallelism"]) == (1, 2, 1)
    # Scaled out, each partition has one reader: the restored watcher hands no partition out a second time (Beam's
    # runner without beamflow's Impulse patch did, so two subtasks read the same records; docs/deploying.md). Which
    # subtask reads which is the key hash of the p1 job's descriptors (not spread at p1), so possibly all on one.
    owners = notes["second_partition_owners"]
    read = [p for partitions in owners.values() for p in partitions]
    assert len(read) == len(set(read)), f"a partition read by two subtasks after the rescale: {owners}"
    assert notes["second_failures"] == [], "the scaled-out job failed after its restore"
    # Upgraded through the savepoint: from the job graph before the sessions' route to the routed one.
    assert (notes["second_routed"], notes["third_routed"]) == (False, True)


def test_taskmanager_kill_broker_restart_and_zombie_leave_every_record_exactly_once(live_drill: DrillResult) -> None:
    assert live_drill.problems == []
    assert live_drill.traffic.counts["duplicate_sends"] > 0 and live_drill.traffic.counts["bad_records"] == 10


def test_committed_offsets_never_run_ahead_of_the_sinks(
    live_drill: DrillResult, restore_drill: DrillResult, fault_drill: tuple[DrillResult, DrillResult, DrillResult]
) -> None:
    for drill in (live_drill, restore_drill, fault_drill[0]):
        final = drill.samples[-1]
        assert final.committed, "nothing was ever committed to the group"
        # Every sample, taken while the job ran and was disrupted: offsets first, then (strictly after) the sinks.
        assert len(drill.samples) >= 20
        assert [s for s in drill.samples if s.ahead()] == []


def test_status_shows_beam_metrics_and_checkpoints_of_a_running_job(live_drill: DrillResult) -> None:
    status = live_drill.status
    assert status is not None and status.state == "RUNNING"
    assert status.metrics.get("beamflow_kafka_records_read", 0) > 0, status.metrics_gap
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

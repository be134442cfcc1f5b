"""The rides job (seed 002) submitted as users submit it, ``python -m pipelines.rides --runner=FlinkRunner``, streaming
on the local Flink cluster in the production shape (parallelism 2, two TaskManagers with their own Python workers,
checkpoints every 3 s), on a backlog of rides with every kind of trouble: hot drivers, duplicate sends, late rides
(late panes within the allowed lateness) and too-late ones, an idle partition (idleness lets the other partition's
sessions fire), unknown drivers and zones, bad records.

Audited from the outside once the sessions have closed: the result topic by a plain confluent-kafka
``read_committed`` consumer (no result id twice; the current results, of a driver's overlapping sessions the one with
the most rides (``pipelines.rides.current_results``), count each ride once, and those sessions are the sessions of one
pass over the rides), the cell store the same way, the
dead letters by cause and the quarantine exactly as the traffic says.

The same again with the rides fed live and, once results are in the topic, the TaskManager running the job SIGKILLed
(its Python workers with it) and restarted, three times, once at each of ``KILL_MOMENTS``: mid-stream, at once after
a checkpoint completed, and while a checkpoint is in flight (read from the checkpoint storage): Flink restores the job
from its last checkpoint, the replayed results the sink already wrote are skipped by id, and the audit must come out
the same. And once more with the JobManager SIGKILLed and restarted instead, at the same three moments: without HA
the job is gone each time, and it is resubmitted from its newest retained checkpoint (``--savepoint_path``) while
the old job's tasks may still be writing (zombies fenced by the sink).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from beamflow.config import JobConfig, load_config
from beamflow.flink_rest import FlinkRest
from beamflow.generate import (
    ClickRecord,
    RideTrafficSpec,
    avro_ride_encoder,
    generate_traffic,
    ride_dimensions,
    seed_ride_dimensions,
)
from beamflow.kafka.admin import create_topic, produce
from beamflow.services import ServiceSet, ServiceState
from beamflow.services.flink import FlinkService
from beamflow.services.paths import project_root
from pipelines.rides_demo import (
    audit_cells,
    audit_results,
    dead_letters_by_cause,
    expected_outcome,
)
from runners.flink import service_settings
from tests.flink.drill_support import (
    KILL_MOMENTS,
    DrillJob,
    TrafficFeeder,
    drill_config,
    latest_retained_checkpoint,
    taskmanager_role_running,
    wait_for_kill_moment,
)

pytestmark = pytest.mark.flink

GAP_S = 20  # sessions close 20 s of event time after a driver's last ride, so they fire while the test runs


def rides_config(
    name: str, kafka: ServiceState, postgres: ServiceState, registry: ServiceState, flink: ServiceState, data: Path
) -> dict[str, Any]:
    """conf/rides.yaml with unique topics and tables, streaming on the local cluster with the drills' Flink settings."""
    drill = drill_config(name, kafka, postgres, registry, flink, data, **service_settings(flink))
    run = drill["job"]["name"]
    config = load_config(project_root() / "conf" / "rides.yaml")
    config["job"]["name"] = run
    config["flink"] = drill["flink"]
    config["kafka"].update(
        bootstrap=kafka.info["bootstrap"],
        topic=f"rides-{run}",
        group_id=f"rides-{run}",
        partitions=2,
        bounded=False,
        max_delay_ms=2000,
        idle_timeout_ms=5000,
    )
    config["registry"].update(url=registry.info["url"], subject=f"rides-{run}-value")
    config["postgres"].update(
        dsn=postgres.info["dsn"], dead_letters_table=f"ride_dead_{run}", quarantine_table=f"ride_dups_{run}"
    )
    config["lookups"]["drivers"]["table"] = f"drivers_{run}"
    config["lookups"]["zones"]["table"] = f"zones_{run}"
    config["sessions"]["gap_s"] = GAP_S
    config["kafka_sink"].update(
        topic=f"ride-sessions-{run}",
        sink_group=f"ride-sessions-{run}",
        ledger_table=f"ride_ledger_{run}",
        partitions=2,
        shards=2,
    )
    config["cells"]["table"] = f"ride_cells_{run}"
    return config


def _spec(seed: int) -> RideTrafficSpec:
    return RideTrafficSpec(
        events=1500,
        users=60,
        zones=20,
        partitions=2,
        idle_partition=1,
        duplicate_share=0.05,
        late_share=0.02,
        too_late_share=0.01,
        unknown_driver_share=0.02,
        unknown_zone_share=0.03,
        bad_per_kind=2,
        step_ms=200,
        seed=seed,
    )


def _wait_for_all_sessions(config: JobConfig, expected: dict[str, Any], job: DrillJob, timeout: float = 420) -> None:
    """Every session closes once both partitions are idle (the watermark then moves to now); waits for all of them."""
    deadline = time.monotonic() + timeout
    while audit_results(config).rides < expected["session_rides"]:
        if time.monotonic() > deadline:
            raise AssertionError(f"not every session reached the topic in {timeout}s\n{job.diagnosis()}")
        time.sleep(5)
    time.sleep(5)  # a replayed or late pane still in flight would show now


def _feed_until_results(job: DrillJob, records: list[ClickRecord], holds: int) -> tuple[TrafficFeeder, int]:
    """Starts feeding the rides once the job checkpointed, with ``holds`` holds spread over the rest of the feed
    (each fault is applied at a hold, so traffic is always still to come); waits until results are in the topic (a
    failure must find work to replay). Returns the feeder (at its first hold or past it) and the results so far."""
    job.wait_for_checkpoints(1, 180)
    feeder = TrafficFeeder(job.config, records, chunks=12, pause_s=2)
    feeder.hold_at(*(0.25 + 0.5 * i / max(holds - 1, 1) for i in range(holds)))  # 25% .. 75% of the rides
    feeder.start()
    config = JobConfig.from_dict(job.config)
    deadline = time.monotonic() + 300
    while audit_results(config).results == 0:
        assert feeder.error is None and time.monotonic() < deadline, f"no results yet\n{job.diagnosis()}"
        time.sleep(1)
    return feeder, audit_results(config).results


def _run(
    name: str,
    services: tuple[ServiceState, ServiceState, ServiceState, ServiceState],
    service_set: ServiceSet,
    work: Path,
    seed: int,
    disrupt: Callable[[list[DrillJob], list[ClickRecord]], dict[str, Any]] | None = None,
) -> Iterator[dict[str, Any]]:
    """The job on ``seed``'s rides: all in Kafka before it starts, or, with ``disrupt``, fed to it by ``disrupt``
    (which may resubmit it: the last job in the list it is given is the one audited)."""
    kafka, postgres, registry, flink = services
    raw = rides_config(name, kafka, postgres, registry, flink, service_set.data)
    config = JobConfig.from_dict(raw)
    spec = _spec(seed)
    dimensions = ride_dimensions(spec)
    lookups = raw["lookups"]
    seed_ride_dimensions(postgres.info["dsn"], dimensions, lookups["drivers"]["table"], lookups["zones"]["table"])
    traffic = generate_traffic(spec, avro_ride_encoder(raw["registry"]["url"], raw["registry"]["subject"]))
    create_topic(kafka.info["bootstrap"], raw["kafka"]["topic"], 2)
    create_topic(kafka.info["bootstrap"], raw["kafka_sink"]["topic"], 2)
    if disrupt is None:
        produce(
            kafka.info["bootstrap"],
            raw["kafka"]["topic"],
            ((r.key, r.value, {"partition": r.partition, "timestamp_ms": r.timestamp_ms}) for r in traffic.records),
        )
    expected = expected_outcome(
        [traffic], {d["driver_id"] for d in dimensions.drivers}, GAP_S * 1000, config.sessions.allowed_lateness_s * 1000
    )
    jobs = [DrillJob(raw, work, "main", module="pipelines.rides")]
    result: dict[str, Any] = {"config": config, "traffic": traffic, "expected": expected, "work": work}
    t0 = time.monotonic()
    try:
        jobs[0].start()
        result["submitted_s"] = round(time.monotonic() - t0, 1)
        if disrupt is not None:
            result["notes"] = disrupt(jobs, traffic.records)
        job = jobs[-1]
        _wait_for_all_sessions(config, expected, job)
        result["done_s"] = round(time.monotonic() - t0, 1)
        result["topic"], result["cells"] = audit_results(config), audit_cells(config)
        result["dead_letters"] = dead_letters_by_cause(config)
        assert job.job_id is not None
        rest = FlinkRest(raw["flink"]["rest_url"])
        result["state"] = rest.job_state(job.job_id)
        result["checkpoints"] = rest.checkpoints(job.job_id)["counts"]
        result["restored_from"] = rest.checkpoints(job.job_id).get("latest", {}).get("restored")
    finally:
        for started in jobs:
            started.cancel()
    print(
        f"\nrides on Flink ({name}): {traffic.summary()}; submitted in {result.get('submitted_s')}s, all sessions in "
        f"{result.get('done_s')}s; notes {result.get('notes')}; topic {result.get('topic')!r:.160}; checkpoints "
        f"{result.get('checkpoints')}"
    )
    yield result


@pytest.fixture(scope="module")
def rides_run(
    kafka: ServiceState,
    postgres: ServiceState,
    registry: ServiceState,
    flink: ServiceState,
    service_set: ServiceSet,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    yield from _run("rides", (kafka, postgres, registry, flink), service_set, tmp_path_factory.mktemp("rides"), 17)


@pytest.fixture(scope="module")
def taskmanager_drill(
    kafka: ServiceState,
    postgres: ServiceState,
    registry: ServiceState,
    flink: ServiceState,
    service_set: ServiceSet,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """Rides fed live; once results are in the topic, the TaskManager running the job SIGKILLed and restarted."""
    flink_service: FlinkService = service_set.get("flink")  # type: ignore[assignment]

    checkpoints_dir = Path(flink.info["checkpoints_dir"])

    def kill_a_taskmanager(jobs: list[DrillJob], records: list[ClickRecord]) -> dict[str, Any]:
        job = jobs[-1]
        assert job.job_id is not None
        feeder, before = _feed_until_results(job, records, holds=len(KILL_MOMENTS))
        kills = []
        for moment in KILL_MOMENTS:
            feeder.wait_held()
            feeder.resume()  # live traffic while the TaskManager dies
            seen = wait_for_kill_moment(checkpoints_dir, job.job_id, moment)
            role = taskmanager_role_running(job.rest, job.job_id)
            flink_service.kill(role)  # its Python workers die with it (PROCESS environment)
            killed_at = time.monotonic()
            flink_service.restart(role)
            job.rest.wait_for_state(job.job_id, {"RUNNING"}, 240)
            job.wait_for_checkpoints(1, 240)
            kills.append({**seen, "killed": role, "recovered_s": round(time.monotonic() - killed_at, 1)})
        feeder.join(300)
        assert feeder.error is None and feeder.sent == len(records), feeder.error
        return {"kills": kills, "results_before_first_kill": before}

    yield from _run(
        "ridestm",
        (kafka, postgres, registry, flink),
        service_set,
        tmp_path_factory.mktemp("rides-tm"),
        23,
        kill_a_taskmanager,
    )


@pytest.fixture(scope="module")
def jobmanager_drill(
    kafka: ServiceState,
    postgres: ServiceState,
    registry: ServiceState,
    flink: ServiceState,
    service_set: ServiceSet,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """Rides fed live; once results are in the topic, the JobManager SIGKILLed and restarted. Without HA it knows no
    job: the job is resubmitted from its newest retained checkpoint, as an operator would."""
    flink_service: FlinkService = service_set.get("flink")  # type: ignore[assignment]
    checkpoints_dir = Path(flink.info["checkpoints_dir"])
    work = tmp_path_factory.mktemp("rides-jm")

    def kill_the_jobmanager(jobs: list[DrillJob], records: list[ClickRecord]) -> dict[str, Any]:
        assert jobs[-1].job_id is not None
        feeder, before = _feed_until_results(jobs[-1], records, holds=len(KILL_MOMENTS))
        kills = []
        for moment in KILL_MOMENTS:
            current = jobs[-1]
            assert current.job_id is not None
            feeder.wait_held()
            feeder.resume()  # live traffic while the JobManager is gone
            seen = wait_for_kill_moment(checkpoints_dir, current.job_id, moment)
            flink_service.kill_jobmanager()
            killed_at = time.monotonic()
            current.reap(timeout=5)
            checkpoint = latest_retained_checkpoint(checkpoints_dir, current.job_id)
            flink_service.restart_jobmanager()
            deadline = time.monotonic() + 120  # the TaskManagers free the old job's slots once they notice
            while True:
                overview = current.rest.overview()
                if overview.get("slots-available") == overview.get("slots-total") and overview.get("taskmanagers"):
                    break
                assert time.monotonic() < deadline, overview
                time.sleep(1)
            restored = DrillJob(
                current.config,
                work,
                f"restore{len(jobs)}",
                (f"--savepoint_path={checkpoint}",),
                module="pipelines.rides",
            )
            jobs.append(restored)
            restored.start()
            restored.wait_for_checkpoints(1, 240)
            kills.append(
                {**seen, "restored_checkpoint": checkpoint, "recovered_s": round(time.monotonic() - killed_at, 1)}
            )
        feeder.join(300)
        assert feeder.error is None and feeder.sent == len(records), feeder.error
        return {"kills": kills, "results_before_first_kill": before}

    yield from _run("ridesjm", (kafka, postgres, registry, flink), service_set, work, 29, kill_the_jobmanager)


RUNS = ("rides_run", "taskmanager_drill", "jobmanager_drill")


# After a failover a session can come back in another shape than it had before (once seen after a JobManager restore:
# 11 rides in two current sessions of the topic; once after a TaskManager kill: a stale cell row, 1,517 ride counts
# over 1,456 rides). Both sinks are read by overlap (pipelines.rides.current_results), so these checks hold the
# reader's rule to every failover, with no xfail: a ride in two current sessions fails them.
@pytest.mark.parametrize("run", RUNS)
def test_each_result_once_and_each_ride_in_one_current_session(run: str, request: pytest.FixtureRequest) -> None:
    rides_run = request.getfixturevalue(run)
    expected, topic = rides_run["expected"], rides_run["topic"]
    assert rides_run["state"] == "RUNNING" and rides_run["checkpoints"]["completed"] >= 1
    assert topic.results == topic.distinct_ids  # no result id twice for a read_committed reader
    assert topic.rides == topic.distinct_rides == expected["session_rides"]
    assert topic.sessions == expected["sessions"]
    assert topic.unknown_zone_rides == expected["unknown_zone_rides"]


@pytest.mark.parametrize("run", RUNS)
def test_the_cell_store_holds_each_ride_once_in_its_current_sessions(run: str, request: pytest.FixtureRequest) -> None:
    rides_run = request.getfixturevalue(run)
    expected, cells = rides_run["expected"], rides_run["cells"]
    assert cells.results == cells.distinct_ids
    assert cells.rides == cells.distinct_rides == expected["session_rides"]
    assert cells.sessions == expected["sessions"]
    assert cells.unknown_zone_rides == expected["unknown_zone_rides"]


@pytest.mark.parametrize("run", RUNS)
def test_unknown_drivers_too_late_rides_and_bad_records_are_dead_letters_duplicates_quarantined(
    run: str, request: pytest.FixtureRequest
) -> None:
    import psycopg
    from psycopg import sql

    rides_run = request.getfixturevalue(run)
    expected, traffic = rides_run["expected"], rides_run["traffic"]
    assert rides_run["dead_letters"] == {
        "undecodable": expected["bad_records"],
        "unknown_driver": expected["unknown_driver_rides"],
        "too_late": expected["too_late_rides"],
    }
    pg = rides_run["config"].postgres
    with psycopg.connect(pg.dsn) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(pg.quarantine_table))).fetchone()
    assert row is not None and row[0] == traffic.counts["duplicate_sends"]


def test_the_taskmanager_kills_were_real_failovers_at_each_moment(taskmanager_drill: dict[str, Any]) -> None:
    # Restored from a checkpoint after each kill, with results already written that the restored job's replay had to
    # skip or extend; one kill at each moment, the in-flight one with a checkpoint really open.
    kills = taskmanager_drill["notes"]["kills"]
    assert [k["moment"] for k in kills] == list(KILL_MOMENTS)
    assert "in_flight" in kills[-1]
    assert taskmanager_drill["checkpoints"]["restored"] >= len(KILL_MOMENTS)
    assert 0 < taskmanager_drill["notes"]["results_before_first_kill"] < taskmanager_drill["topic"].results


def test_the_jobmanager_kills_were_each_restored_from_a_checkpoint(jobmanager_drill: dict[str, Any]) -> None:
    kills = jobmanager_drill["notes"]["kills"]
    assert [k["moment"] for k in kills] == list(KILL_MOMENTS)
    assert "in_flight" in kills[-1]
    assert len({k["restored_checkpoint"] for k in kills}) == len(KILL_MOMENTS)
    assert jobmanager_drill["restored_from"] is not None
    assert 0 < jobmanager_drill["notes"]["results_before_first_kill"] < jobmanager_drill["topic"].results

"""Issue 13's acceptance: the clicks job streaming on Flink in the shape users deploy, starting on a backlog.

The shape: parallelism 2 on two TaskManagers, each starting its own Python workers (PROCESS environment), the job
submitted by ``python -m pipelines.clicks --runner=FlinkRunner`` with conf/flink.yaml's checkpoint and bundle settings
as shipped (a 10 s interval, a 30 s timeout, 1,000-element bundles), on a backlog of 20,000 events with every kind
of trouble (duplicate sends, undecodable records, late and too-late events, hot users, an idle partition, schema v2
halfway), plus live traffic while it catches up. The submitting process is SIGKILLed mid-stream: the job must not
notice. Then: lag reaches zero, no checkpoint failed or expired, no restart, and the sinks audited record by record.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from beamflow.cli.status import beam_metrics, metrics_gap
from beamflow.config import load_config
from beamflow.flink_rest import FlinkRest
from beamflow.generate import GeneratedTraffic, TrafficSpec, avro_click_encoder, generate_traffic
from beamflow.kafka.admin import create_topic, produce
from beamflow.kafka.record import TopicPartition
from beamflow.services import ServiceSet, ServiceState
from beamflow.services.beam_patches import checkpoint_residual_states
from beamflow.services.paths import project_root
from runners.flink import service_settings
from tests.flink.drill_support import (
    DrillJob,
    TrafficFeeder,
    check_exactly_once,
    committed_offsets,
    drill_config,
    latest_retained_checkpoint,
    partition_owners,
    sink_counts,
    wait_for_sinks,
)

pytestmark = pytest.mark.flink

BACKLOG_EVENTS = 20_000
LIVE_EVENTS = 1_500
# What conf/flink.yaml ships and this test must run with, unchanged.
SHIPPED = (
    "parallelism",
    "checkpointing_interval_ms",
    "checkpoint_timeout_ms",
    "min_pause_between_checkpoints_ms",
    "max_bundle_time_ms",
    "max_bundle_size",
    "finish_bundle_before_checkpointing",
)


def _end_offsets(config: dict[str, Any]) -> dict[int, int]:
    from confluent_kafka import Consumer, TopicPartition

    kafka = config["kafka"]
    consumer = Consumer({"bootstrap.servers": kafka["bootstrap"], "group.id": "backlog-test-probe"})
    try:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(kafka["topic"], p), timeout=10)[1]
            for p in range(int(kafka["partitions"]))
        }
    finally:
        consumer.close()


def overlapping_sessions(config: dict[str, Any]) -> int:
    """Pairs of stored sessions of one user whose windows overlap (sessions must be disjoint)."""
    import psycopg
    from psycopg import sql

    pg = config["postgres"]
    with psycopg.connect(pg["dsn"], autocommit=True) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT count(*) FROM {t} a JOIN {t} b ON a.user_id = b.user_id AND a.session_start < b.session_start"
                " AND b.session_start < a.session_end"
            ).format(t=sql.Identifier(pg["sessions_table"]))
        ).fetchone()
    return int(row[0]) if row else 0


def session_events(config: dict[str, Any]) -> int:
    import psycopg
    from psycopg import sql

    pg = config["postgres"]
    with psycopg.connect(pg["dsn"], autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("SELECT coalesce(sum(events), 0) FROM {}").format(sql.Identifier(pg["sessions_table"]))
        ).fetchone()
    return int(row[0]) if row else 0


@pytest.fixture(scope="module")
def backlog_run(
    kafka: ServiceState,
    postgres: ServiceState,
    registry: ServiceState,
    flink: ServiceState,
    service_set: ServiceSet,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    shipped = load_config(project_root() / "conf" / "clicks.yaml")["flink"]
    config = drill_config(
        "backlog",
        kafka,
        postgres,
        registry,
        flink,
        service_set.data,
        **service_settings(flink),
        **{key: shipped[key] for key in SHIPPED},
    )
    assert config["flink"]["parallelism"] == 2
    run = config["job"]["name"]
    config["kafka"]["partitions"] = 4
    config["kafka"]["topic"] = _topic_the_hash_alone_would_skew(config, 4)
    config["postgres"]["first_copies_table"] = f"first_copies_{run}"
    spec = TrafficSpec(
        events=BACKLOG_EVENTS + LIVE_EVENTS,
        users=400,
        partitions=4,
        duplicate_share=0.05,
        bad_per_kind=3,
        step_ms=100,
        seed=13,
    )
    traffic = generate_traffic(spec, avro_click_encoder(config["registry"]["url"], config["registry"]["subject"]))
    create_topic(config["kafka"]["bootstrap"], config["kafka"]["topic"], 4)
    # The backlog is in Kafka before the job exists; the rest arrives live while it catches up.
    split = _index_of_event(traffic, BACKLOG_EVENTS)
    produce(
        config["kafka"]["bootstrap"],
        config["kafka"]["topic"],
        ((r.key, r.value, {"partition": r.partition, "timestamp_ms": r.timestamp_ms}) for r in traffic.records[:split]),
    )
    feeder = TrafficFeeder(config, traffic.records[split:], chunks=10, pause_s=2)
    work = tmp_path_factory.mktemp("backlog")
    # --attached keeps the submitter alive (as if an operator's shell held it), so the test can kill it mid-stream.
    job = DrillJob(config, work, "main", ("--attached",))
    result: dict[str, Any] = {"config": config, "traffic": traffic, "job": job, "timings": {}}
    t0 = time.monotonic()
    try:
        job.start()
        result["timings"]["submitted_s"] = round(time.monotonic() - t0, 1)
        feeder.start()
        _wait_for(lambda: sink_counts(config)["iceberg_distinct_ids"] > 2_000, 240, "the first 2,000 events", job)
        assert job.proc is not None
        job.proc.kill()  # the submitter dies mid-stream; its job must not
        job.proc.wait(30)
        result["timings"]["submitter_killed_s"] = round(time.monotonic() - t0, 1)
        result["iceberg_at_kill"] = sink_counts(config)["iceberg_distinct_ids"]
        feeder.join(300)
        assert feeder.error is None, feeder.error
        result["counts"] = wait_for_sinks(config, traffic, timeout=420)
        result["timings"]["caught_up_s"] = round(time.monotonic() - t0, 1)
        # The group's offsets follow one checkpoint after the sinks; they reach the end once two more complete.
        end = _end_offsets(config)
        _wait_for(lambda: committed_offsets(config) == end, 120, f"committed offsets to reach {end}", job)
        result["timings"]["lag_zero_s"] = round(time.monotonic() - t0, 1)
        assert job.job_id is not None
        rest = FlinkRest(config["flink"]["rest_url"])
        # A quick catch-up can be done within two checkpoints; three make "every checkpoint completed" mean something.
        rest.wait_for_checkpoints(job.job_id, count=3, timeout=120)
        result["state"] = rest.job_state(job.job_id)
        result["checkpoints"] = rest.checkpoints(job.job_id)
        result["failures"] = rest.failure_history(job.job_id)
        result["end_offsets"] = end
        # What was seen: the test below judges it (other tests go on).
        result["partition_owners"] = partition_owners(rest, job.job_id, config["kafka"]["topic"], 4, timeout=90)
        result["iceberg_metrics"] = _iceberg_metrics(rest, job.job_id, traffic.counts["events"])
        result["metrics_gap"] = metrics_gap(rest, job.job_id)
    finally:
        job.cancel()
    if job.job_id is not None:  # retained on cancellation: what the job's state held after minutes of deferrals
        newest = latest_retained_checkpoint(Path(flink.info["checkpoints_dir"]), job.job_id)
        result["residual_states"] = checkpoint_residual_states(Path(newest))
    result["problems"] = check_exactly_once(config, traffic)
    result["overlapping_sessions"] = overlapping_sessions(config)
    result["session_events"] = session_events(config)
    print(
        f"\nbacklog run: {traffic.summary()} timings {result['timings']} counts {result.get('counts')} "
        f"checkpoints {_checkpoint_history(result.get('checkpoints', {}))} iceberg {result.get('iceberg_metrics')}"
    )
    yield result


def _iceberg_metrics(rest: FlinkRest, job_id: str, events: int, timeout: float = 60) -> dict[str, float]:
    """The impressions sink's Beam metrics summed over its subtasks, once they count every event written (Flink's
    metric store refreshes asynchronously); what they say after ``timeout`` otherwise (the test then fails on it)."""
    deadline = time.monotonic() + timeout
    while True:
        totals, _ = beam_metrics(rest, job_id)  # what `beamflow status` shows
        prefix = "beamflow_iceberg_"
        metrics = {name.removeprefix(prefix): value for name, value in totals.items() if name.startswith(prefix)}
        if metrics.get("rows_written") == events or time.monotonic() > deadline:
            return metrics
        time.sleep(2)


def _topic_the_hash_alone_would_skew(config: dict[str, Any], partitions: int) -> str:
    """The drill's topic name, suffixed until the runner's key hash of plain partition descriptors would give one
    read subtask more than its share: so the balance check below fails unless the read spreads its partitions."""
    from apache_beam.options.pipeline_options import PipelineOptions

    from transforms.read_from_kafka import _ReaderSpread

    flink = config["flink"]
    flags = ["--runner=FlinkRunner", f"--parallelism={flink['parallelism']}"]
    if flink.get("max_parallelism"):
        flags.append(f"--max_parallelism={flink['max_parallelism']}")
    spread = _ReaderSpread.for_options(PipelineOptions(flags))
    assert spread is not None
    for n in range(1000):
        topic = f"{config['kafka']['topic']}-{n}"
        owners = Counter(spread.subtask_of(TopicPartition(topic, p)) for p in range(partitions))
        if max(owners.values()) > partitions // spread.parallelism:
            return topic
    raise AssertionError("no skewed topic name found")


def _index_of_event(traffic: GeneratedTraffic, events: int) -> int:
    """The record index after which ``events`` unique events have been generated."""
    seen = 0
    for index, record in enumerate(traffic.records):
        seen += record.kind == "event"
        if seen >= events:
            return index + 1
    return len(traffic.records)


def _wait_for(check: Any, timeout: float, what: str, job: DrillJob) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{job.diagnosis()}")
        time.sleep(2)


def _checkpoint_history(checkpoints: dict[str, Any]) -> list[tuple[int, str, int]]:
    return [(h["id"], h["status"], h["end_to_end_duration"]) for h in checkpoints.get("history", [])]


def test_backlog_catches_up_with_every_checkpoint_completing(backlog_run: dict[str, Any]) -> None:
    checkpoints = backlog_run["checkpoints"]
    history = checkpoints.get("history", [])
    failed = [h for h in history if h["status"] == "FAILED"]
    assert not failed, f"failed checkpoints: {[(h['id'], h.get('failure_message')) for h in failed]}"
    assert checkpoints["counts"]["completed"] >= 3, _checkpoint_history(checkpoints)
    # counts.failed also counts the triggers refused while the job's tasks were still deploying ("not being executed
    # at the moment"); those never start, so they have no history entry. Every checkpoint that started is above.
    assert len(history) >= checkpoints["counts"]["completed"]
    assert backlog_run["state"] == "RUNNING"
    restarts = backlog_run["failures"]
    assert restarts == [], [e.get("exceptionName") for e in restarts]


def test_each_read_subtask_reads_its_share_of_the_partitions(backlog_run: dict[str, Any]) -> None:
    # Round robin, as Flink's KafkaSource assigns partitions. The topic was picked so that the runner's key hash of
    # plain descriptors would give one subtask three or four (shown: {0, 2, 3} / {1} with the spread switched off).
    owners = backlog_run["partition_owners"]
    assert sorted(sorted(parts) for parts in owners.values()) == [[0, 2], [1, 3]], owners


def test_the_job_outlives_its_submitter(backlog_run: dict[str, Any]) -> None:
    # Killed once 2,000 events were in; everything after that was processed by the job alone.
    assert backlog_run["iceberg_at_kill"] < BACKLOG_EVENTS
    assert backlog_run["job"].proc.returncode == -9
    assert backlog_run["counts"]["iceberg_distinct_ids"] == backlog_run["traffic"].counts["events"]


def test_every_record_lands_once_in_the_sink_it_belongs_to(backlog_run: dict[str, Any]) -> None:
    assert backlog_run["problems"] == []
    assert backlog_run["overlapping_sessions"] == 0
    assert 0 < backlog_run["session_events"] <= backlog_run["traffic"].counts["events"]


def test_the_iceberg_commits_scan_each_hour_once_not_each_commit(backlog_run: dict[str, Any]) -> None:
    """Each worker's committer scans the event ids of an hour of event time once, the first time a batch needs it,
    then follows the table's appends (``beamflow/iceberg/known_keys.py``): under the backlog, on the cluster, the
    scans stay at the hours the traffic touches however many commits there are. Read from the job's own metrics,
    which also count every unique event written once (the audit above checks the table itself). A lookup that scans
    per commit (the job with ``iceberg.known_keys_max: 1``) fails it."""
    metrics = backlog_run["iceberg_metrics"]
    traffic = backlog_run["traffic"]
    hours = {r.event["event_time"] // 3_600_000 for r in traffic.records if r.kind == "event" and r.event}
    parallelism = backlog_run["config"]["flink"]["parallelism"]
    assert metrics.get("rows_written") == traffic.counts["events"], (metrics, backlog_run["metrics_gap"])
    assert backlog_run["metrics_gap"] is None  # the job shows Beam metrics: status has no gap to explain
    # More commits than the scans allowed: a lookup scanning per commit would exceed the bound below.
    assert metrics["commits"] > parallelism * len(hours), f"too few commits for the check to mean much: {metrics}"
    assert metrics["known_keys_scans"] <= parallelism * len(hours), f"{len(hours)} hours of event time, {metrics}"


def test_the_read_leaves_no_state_behind_per_deferral(backlog_run: dict[str, Any]) -> None:
    # Beam 2.62's own runner names a new keyed state after every deferral of the read and never drops it
    # (apache/beam#27648; 91 of them after 2 minutes of this read on the unpatched cluster); the patched runner keeps
    # every residual in one map state (beamflow.services.beam_patches). tests/flink/test_sdf_residuals.py shows the
    # unpatched handler doing it.
    states = backlog_run["residual_states"]
    assert states.per_deferral == frozenset(), f"{len(states.per_deferral)} per-deferral states: runner unpatched"
    assert states.residual_map


def test_the_submission_ships_no_runner_jars(flink: ServiceState) -> None:
    # The cluster carries Beam's runner jars; a job stages only the empty marker jar.
    marker = Path(flink.info["marker_jar"])
    assert service_settings(flink)["files_to_stage"] == [str(marker)]
    assert marker.stat().st_size < 1_000
    lib = Path(flink.info["conf_dir"]).parent / "lib"
    assert any(p.name.startswith("beam-runners-flink-1.19") for p in lib.iterdir())

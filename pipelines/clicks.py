"""The clicks job (seed 000): Kafka Avro clicks -> event ids -> dedup -> Iceberg impressions + PostgreSQL sessions.

::

    python -m pipelines.clicks                       # pinned local runner against the local services
    python -m pipelines.clicks --runner=FlinkRunner  # the same job on the Flink session cluster
    python -m pipelines.clicks --conf conf/clicks.yaml --set kafka.bounded=false

Stages: ReadFromKafka (offsets committed on finalize when streaming; after the sinks when bounded) -> DecodeAvro
through the registry (dead letters aside) -> AttachEventId from the event's identifying fields -> DeduplicateEvents
(duplicates to a quarantine table) -> two branches: raw impressions into the exactly-once Iceberg sink, and 10-minute
session windows per user_id with hot-key aggregation into the PostgreSQL sessions store (``WriteSessions``: each row
merged with the stored sessions it touches, in one transaction, each event counted once by its Kafka coordinates, so
run boundaries, reruns after crashes, restores and late panes all leave the sessions one run over every event would).
Every input a stage rejects ends in the dead-letter table with its reason (undecodable records, events missing an
identifying field, rows a sink refuses); later copies of an event go to the quarantine table instead. No session event
is rejected as too late: a stream writes partial sessions that ``WriteSessions`` merges whenever they come, and a
bounded batch run has no late data. (Only ``HotKeyAggregate``'s windowed strategy drops events later than
``sessions.allowed_lateness_s``; this job takes it only for a bounded read in a streaming run, and counts such events,
``late_dropped``, without storing them.) A bounded run commits every partition's offsets in one request after all
sinks (``CommitOffsetsAfter``): a run is committed whole or not at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
from apache_beam.runners.runner import PipelineResult
from apache_beam.transforms.window import Sessions

from beamflow.aggregates import SessionClicksFn
from beamflow.config import (
    ConfigError,
    JobConfig,
    as_job_config,
    load_job_config,
    required,
    resolve_auto,
    start_services,
)
from beamflow.generate import load_click_schema
from beamflow.iceberg.catalog import CatalogConfig
from beamflow.postgres.sessions import sessions_spec as _sessions_table_spec
from beamflow.postgres.table import TableSpec
from transforms.attach_event_id import AttachEventId
from transforms.commit_offsets_after import CommitOffsetsAfter
from transforms.decode_avro import DecodeAvro
from transforms.deduplicate import DeduplicateEvents, FirstCopyTable, QuarantinedEvent
from transforms.hot_key_aggregate import HotKeyAggregate, WindowedAggregate
from transforms.read_from_kafka import ReadFromKafka, StartPolicy, StopPolicy
from transforms.write_dead_letters import WriteDeadLetters, dead_letter_spec
from transforms.write_sessions import WriteSessions
from transforms.write_to_iceberg import WriteToIceberg
from transforms.write_to_postgres import WriteToPostgres

__all__ = [
    "EVENT_ID_FIELDS",
    "SESSIONS_SPEC",
    "ClicksJob",
    "build_pipeline",
    "dead_letter_spec",
    "main",
    "quarantine_spec",
]

_LOG = logging.getLogger("pipelines.clicks")
DEFAULT_CONF = "conf/clicks.yaml"
# The fields that identify one click event (its id is derived from them): a producer's duplicate send repeats all of
# them, two distinct events never do.
EVENT_ID_FIELDS = ("user_id", "ad_id", "campaign_id", "event_type", "event_time")


def sessions_spec(table: str) -> TableSpec:
    """The sessions table (``beamflow.postgres.sessions``): the session columns plus the Kafka offsets counted."""
    return _sessions_table_spec(table)


SESSIONS_SPEC = sessions_spec("click_sessions")


def quarantine_spec(table: str) -> TableSpec:
    return TableSpec(
        table,
        key=("topic", "kafka_partition", "kafka_offset"),
        columns={
            "topic": "text NOT NULL",
            "kafka_partition": "integer NOT NULL",
            "kafka_offset": "bigint NOT NULL",
            "event_id": "text",
            "reason": "text NOT NULL",
            "event_time": "timestamptz",
            "first_seen": "timestamptz",
        },
    )


def _utc(ms: int | float) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000.0, tz=dt.UTC)


def quarantine_row(q: QuarantinedEvent) -> dict[str, Any]:
    kafka = q.event["_kafka"]
    return {
        "topic": kafka["topic"],
        "kafka_partition": kafka["partition"],
        "kafka_offset": kafka["offset"],
        "event_id": None if q.event_id is None else str(q.event_id),
        "reason": q.reason,
        "event_time": q.event_time.to_utc_datetime(has_tz=True),
        "first_seen": q.first_seen.to_utc_datetime(has_tz=True) if q.first_seen is not None else None,
    }


def session_row(agg: WindowedAggregate) -> dict[str, Any]:
    clicks = agg.value
    return {
        "user_id": agg.key,
        "session_start": agg.window_start.to_utc_datetime(has_tz=True),
        "session_end": agg.window_end.to_utc_datetime(has_tz=True),
        "impressions": clicks.impressions,
        "clicks": clicks.clicks,
        "first_event": _utc(clicks.first_event_time) if clicks.first_event_time is not None else None,
        "last_event": _utc(clicks.last_event_time) if clicks.last_event_time is not None else None,
        "events": agg.input_count,
        "pane_index": agg.pane_index,
        "is_final": agg.is_last,
        "impression_offsets": clicks.impression_offsets.encode(),
        "click_offsets": clicks.click_offsets.encode(),
    }


def click_event(decoded: dict[str, Any]) -> dict[str, Any]:
    """A decoded click with event time as epoch milliseconds (Avro's timestamp-millis decodes to a datetime)."""
    event = dict(decoded)
    when = event["event_time"]
    if isinstance(when, dt.datetime):
        event["event_time"] = int(when.timestamp() * 1000)
    return event


def impression_row(event: dict[str, Any]) -> dict[str, Any]:
    """The Iceberg row: the event's fields, its id, its Kafka coordinates and event time as a timestamp."""
    kafka = event["_kafka"]
    row = {k: v for k, v in event.items() if k != "_kafka"}
    row["event_time"] = _utc(event["event_time"])
    row["_kafka"] = {"topic": kafka["topic"], "partition": kafka["partition"], "offset": kafka["offset"]}
    return row


# What the session aggregate (SessionClicksFn) and the hot-key sharding (shard_by) read of an event: its type, time
# and id, and its Kafka coordinates (the sessions store counts each event once by them, across runs).
SESSION_FIELDS = ("event_type", "event_time", "event_id", "kafka_partition", "kafka_offset")


def session_input(event: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(user_id, the event's SESSION_FIELDS): only those cross the sessions' shuffle, not the whole event."""
    kafka = event["_kafka"]
    return event["user_id"], {
        "event_type": event["event_type"],
        "event_time": event["event_time"],
        "event_id": event["event_id"],
        "kafka_partition": kafka["partition"],
        "kafka_offset": kafka["offset"],
    }


@dataclass
class ClicksJob:
    """The pipeline's outputs, for tests and the demo."""

    read: beam.PCollection
    unique: beam.PCollection
    dead_letters: beam.PCollection
    quarantine: beam.PCollection
    sessions: beam.PCollection


def build_pipeline(p: beam.Pipeline, config: JobConfig | Mapping[str, Any]) -> ClicksJob:
    job = as_job_config(config)
    kafka, pg, ice = required(job.kafka, "kafka"), required(job.postgres, "postgres"), required(job.iceberg, "iceberg")
    registry, sessions_conf, dedup_conf = required(job.registry, "registry"), job.sessions, job.dedup

    bounded = kafka.bounded
    records = p | "ReadClicks" >> ReadFromKafka(
        kafka.bootstrap,
        [kafka.topic],
        group_id=kafka.group_id,
        backend=kafka.backend,
        start=StartPolicy(kafka.start),
        stop=StopPolicy(at_end_offsets=bounded),
        max_delay_ms=kafka.max_delay_ms,
        idle_timeout_ms=kafka.idle_timeout_ms,
        max_bundle_records=kafka.max_bundle_records,
        consumer_config=dict(kafka.consumer_config) or None,
        # A bounded run commits after its sinks (CommitOffsetsAfter below); a streaming one on finalization.
        commit_offsets=not bounded,
    )
    decoded = records | "DecodeAvro" >> DecodeAvro(registry.url, reader_schema=load_click_schema(2))
    identified = (
        decoded.decoded
        | "ToClickEvents" >> beam.Map(click_event)
        | "WithEventId" >> AttachEventId(fields=EVENT_ID_FIELDS)
    )
    dedup = identified.events | "Deduplicate" >> DeduplicateEvents(
        ttl=dedup_conf.ttl_s,
        table=_first_copy_table(job),
        strategy=dedup_conf.strategy,
    )

    catalog = CatalogConfig(warehouse=ice.catalog.warehouse, uri=ice.catalog.uri)
    iceberg = (
        dedup.unique
        | "ToImpressionRows" >> beam.Map(impression_row)
        | "WriteImpressions"
        >> WriteToIceberg(
            ice.table,
            catalog,
            sink_id=required(ice.sink_id, "iceberg.sink_id"),
            partition_by=[("event_time", "day")],
            # Deduplication shuffles by event id, so a partition's offsets can reach the committer out of order:
            # exactly-once here rests on the deterministic event id (looked up within the batch's days), with the
            # offset marks recorded for monitoring.
            key_column="event_id",
            key_time_column="event_time",
        )
    )

    sessions = (
        dedup.unique
        | "KeyByUser" >> beam.Map(session_input)
        | "SessionAggregates"
        >> HotKeyAggregate(
            SessionClicksFn(),
            windowfn=Sessions(sessions_conf.gap_s),
            # A stream writes each bundle's partial sessions and WriteSessions merges them with the stored ones:
            # no window state or firing bursts in the way of checkpoints, and no event is too late to count. A
            # bounded run takes auto: lifted in a batch run (every key pre-aggregated per bundle, merged per key;
            # the windowed strategy's arguments unused), windowed with hot keys and lateness if the run streams.
            strategy="auto" if bounded else "bundle_partials",
            hot_keys=sessions_conf.hot_keys if bounded else (),
            fanout=sessions_conf.fanout if bounded else None,
            allowed_lateness=sessions_conf.allowed_lateness_s if bounded else 0,
            shard_by=(lambda e: e["event_id"]) if bounded else None,
        )
    )
    # Merged with the stored sessions they touch (superseded windows, earlier runs, replays) in one transaction.
    sessions_written = (
        sessions
        | "ToSessionRows" >> beam.Map(session_row)
        | "WriteSessions" >> WriteSessions(pg.dsn, pg.sessions_table)
    )
    quarantine = dedup.quarantine | "ToQuarantineRows" >> beam.Map(quarantine_row)
    quarantine_written = quarantine | "WriteQuarantine" >> WriteToPostgres(
        pg.dsn, quarantine_spec(pg.quarantine_table), create=True
    )
    dead_letters = (
        decoded.dead_letters,
        identified.dead_letters,
        iceberg.dead_letters,
        quarantine_written.dead_letters,
    ) | "AllDeadLetters" >> beam.Flatten()
    dlq_conf = job.dead_letters
    if dlq_conf.sink == "kafka":
        dlq = WriteDeadLetters("kafka", bootstrap=kafka.bootstrap, topic=dlq_conf.topic or f"{kafka.topic}-dlq")
    else:
        dlq = WriteDeadLetters("postgres", dsn=pg.dsn, table=pg.dead_letters_table)
    dead_letters_written = dead_letters | "WriteDeadLetters" >> dlq
    if bounded:
        # Every sink's last step: the quarantine writes end in dead letters, which end in the DLQ.
        records | "CommitOffsetsAfterSinks" >> CommitOffsetsAfter(
            kafka.bootstrap,
            kafka.group_id,
            after=[iceberg, sessions_written, dead_letters_written],
            backend=kafka.backend,
        )
    return ClicksJob(records, dedup.unique, dead_letters, dedup.quarantine, sessions)


def _first_copy_table(config: JobConfig) -> FirstCopyTable | None:
    """The dedup's PostgreSQL table for ``dedup.strategy`` ``auto`` (the default) or ``store``.

    Why the store in every mode: on portable runners per-key state is a blocking round trip per event, while the
    table is one transaction per bundle; and it remembers first copies across restores and across bounded runs, so a
    duplicate whose original came in an earlier run is quarantined too (a per-run grouping cannot see it, and the
    sessions would count it twice). ``grouped`` and ``state`` keep the runner-only strategies.
    """
    if config.dedup.strategy in ("auto", "store"):
        pg = required(config.postgres, "postgres")
        return FirstCopyTable(pg.dsn, pg.first_copies)
    return None


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m pipelines.clicks", description=__doc__.split("\n")[0])
    parser.add_argument("--conf", default=DEFAULT_CONF, help="job configuration YAML (default: %(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--runner", default="DirectRunner", help="DirectRunner (pinned local runner) or FlinkRunner")
    parser.add_argument(
        "--start-services",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start the local services the conf's `auto` endpoints name before running (default: yes; with "
        "--no-start-services an `auto` service that is not running is an error)",
    )
    parser.add_argument(
        "--attached",
        action="store_true",
        help="FlinkRunner: wait until the job ends (default: return once it runs; LOOPBACK jobs always wait)",
    )
    return parser.parse_known_args(argv)


def pipeline_options(runner: str, beam_args: Sequence[str], config: JobConfig | Mapping[str, Any]) -> Any:
    job = as_job_config(config)
    if runner == "FlinkRunner":
        from runners.flink import flink_options

        return flink_options(job.flink.settings() if job.flink else {}, beam_args)
    if runner not in ("DirectRunner", "FnApiRunner"):
        raise SystemExit(f"unknown --runner {runner}: use DirectRunner or FlinkRunner")
    if not (job.kafka and job.kafka.bounded):
        # FnApiRunner runs stage after stage: the read of a stream never finishes, so nothing after it ever runs.
        raise SystemExit(
            "kafka.bounded=false needs a streaming runner: the local runner (FnApiRunner) runs stage after stage "
            "and would write nothing; use --runner=FlinkRunner, or Prism (runners/prism.py), to stream"
        )
    from runners.direct import local_options

    return local_options(beam_args)


def run_with_config(
    config: JobConfig | Mapping[str, Any],
    runner: str = "DirectRunner",
    beam_args: Sequence[str] = (),
    attached: bool = True,
) -> PipelineResult:
    """Builds and runs the job for an already resolved config.

    Waits until it finishes, except a Flink job with ``attached=False`` whose workers run beside the TaskManagers:
    that returns once the job runs, and the job goes on without this process.
    """
    job = as_job_config(config)
    if runner == "FlinkRunner" and not (job.flink and job.flink.job_name):
        job = job.with_flink(job_name=job.job.name)
    flink = job.flink.settings() if job.flink else {}
    if runner == "FlinkRunner":
        from runners.flink import SubmissionError, check_reachable

        try:
            check_reachable(flink)
        except SubmissionError as exc:
            raise SystemExit(f"beamflow: {exc}") from None
    p = beam.Pipeline(options=pipeline_options(runner, beam_args, job))
    build_pipeline(p, job)
    result = p.run()
    if runner == "FlinkRunner" and not attached:
        from runners.flink import environment_kind, wait_until_running

        if environment_kind(flink.get("environment", "LOOPBACK")) != "LOOPBACK":
            job_name = p.options.get_all_options(retain_unknown_options=True).get("job_name") or flink.get("job_name")
            state = wait_until_running(result, job_name, flink.get("rest_url"))
            _LOG.info(
                "job %s is %s on the Flink cluster; this process may exit (`beamflow flink jobs` lists it)",
                job_name,
                state,
            )
            return result
    result.wait_until_finish()
    return result


def for_runner(config: JobConfig | Mapping[str, Any], runner: str) -> JobConfig:
    """The job's config as ``runner`` runs it.

    A streaming Flink job reads the topic as a stream: ``kafka.bounded`` (true in ``conf/clicks.yaml`` for the local
    demo) applies to local and batch runs only. A bounded read inside a streaming job would never let its
    end-of-input groupings fire (sources stay up for checkpoints), and its after-the-sinks commit needs side inputs
    that Beam's Flink runner cannot checkpoint in streaming mode. ``flink.streaming=false`` runs a bounded batch job.
    """
    job = as_job_config(config)
    if runner != "FlinkRunner":
        return dataclasses.replace(job, flink=None)
    kafka = required(job.kafka, "kafka")
    if (job.flink is None or job.flink.streaming) and kafka.bounded:
        _LOG.info("streaming Flink job: reading %s as a stream (kafka.bounded applies to batch runs)", kafka.topic)
        job = dataclasses.replace(job, kafka=dataclasses.replace(kafka, bounded=False))
    return job


def run(argv: Sequence[str] | None = None) -> PipelineResult:
    args, beam_args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        config = for_runner(load_job_config(args.conf, args.set), args.runner)
        if args.start_services:
            # Explicit: the local services this run's `auto` endpoints name (already running ones are left as they are).
            started = start_services(config)
            if started:
                _LOG.info("local services for the conf's auto endpoints: %s (running)", ", ".join(started))
        config = resolve_auto(config)
    except ConfigError as exc:
        raise SystemExit(f"beamflow: {exc}") from None
    return run_with_config(config, args.runner, beam_args, attached=args.attached)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("apache_beam").setLevel(logging.WARNING)
    run(argv)
    return 0


if __name__ == "__main__":
    # Run the importable module, not this __main__ copy: the job's functions are then pickled by reference to
    # pipelines.clicks, which Python workers beside the TaskManagers import, instead of by value without their globals.
    from pipelines.clicks import main as _main

    sys.exit(_main())

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

import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
from apache_beam.runners.runner import PipelineResult
from apache_beam.transforms.window import Sessions

from beamflow.aggregates import SessionClicksFn
from beamflow.config import JobConfig, as_job_config, required
from beamflow.generate import load_click_schema
from beamflow.iceberg.catalog import CatalogConfig
from beamflow.postgres.sessions import sessions_spec as _sessions_table_spec
from beamflow.postgres.table import TableSpec
from pipelines.common import (
    JobRunner,
    dead_letter_sink,
    epoch_ms_event,
    first_copy_table,
    quarantine_row,
    quarantine_spec,
    read_records,
)
from pipelines.common import utc as _utc
from transforms.attach_event_id import AttachEventId
from transforms.commit_offsets_after import CommitOffsetsAfter
from transforms.decode_avro import DecodeAvro
from transforms.deduplicate import DeduplicateEvents
from transforms.hot_key_aggregate import HotKeyAggregate, WindowedAggregate
from transforms.write_dead_letters import dead_letter_spec
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
    return epoch_ms_event(decoded)


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
    # A bounded run commits after its sinks (CommitOffsetsAfter below); a streaming one on finalization.
    records = read_records(p, job, "ReadClicks")
    decoded = records | "DecodeAvro" >> DecodeAvro(
        registry.url, reader_schema=load_click_schema(2), ca_file=registry.ca_file
    )
    identified = (
        decoded.decoded
        | "ToClickEvents" >> beam.Map(click_event)
        | "WithEventId" >> AttachEventId(fields=EVENT_ID_FIELDS)
    )
    dedup = identified.events | "Deduplicate" >> DeduplicateEvents(
        ttl=dedup_conf.ttl_s,
        table=first_copy_table(job),
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
            known_keys_max=ice.known_keys_max,
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
            # The read's rebalance spreads a user's events over every subtask; routed by user, one subtask folds
            # and writes each user's sessions (at p2: a quarter fewer rows stored, half as many replaced, no lock
            # waits between the writers; docs/streaming.md).
            route_by_key=sessions_conf.route_by_user and not bounded,
        )
    )
    # Merged with the stored sessions they touch (superseded windows, earlier runs, replays) in one transaction.
    sessions_written = (
        sessions
        | "ToSessionRows" >> beam.Map(session_row)
        | "WriteSessions" >> WriteSessions(pg.dsn, pg.sessions_table, batch_rows=sessions_conf.batch_rows)
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
    dlq = dead_letter_sink(job)
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


JOB = JobRunner("python -m pipelines.clicks", __doc__.split("\n")[0], DEFAULT_CONF, build_pipeline, _LOG)


def parse_args(argv: Sequence[str]) -> tuple[Any, list[str]]:
    return JOB.parse_args(argv)


def pipeline_options(runner: str, beam_args: Sequence[str], config: JobConfig | Mapping[str, Any]) -> Any:
    return JOB.pipeline_options(runner, beam_args, config)


def run_with_config(
    config: JobConfig | Mapping[str, Any],
    runner: str = "DirectRunner",
    beam_args: Sequence[str] = (),
    attached: bool = True,
) -> PipelineResult:
    """Builds and runs the job for an already resolved config (``JobRunner.run_with_config``)."""
    return JOB.run_with_config(config, runner, beam_args, attached)


def for_runner(config: JobConfig | Mapping[str, Any], runner: str) -> JobConfig:
    """The job's config as ``runner`` runs it (``JobRunner.for_runner``: a streaming Flink job reads a stream)."""
    return JOB.for_runner(config, runner)


def run(argv: Sequence[str] | None = None) -> PipelineResult:
    return JOB.run(list(sys.argv[1:] if argv is None else argv))


def main(argv: Sequence[str] | None = None) -> int:
    return JOB.main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    # Run the importable module, not this __main__ copy: the job's functions are then pickled by reference to
    # pipelines.clicks, which Python workers beside the TaskManagers import, instead of by value without their globals.
    from pipelines.clicks import main as _main

    sys.exit(_main())

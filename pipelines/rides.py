"""The rides job (seed 002): rides from Kafka, enriched with drivers and zones, in driver sessions, to Kafka + cells.

::

    python -m pipelines.rides                       # pinned local runner against the local services
    python -m pipelines.rides --runner=FlinkRunner  # the same job on the Flink session cluster
    python -m pipelines.rides --conf conf/rides.yaml --set lookups.zones.on_missing=dead_letter

Stages: ReadFromKafka (idle partitions stop holding the watermark back after ``kafka.idle_timeout_ms``; offsets
committed on finalize when streaming, after the sinks when bounded) -> DecodeAvro through the registry -> AttachEventId
from the ride's identifying fields -> DeduplicateEvents (later copies to the quarantine table) -> one ``Enrich`` per
``lookups:`` entry (``drivers``, then ``zones``: batched ``ANY(%s)`` lookups, bounded in flight, cached per worker;
an unknown key follows the lookup's ``on_missing``) -> the lateness check -> session windows per driver
(``HotKeyAggregate``: lifted in a bounded batch run, windowed with hot-key fanout and late panes in a stream) -> each
session result to the ``kafka_sink`` topic (``WriteToKafka``, JSON, keyed by driver) and to the ``cells`` table
(``WriteVersionedCells``: buffered mutations, salted row keys).

Where every input ends (what the demo audits): a ride is in exactly one session result, or in the dead-letter table
(undecodable; missing an identifying field; an unknown key under ``on_missing: dead_letter``; too late), or, as a
later copy of a ride already seen, in the quarantine table. Too late: a ride whose event time is more than
``sessions.allowed_lateness_s`` behind its record's timestamp (when it was sent) goes to the dead letters with its
lateness instead of being dropped silently by a window; the rule reads only the record, so a replay decides the same.
(In a stream the watermark can still pass a session before a ride within that bound arrives, e.g. behind an idle
partition's timeout; ``HotKeyAggregate`` counts such rides as ``late_dropped``.)

Results: one per driver, session window and pane, identified by ``result_id`` (driver, window, pane and a digest of
the rides it counts), which the exactly-once sink uses to skip a replayed result. A bounded batch run fires each
session once (pane 0). A stream's panes accumulate (a later pane of a session carries all its rides), and a late ride
can merge sessions: the merged result lists the windows it ``supersedes``; in the cells the superseded rows get an
``s:superseded_by`` cell. After a restore from a checkpoint a pane may fire again with other rides than before the
failure (the watermark met the replayed rides in another order): the rides' digest gives it another id, so it is
written too rather than skipped as a replay. A session written before the failure can also come back after the
restore in another shape (another start, no ``supersedes`` naming the old one: the restored windows never saw it).
So the reader's rule (``current_results``, what the demo and the drills audit both sinks with) goes by overlap, not by
window: of a driver's results whose windows overlap, the one with the most rides (then the higher pane) is current,
and every result it overlaps is not. Two current sessions of a driver never share a ride (a ride in two windows puts
them in overlap), and without failures the rule keeps what ``supersedes`` and the newest pane keep, since panes
accumulate and a merged session holds the rides of the windows it merged.
Cells: row ``<driver_id>#<session start ms, 13 digits>`` (salted), family ``s`` (the session) and ``d`` (the
driver), version = the session's ride count (a later pane of the same session start always holds more rides).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import operator
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.pvalue import TaggedOutput
from apache_beam.runners.runner import PipelineResult
from apache_beam.transforms.window import Sessions, TimestampedValue

from beamflow.aggregates import RideSession, RideSessionFn
from beamflow.config import JobConfig, LookupConfig, as_job_config, required
from beamflow.deadletter import DeadLetter, encode_payload
from beamflow.generate import RIDE_EVENT_ID_FIELDS, load_ride_schema
from beamflow.postgres.cells import Cell
from beamflow.postgres.lookups import PostgresTableLookup
from pipelines.common import (
    JobRunner,
    dead_letter_sink,
    epoch_ms_event,
    first_copy_table,
    quarantine_row,
    quarantine_spec,
    read_records,
)
from transforms.attach_event_id import AttachEventId
from transforms.commit_offsets_after import CommitOffsetsAfter
from transforms.decode_avro import DecodeAvro
from transforms.deduplicate import DeduplicateEvents
from transforms.enrich import Enrich
from transforms.hot_key_aggregate import HotKeyAggregate, WindowedAggregate
from transforms.sink_base import DEAD_LETTERS
from transforms.write_to_postgres import WriteToPostgres
from transforms.write_versioned_cells import WriteVersionedCells

__all__ = [
    "EVENT_ID_FIELDS",
    "RidesJob",
    "build_pipeline",
    "current_results",
    "for_runner",
    "main",
    "result_cells",
    "result_id",
    "run_with_config",
    "session_result",
]

_LOG = logging.getLogger("pipelines.rides")
DEFAULT_CONF = "conf/rides.yaml"
EVENT_ID_FIELDS = RIDE_EVENT_ID_FIELDS
LATENESS_STAGE = "rides:lateness"
# The lookups the sessions carry columns of: the driver's (all its columns) and the zone's (its first column tells
# a known zone from an unknown one). Other lookups in the conf enrich the rides without reaching the sessions.
DRIVERS, ZONES = "drivers", "zones"
SESSION_FAMILY, DRIVER_FAMILY = "s", "d"


def ride_event(decoded: dict[str, Any]) -> dict[str, Any]:
    """A decoded ride with its event time as epoch milliseconds."""
    return epoch_ms_event(decoded)


class _OnTime(beam.DoFn):
    """Stamps each ride with its event time; a ride later than the allowed lateness goes to the dead letters.

    Lateness is the ride's record timestamp (when it was sent) minus its event time: a property of the record, so
    the same ride is judged the same way in every run and replay, whatever the watermark did meanwhile.
    """

    def __init__(self, allowed_lateness_ms: int) -> None:
        self._allowed_ms = allowed_lateness_ms
        self._too_late = Metrics.counter("beamflow.rides", "too_late")

    def process(self, ride: dict[str, Any]) -> Iterator[Any]:
        kafka = ride.get("_kafka") or {}
        sent_ms = kafka.get("timestamp_ms")
        late_ms = sent_ms - ride["event_time"] if isinstance(sent_ms, int) else 0
        if late_ms > self._allowed_ms:
            self._too_late.inc()
            yield TaggedOutput(
                DEAD_LETTERS,
                DeadLetter(
                    encode_payload(ride),
                    LATENESS_STAGE,
                    f"too late: event time {late_ms / 1000:.0f}s behind its record's timestamp, allowed lateness "
                    f"{self._allowed_ms / 1000:.0f}s",
                    topic=kafka.get("topic"),
                    partition=kafka.get("partition"),
                    offset=kafka.get("offset"),
                    error="TooLate",
                ),
            )
            return
        yield TimestampedValue(ride, ride["event_time"] / 1000.0)


def session_input(ride: dict[str, Any], carried: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """(driver_id, what RideSessionFn reads): only those fields cross the sessions' shuffle, not the whole ride."""
    kafka = ride["_kafka"]
    value = {name: ride.get(name) for name in ("event_id", "event_time", "fare", "distance_km", "zone_id", *carried)}
    value["kafka_partition"], value["kafka_offset"] = kafka["partition"], kafka["offset"]
    return ride["driver_id"], value


def _ms(ts: Any) -> int:
    return int(ts.micros // 1000)


def result_id(driver_id: str, start_ms: int, end_ms: int, pane_index: int, ride_offsets: str = "") -> str:
    """The identity of one result across replays: a replayed pane of the same rides has the same; a later pane, another
    window, or the same pane fired again over other rides after a restore, another."""
    digest = hashlib.blake2b(ride_offsets.encode(), digest_size=6).hexdigest()
    return f"{driver_id}/{start_ms}/{end_ms}/{pane_index}/{digest}"


def session_result(agg: WindowedAggregate, driver_columns: tuple[str, ...]) -> dict[str, Any]:
    """One session pane as the job's result (what the Kafka topic carries as JSON and the cells store)."""
    session: RideSession = agg.value
    start_ms, end_ms = _ms(agg.window_start), _ms(agg.window_end)
    driver = dict(zip(driver_columns, session.driver[1:], strict=False)) if session.driver else {}
    return {
        "result_id": result_id(agg.key, start_ms, end_ms, agg.pane_index, session.ride_offsets.encode()),
        "driver_id": agg.key,
        **{c: driver.get(c) for c in driver_columns},
        "session_start": start_ms,
        "session_end": end_ms,
        "rides": session.rides,
        "fare_total": session.fare_total,
        "distance_km": session.distance_km,
        "first_ride": session.first_ride_time,
        "last_ride": session.last_ride_time,
        "zones": sorted(session.zones),
        "unknown_zone_rides": session.unknown_zone_rides,
        "pane_index": agg.pane_index,
        "is_final": agg.is_last,
        "supersedes": [[_ms(s), _ms(e)] for s, e in agg.supersedes],
        "ride_offsets": session.ride_offsets.encode(),
    }


def current_results(results: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The results a reader counts: per driver, of results whose session windows overlap, the one with the most
    rides (then the higher pane index, then the later end) wins and those it overlaps drop out; windows a merged result
    ``supersedes`` drop out too. Order-free: results from the topic (any partition order) and rows from the cells give
    the same answer. Why overlap and not the window: after a restore a session may fire again with another start
    than before the failure, and the stale result never gets a ``supersedes`` naming it (module docstring)."""
    superseded = {(r["driver_id"], int(s), int(e)) for r in results for s, e in r.get("supersedes", ())}
    by_driver: dict[str, list[Mapping[str, Any]]] = {}
    for r in results:
        if (r["driver_id"], int(r["session_start"]), int(r["session_end"])) not in superseded:
            by_driver.setdefault(str(r["driver_id"]), []).append(r)
    current: list[Mapping[str, Any]] = []
    for driver_results in by_driver.values():
        kept: list[Mapping[str, Any]] = []
        ranked = sorted(
            driver_results, key=lambda r: (int(r["rides"]), int(r["pane_index"]), int(r["session_end"])), reverse=True
        )
        for r in ranked:
            start, end = int(r["session_start"]), int(r["session_end"])
            if all(end <= int(k["session_start"]) or int(k["session_end"]) <= start for k in kept):
                kept.append(r)
        current += kept
    return current


def result_row_key(driver_id: str, start_ms: int) -> bytes:
    """The cells' row key (before salting): a driver's sessions sort by start within the driver."""
    return f"{driver_id}#{start_ms:013d}".encode()


# The session's cells (family s) and the driver's (family d), by result field.
_SESSION_CELLS = (
    "session_end",
    "rides",
    "fare_total",
    "distance_km",
    "first_ride",
    "last_ride",
    "zones",
    "unknown_zone_rides",
    "pane_index",
    "ride_offsets",
    "result_id",
)


def result_cells(result: Mapping[str, Any], driver_columns: tuple[str, ...]) -> list[Cell]:
    """A result as versioned cells; the version is the ride count, so the newest pane of a session start wins.

    A merged session also marks each window it supersedes (``s:superseded_by``) at the version of the merged one.
    """
    version = int(result["rides"])
    row = result_row_key(result["driver_id"], result["session_start"])

    def text(value: Any) -> bytes:
        return (value if isinstance(value, str) else json.dumps(value)).encode()

    cells = [Cell(row, f"{SESSION_FAMILY}:{name}", version, text(result[name])) for name in _SESSION_CELLS]
    cells += [Cell(row, f"{DRIVER_FAMILY}:{c}", version, text(result.get(c))) for c in driver_columns]
    merged = text([result["session_start"], result["session_end"]])
    for start_ms, _end_ms in result["supersedes"]:
        if start_ms != result["session_start"]:
            old = result_row_key(result["driver_id"], start_ms)
            cells.append(Cell(old, f"{SESSION_FAMILY}:superseded_by", version, merged))
    return cells


def producer_record(result: Mapping[str, Any]) -> Any:
    """A result as the Kafka sink's record: JSON value, keyed by driver (one driver's results stay in order in one
    partition), identified by ``result_id``, timestamped at the session's last ride."""
    from beamflow.kafka.producer import ProducerRecord

    return ProducerRecord(
        value=json.dumps(result, sort_keys=True).encode(),
        key=str(result["driver_id"]).encode(),
        record_id=str(result["result_id"]),
        timestamp_ms=result["last_ride"],
    )


def lookup_handler(dsn: str, lookup: LookupConfig) -> PostgresTableLookup:
    return PostgresTableLookup(
        dsn,
        lookup.table,
        key_column=lookup.key_column or lookup.key_field,
        columns=lookup.columns,
        timeout_s=lookup.timeout_s,
        pool_size=lookup.max_in_flight,
    )


def _enrich(lookup: LookupConfig, dsn: str, name: str) -> Enrich:
    return Enrich(
        lookup_handler(dsn, lookup),
        key_field=lookup.key_field,
        on_missing=lookup.on_missing,
        max_batch_size=lookup.max_batch_size,
        max_in_flight=lookup.max_in_flight,
        cache_size=lookup.cache_size,
        cache_ttl_s=lookup.cache_ttl_s,
        missing_ttl_s=lookup.missing_ttl_s,
        label=f"Enrich{name.title()}",
    )


@dataclass
class RidesJob:
    """The pipeline's outputs, for tests and the demo."""

    read: beam.PCollection
    unique: beam.PCollection
    enriched: beam.PCollection
    dead_letters: beam.PCollection
    quarantine: beam.PCollection
    results: beam.PCollection


def build_pipeline(p: beam.Pipeline, config: JobConfig | Mapping[str, Any]) -> RidesJob:
    job = as_job_config(config)
    kafka, pg, registry = required(job.kafka, "kafka"), required(job.postgres, "postgres"), job.registry
    sessions_conf = job.sessions
    for name in (DRIVERS, ZONES):
        if name not in job.lookups:
            raise ValueError(f"the rides job needs a lookups.{name} section (the sessions carry its columns)")
    driver_columns = job.lookups[DRIVERS].columns
    zone_column = job.lookups[ZONES].columns[0]

    bounded = kafka.bounded
    records = read_records(p, job, "ReadRides")
    registry = required(registry, "registry")
    decoded = records | "DecodeAvro" >> DecodeAvro(registry.url, load_ride_schema(), ca_file=registry.ca_file)
    identified = (
        decoded.decoded | "ToRideEvents" >> beam.Map(ride_event) | "WithEventId" >> AttachEventId(EVENT_ID_FIELDS)
    )
    dedup = identified.events | "Deduplicate" >> DeduplicateEvents(
        ttl=job.dedup.ttl_s, table=first_copy_table(job), strategy=job.dedup.strategy
    )

    rides, lookup_dead = dedup.unique, list[beam.PCollection]()
    for name, lookup in job.lookups.items():
        enriched = rides | f"Enrich{name.title()}" >> _enrich(lookup, pg.dsn, name)
        rides, lookup_dead = enriched.enriched, [*lookup_dead, enriched.dead_letters]
    on_time = rides | "ByEventTime" >> beam.ParDo(_OnTime(sessions_conf.allowed_lateness_s * 1000)).with_outputs(
        DEAD_LETTERS, main="rides"
    )

    carried = (*driver_columns, zone_column)
    sessions = (
        on_time.rides
        | "KeyByDriver" >> beam.Map(session_input, carried=carried)
        | "DriverSessions"
        >> HotKeyAggregate(
            RideSessionFn(driver_columns, zone_column),
            windowfn=Sessions(sessions_conf.gap_s),
            # auto: lifted in a bounded batch run (each session fires once, every driver pre-aggregated per bundle),
            # windowed in a stream (hot drivers fanned out, late panes within the allowed lateness).
            strategy="auto",
            hot_keys=sessions_conf.hot_keys,
            fanout=sessions_conf.fanout,
            allowed_lateness=sessions_conf.allowed_lateness_s,
            shard_by=operator.itemgetter("event_id"),
        )
    )
    results = sessions | "ToResults" >> beam.Map(session_result, driver_columns=driver_columns)

    written: list[Any] = []
    sink_dead: list[beam.PCollection] = []
    if job.kafka_sink is not None:
        kafka_written = (
            results | "ToProducerRecords" >> beam.Map(producer_record) | "WriteResultsToKafka" >> (_kafka_sink(job))
        )
        written.append(kafka_written)
        sink_dead.append(kafka_written.dead_letters)
    if job.cells is not None:
        cells = job.cells
        cells_written = (
            results
            | "ToCells" >> beam.FlatMap(functools.partial(result_cells, driver_columns=driver_columns))
            | "WriteResultCells"
            >> WriteVersionedCells(
                pg.dsn,
                cells.table,
                max_cells=cells.max_cells,
                max_bytes=cells.max_bytes,
                max_seconds=cells.max_seconds,
                salt_buckets=cells.salt_buckets,
            )
        )
        written.append(cells_written)
        sink_dead.append(cells_written.dead_letters)

    quarantine_written = (
        dedup.quarantine
        | "ToQuarantineRows" >> beam.Map(quarantine_row)
        | "WriteQuarantine" >> WriteToPostgres(pg.dsn, quarantine_spec(pg.quarantine_table), create=True)
    )
    dead_letters = (
        decoded.dead_letters,
        identified.dead_letters,
        *lookup_dead,
        on_time[DEAD_LETTERS],
        *sink_dead,
        quarantine_written.dead_letters,
    ) | "AllDeadLetters" >> beam.Flatten()
    dead_letters_written = dead_letters | "WriteDeadLetters" >> dead_letter_sink(job)
    if bounded:
        # After every sink: the quarantine writes end in dead letters, which end in the DLQ.
        records | "CommitOffsetsAfterSinks" >> CommitOffsetsAfter(
            kafka.bootstrap, kafka.group_id, after=[*written, dead_letters_written], backend=kafka.backend
        )
    return RidesJob(records, dedup.unique, rides, dead_letters, dedup.quarantine, results)


def _kafka_sink(job: JobConfig) -> beam.PTransform:
    """``transforms.WriteToKafka`` as ``kafka_sink:`` says. Exactly-once: the transactional shards and the ledger of
    written result ids (in ``postgres.dsn``); at-least-once: the idempotent producer, nothing else."""
    from transforms.write_to_kafka import WriteToKafka

    sink, kafka = required(job.kafka_sink, "kafka_sink"), required(job.kafka, "kafka")
    exactly_once: dict[str, Any] = {}
    if sink.mode == "exactly-once":
        exactly_once = {
            "sink_group": sink.group,
            "ledger_dsn": required(job.postgres, "postgres").dsn,
            "ledger_table": sink.ledger_table,
            "shards": sink.shards,
        }
        if kafka.bounded:
            # A bounded batch run flushes every shard's last batch when its input ends; the buffering timer (a
            # processing-time timer) is for streams. The local runner leaves such a timer pending when it runs out of
            # other work first (a small run: "time-pending bundles did not execute") and fails the pipeline.
            exactly_once["max_buffering_s"] = None
    return WriteToKafka(
        sink.bootstrap or kafka.bootstrap,
        sink.topic,
        mode=sink.mode,
        producer_config=dict(sink.producer_config) or None,
        timestamps=sink.timestamps,
        **exactly_once,
    )


JOB = JobRunner("python -m pipelines.rides", __doc__.split("\n")[0], DEFAULT_CONF, build_pipeline, _LOG)


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


def main(argv: Sequence[str] | None = None) -> int:
    return JOB.main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    # Run the importable module, not this __main__ copy, so the job's functions pickle by reference (pipelines.rides).
    from pipelines.rides import main as _main

    sys.exit(_main())

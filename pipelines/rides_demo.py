"""The rides job's demo (``beamflow demo --job rides``): services up, dimension tables seeded, ride traffic with every
kind of trouble generated, ``pipelines.rides`` run, and an audit of both sinks against the traffic.

The summary checks the job's contract, not just that it ran. Every produced record is a ride counted in exactly one
session result, a dead letter (undecodable, unknown driver, too late) or a quarantined duplicate. The output topic is
read back by a plain confluent-kafka ``read_committed`` consumer (``read_committed``): no result id twice, and the
rides' Kafka coordinates of all results together hold each counted ride once; the cell store's newest cells do the
same. The sessions equal those of one pass over each batch's expected rides, computed from the generated traffic
(``expected_sessions``), and the dead letters are exactly the unknown-driver and too-late rides and bad records.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from beamflow.config import JobConfig, as_job_config, load_job_config, required, resolve_auto
from beamflow.generate import (
    GeneratedTraffic,
    RideTrafficSpec,
    avro_ride_encoder,
    generate_traffic,
    produce_traffic,
    ride_dimensions,
    seed_ride_dimensions,
)
from beamflow.kafka.offset_ranges import OffsetRanges
from beamflow.services import ServiceSet
from pipelines.demo_common import address, drop_tables, drop_topics, left_behind, start_needed, stop_command, table
from pipelines.rides import current_results

__all__ = [
    "RidesSummary",
    "audit_cells",
    "audit_results",
    "dead_letters_by_cause",
    "expected_outcome",
    "main",
    "read_committed",
    "reset_job_state",
    "run_demo",
]

# (driver, session start ms, session end ms, rides)
SessionKey = tuple[str, int, int, int]


@dataclass
class ResultsAudit:
    """What a read of the result topic or of the cell store found."""

    results: int = 0  # records (topic) or session rows (cells)
    distinct_ids: int = 0  # distinct result ids among them
    rides: int = 0  # the rides the current results count, summed (pipelines.rides.current_results)
    distinct_rides: int = 0  # the distinct Kafka coordinates among them
    unknown_zone_rides: int = 0
    sessions: list[SessionKey] = field(default_factory=list)

    @property
    def each_once(self) -> bool:
        return self.results == self.distinct_ids and self.rides == self.distinct_rides


@dataclass
class RidesSummary:
    produced: int
    produced_counts: dict[str, int]
    read: int
    dead_letters: dict[str, int]  # by cause: undecodable, unknown_driver, too_late, other
    quarantined: int
    topic: ResultsAudit
    cells: ResultsAudit
    expected: dict[str, Any]
    seconds: float
    runs: int = 1
    left_running: dict[str, str] = field(default_factory=dict)
    data_dir: str = ""
    stop_command: str = ""

    @property
    def dead_total(self) -> int:
        return sum(self.dead_letters.values())

    @property
    def balanced(self) -> bool:
        return self.produced == self.topic.distinct_rides + self.dead_total + self.quarantined

    @property
    def dead_letters_match(self) -> bool:
        e = self.expected
        return (
            self.dead_letters.get("undecodable", 0) == e["bad_records"]
            and self.dead_letters.get("unknown_driver", 0) == e["unknown_driver_rides"]
            and self.dead_letters.get("too_late", 0) == e["too_late_rides"]
            and self.dead_letters.get("other", 0) == 0
        )

    @property
    def sessions_match(self) -> bool:
        expected = self.expected["sessions"]
        return self.topic.sessions == expected and self.cells.sessions == expected

    @property
    def ok(self) -> bool:
        return (
            self.balanced
            and self.topic.each_once
            and self.cells.each_once
            and self.dead_letters_match
            and self.sessions_match
            and self.topic.unknown_zone_rides == self.cells.unknown_zone_rides == self.expected["unknown_zone_rides"]
            and self.quarantined == self.produced_counts.get("duplicate_sends", 0)
        )

    def rows(self) -> list[tuple[str, str]]:
        c, d, e = self.produced_counts, self.dead_letters, self.expected

        def n(value: int) -> str:
            return f"{value:,}"

        return [
            ("records produced", n(self.produced)),
            ("  ride events", n(c.get("events", 0))),
            (
                "  of which unknown driver / unknown zone",
                f"{c.get('unknown_driver_events', 0)} / {c.get('unknown_zone_events', 0)}",
            ),
            ("  of which late / too late", f"{c.get('late_events', 0)} / {c.get('too_late_events', 0)}"),
            ("  duplicate sends", n(c.get("duplicate_sends", 0))),
            ("  bad records", n(c.get("bad_records", 0))),
            ("records read from Kafka", n(self.read)),
            ("quarantined as duplicates", n(self.quarantined)),
            ("dead-lettered: undecodable", n(d.get("undecodable", 0))),
            ("dead-lettered: unknown driver (policy dead_letter)", n(d.get("unknown_driver", 0))),
            ("dead-lettered: too late", n(d.get("too_late", 0))),
            ("dead-lettered: other", n(d.get("other", 0))),
            ("rides in sessions, expected", n(e["session_rides"])),
            ("results in the topic (read_committed)", n(self.topic.results)),
            ("  distinct result ids", n(self.topic.distinct_ids)),
            ("  rides counted / distinct rides", f"{self.topic.rides:,} / {self.topic.distinct_rides:,}"),
            ("  rides with an unknown zone (policy pass)", n(self.topic.unknown_zone_rides)),
            ("session rows in the cell store", n(self.cells.results)),
            ("  rides counted / distinct rides", f"{self.cells.rides:,} / {self.cells.distinct_rides:,}"),
            ("sessions expected (one pass per run)", n(len(e["sessions"]))),
            ("job runs", n(self.runs)),
            ("throughput (records/s, whole job)", f"{self.read / self.seconds:,.0f}" if self.seconds else "-"),
            ("produced = distinct rides + dead + quarantined", "yes" if self.balanced else "NO"),
            ("each result and ride once (topic, cells)", _yes(self.topic.each_once and self.cells.each_once)),
            ("dead letters exactly the expected ones", _yes(self.dead_letters_match)),
            ("sessions (topic, cells) = expected", _yes(self.sessions_match)),
        ]

    def table(self) -> str:
        return table(self.rows())

    def left_behind(self) -> str:
        return left_behind(self.left_running, self.data_dir, self.stop_command, "topics, tables, service logs")


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def _tables(job: JobConfig) -> list[str]:
    pg = required(job.postgres, "postgres")
    tables = [pg.dead_letters_table, pg.quarantine_table, pg.first_copies]
    tables += [lookup.table for lookup in job.lookups.values()]
    if job.cells is not None:
        tables.append(job.cells.table)
    if job.kafka_sink is not None:
        tables.append(job.kafka_sink.ledger_table)
    return tables


def reset_job_state(config: JobConfig | Mapping[str, Any]) -> None:
    """Drops the demo's topics and tables (the dimension tables too) so a rerun starts from nothing."""
    job = as_job_config(config)
    kafka, pg = required(job.kafka, "kafka"), required(job.postgres, "postgres")
    topics = [kafka.topic] + ([job.kafka_sink.topic] if job.kafka_sink else [])
    drop_topics(kafka.bootstrap, topics)
    drop_tables(pg.dsn, _tables(job))


def read_committed(bootstrap: str, topic: str, timeout_s: float = 60.0) -> list[Any]:
    """Every record of ``topic`` a ``read_committed`` consumer sees: a plain confluent-kafka loop from the beginning
    of each partition up to its last stable offset (the end once no transaction is open)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"audit-{time.time_ns()}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        at_end: set[int] = set()
        out: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while len(at_end) < len(partitions):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: partitions {sorted(set(partitions) - at_end)} did not reach their end")
            message = consumer.poll(0.5)
            if message is None:
                continue
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:  # up to the last stable offset
                    at_end.add(int(message.partition() or 0))
                    continue
                raise RuntimeError(f"{topic}: {error}")
            at_end.discard(int(message.partition() or 0))
            out.append(message)
        return out
    finally:
        consumer.close()


def _audit(results: Sequence[Mapping[str, Any]]) -> ResultsAudit:
    """Counts the results, and the rides of the current ones (``pipelines.rides.current_results``: of a driver's
    overlapping session windows the one with the most rides; a bounded batch run has one pane per session)."""
    audit = ResultsAudit(results=len(results), distinct_ids=len({str(r["result_id"]) for r in results}))
    coordinates = OffsetRanges()
    for r in current_results(results):
        audit.rides += int(r["rides"])
        audit.unknown_zone_rides += int(r["unknown_zone_rides"])
        coordinates = coordinates | OffsetRanges.decode(r["ride_offsets"])
        audit.sessions.append((str(r["driver_id"]), int(r["session_start"]), int(r["session_end"]), int(r["rides"])))
    audit.distinct_rides = len(coordinates)
    audit.sessions.sort()
    return audit


def audit_results(config: JobConfig | Mapping[str, Any]) -> ResultsAudit:
    """The result topic as a ``read_committed`` consumer sees it."""
    job = as_job_config(config)
    sink, kafka = required(job.kafka_sink, "kafka_sink"), required(job.kafka, "kafka")
    return _audit([json.loads(m.value()) for m in read_committed(sink.bootstrap or kafka.bootstrap, sink.topic)])


def audit_cells(config: JobConfig | Mapping[str, Any]) -> ResultsAudit:
    """The newest cells of every session row of the cell store (rows marked superseded left out)."""
    from beamflow.postgres.cells import PostgresCellStore, RowKeySalter

    job = as_job_config(config)
    cells, pg = required(job.cells, "cells"), required(job.postgres, "postgres")
    store = PostgresCellStore(cells.table, dsn=pg.dsn, create=False)
    salter = RowKeySalter(cells.salt_buckets) if cells.salt_buckets else None
    wanted = ("result_id", "rides", "ride_offsets", "unknown_zone_rides", "session_end", "pane_index", "superseded_by")
    rows: dict[bytes, dict[str, Any]] = {}
    try:
        for cell in store.scan(columns=[f"s:{q}" for q in wanted]):
            rows.setdefault(cell.row, {})[cell.column.split(":", 1)[1]] = cell.value.decode()
    finally:
        store.close()
    results = []
    for row, values in rows.items():
        if "superseded_by" in values:
            continue
        driver, _, start = (salter.unsalt(row) if salter else row).decode().rpartition("#")
        results.append(
            {
                "result_id": values["result_id"],
                "driver_id": driver,
                "session_start": int(start),
                "session_end": int(values["session_end"]),
                "rides": int(values["rides"]),
                "unknown_zone_rides": int(values["unknown_zone_rides"]),
                "ride_offsets": values["ride_offsets"],
                "pane_index": int(values["pane_index"]),
            }
        )
    return _audit(results)


def expected_outcome(
    batches: Iterable[GeneratedTraffic], known_drivers: set[str], gap_ms: int, allowed_lateness_ms: int
) -> dict[str, Any]:
    """What the job must produce from the generated batches, each run over one batch: the sessions of each batch's
    rides by known drivers that are not too late, and the rides each policy sends to the dead letters."""
    out: dict[str, Any] = Counter()
    sessions: list[SessionKey] = []
    for batch in batches:
        mine: dict[str, list[int]] = {}
        for r in batch.records:
            if r.kind.startswith("bad:"):
                out["bad_records"] += 1
            if r.kind != "event" or r.event is None:
                continue
            ride = r.event
            if ride["driver_id"] not in known_drivers:  # dead letter (drivers: on_missing dead_letter)
                out["unknown_driver_rides"] += 1
            elif r.timestamp_ms - ride["event_time"] > allowed_lateness_ms:
                out["too_late_rides"] += 1
            else:
                out["session_rides"] += 1
                out["unknown_zone_rides"] += ride["zone_id"].startswith("zx")
                mine.setdefault(ride["driver_id"], []).append(ride["event_time"])
        for driver, times in mine.items():
            ordered = sorted(times)
            start = count = 0
            for i, t in enumerate(ordered):
                if i == 0 or t >= ordered[i - 1] + gap_ms:
                    if i:
                        sessions.append((driver, start, ordered[i - 1] + gap_ms, count))
                    start, count = t, 0
                count += 1
            sessions.append((driver, start, ordered[-1] + gap_ms, count))
    for key in ("bad_records", "unknown_driver_rides", "too_late_rides", "session_rides", "unknown_zone_rides"):
        out.setdefault(key, 0)
    result = dict(out)
    result["sessions"] = sorted(sessions)
    return result


def dead_letters_by_cause(config: JobConfig) -> dict[str, int]:
    """The dead-letter table counted by cause, from the stage that wrote each: ``undecodable`` (DecodeAvro),
    ``unknown_driver`` (the drivers lookup), ``too_late`` (the lateness check), ``other`` (anything else)."""
    import psycopg
    from psycopg import sql

    from pipelines.rides import DRIVERS, LATENESS_STAGE
    from transforms.decode_avro import STAGE as DECODE_STAGE

    pg = required(config.postgres, "postgres")
    causes = {
        DECODE_STAGE: "undecodable",
        f"enrich:{config.lookups[DRIVERS].table}": "unknown_driver",
        LATENESS_STAGE: "too_late",
    }
    with psycopg.connect(pg.dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT stage, count(*) FROM {} GROUP BY stage").format(sql.Identifier(pg.dead_letters_table))
        ).fetchall()
    out: Counter[str] = Counter()
    for stage, n in rows:
        out[causes.get(str(stage), "other")] += int(n)
    return dict(out)


def _count(dsn: str, table_name: str) -> int:
    import psycopg
    from psycopg import sql

    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table_name))).fetchone()
    return int(row[0]) if row else 0


def run_demo(
    conf_path: str = "conf/rides.yaml",
    overrides: tuple[str, ...] = (),
    spec: RideTrafficSpec | None = None,
    services: ServiceSet | None = None,
    progress: Callable[[str], None] = print,
    runs: int = 1,
) -> RidesSummary:
    """Seeds the dimension tables, generates ``spec.events`` rides in ``runs`` batches (each starting far enough after
    the last that no session spans two runs), runs the job after each, and audits both sinks."""
    from apache_beam.metrics.metric import MetricsFilter

    import pipelines.rides as rides
    from beamflow.kafka.admin import create_topic

    services = services or ServiceSet()
    config = rides.for_runner(load_job_config(conf_path, overrides), "DirectRunner")
    needed = start_needed(config, services, progress)
    config = resolve_auto(config, services)
    kafka, registry, pg = required(config.kafka, "kafka"), required(config.registry, "registry"), config.postgres
    pg = required(pg, "postgres")
    progress("resetting the demo's topics and tables")
    reset_job_state(config)

    spec = spec or RideTrafficSpec(partitions=kafka.partitions or 4)
    dimensions = ride_dimensions(spec)
    seed_ride_dimensions(pg.dsn, dimensions, config.lookups["drivers"].table, config.lookups["zones"].table)
    progress(f"dimension tables: {len(dimensions.drivers)} drivers, {len(dimensions.zones)} zones")
    create_topic(kafka.bootstrap, kafka.topic, spec.partitions)
    if config.kafka_sink is not None:
        sink = config.kafka_sink
        create_topic(sink.bootstrap or kafka.bootstrap, sink.topic, sink.partitions or spec.partitions)
    encoder = avro_ride_encoder(registry.url, registry.subject or f"{kafka.topic}-value", registry.ca_file)
    gap_ms = config.sessions.gap_s * 1000
    per_run = max(1, spec.events // runs)
    span = spec.events * spec.step_ms + runs * (spec.late_by_ms + 2 * gap_ms)
    batch_spec = dataclasses.replace(
        spec, events=per_run, start_ms=spec.start_ms if spec.start_ms is not None else int(time.time() * 1000) - span
    )
    batches: list[GeneratedTraffic] = []
    seconds = 0.0
    read = 0
    for run in range(runs):
        if run:
            last = max(r.timestamp_ms for r in batches[-1].records)
            # Two gaps after the last batch, plus the late rides' lateness: no session of one batch can take a ride of
            # the next, so each run's sessions are final and one run over both batches finds the same ones.
            start = last + spec.late_by_ms + 2 * gap_ms
            batch_spec = dataclasses.replace(batch_spec, start_ms=start, seed=batch_spec.seed + 1)
        if run == runs - 1:
            batch_spec = dataclasses.replace(batch_spec, events=spec.events - per_run * (runs - 1))
        progress(
            f"batch {run + 1}/{runs}: {batch_spec.events:,} rides with hot drivers, duplicates, late and too-late "
            "rides, an idle partition, unknown drivers and zones, bad records"
        )
        traffic = generate_traffic(batch_spec, encoder)
        produce_traffic(kafka.bootstrap, kafka.topic, traffic)
        batches.append(traffic)
        progress(f"  produced {len(traffic.records):,} records: {traffic.summary()}")
        progress(f"  running pipelines.rides on the pinned local runner (FnApiRunner), run {run + 1}/{runs}")
        t0 = time.monotonic()
        result = rides.run_with_config(config)
        seconds += time.monotonic() - t0
        counters = result.metrics().query(MetricsFilter().with_name("records_read"))["counters"]
        read += sum(r.committed or 0 for r in counters)
        progress(f"  job finished in {time.monotonic() - t0:.1f}s")
    progress("auditing the output topic (read_committed), the cell store and the dead letters")
    expected = expected_outcome(
        batches,
        {d["driver_id"] for d in dimensions.drivers},
        gap_ms,
        config.sessions.allowed_lateness_s * 1000,
    )
    produced_counts: Counter[str] = Counter()
    for traffic in batches:
        produced_counts.update(traffic.counts)
    return RidesSummary(
        produced=sum(len(t.records) for t in batches),
        produced_counts=dict(sorted(produced_counts.items())),
        read=read,
        dead_letters=dead_letters_by_cause(config),
        quarantined=_count(pg.dsn, pg.quarantine_table),
        topic=audit_results(config),
        cells=audit_cells(config),
        expected=expected,
        seconds=seconds,
        runs=runs,
        left_running={name: address(services, name) for name in needed},
        data_dir=str(services.data),
        stop_command=stop_command(services, needed),
    )


def main(conf: str, overrides: tuple[str, ...], events: int) -> int:
    """``beamflow demo --job rides``: runs the demo, prints the audited summary and what it leaves running."""
    summary = run_demo(conf, overrides, RideTrafficSpec(events=events))
    print(summary.table())
    print(
        "demo: OK, every record accounted for, each result and each ride once in the topic and in the cells"
        if summary.ok
        else "demo: FAILED, see the table above"
    )
    print(summary.left_behind())
    return 0 if summary.ok else 1

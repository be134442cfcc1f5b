"""The clicks job's demo, what a new user runs first (``beamflow demo``, ``./run demo``): services up, traffic
generated, the clicks job run, and an audit of the result. It lives with the job: the ``beamflow`` engines know it
only by name (``beamflow.cli.demo.DEMOS``).

The summary checks the job's contract, not just that it ran: every produced record is either a distinct row in
Iceberg, a dead letter, or a quarantined duplicate, and neither sink holds a duplicate event id. The traffic comes in
two batches, the second continuing the first's event time a minute later, and the job runs after each (as a bounded
job is run again and again in practice): the sessions in PostgreSQL must equal the sessions of one pass over all the
events (computed from the generated events here), with no two sessions of a user within the gap of each other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from beamflow.config import JobConfig, as_job_config, load_job_config, required, resolve_auto
from beamflow.generate import GeneratedTraffic, TrafficSpec, avro_click_encoder, generate_traffic, produce_traffic
from beamflow.services import ServiceSet
from pipelines.demo_common import address, drop_tables, drop_topics, left_behind, start_needed, stop_command, table

__all__ = [
    "DemoSummary",
    "audit_job",
    "continuing",
    "expected_sessions",
    "main",
    "reset_job_state",
    "run_demo",
    "stored_sessions",
]


@dataclass
class DemoSummary:
    produced: int
    produced_counts: dict[str, int]
    read: int
    dead_letters: int
    quarantined: int
    iceberg_rows: int
    iceberg_distinct_ids: int
    iceberg_duplicate_ids: int
    session_rows: int
    postgres_duplicate_ids: int
    late_dropped: int
    seconds: float
    runs: int = 1
    session_events: int = 0
    expected_sessions: int = 0
    sessions_match: bool = True
    # What the demo leaves behind: services still running (name -> address), their data, the command that stops them.
    left_running: dict[str, str] = field(default_factory=dict)
    data_dir: str = ""
    stop_command: str = ""

    @property
    def balanced(self) -> bool:
        return self.produced == self.iceberg_distinct_ids + self.dead_letters + self.quarantined

    @property
    def ok(self) -> bool:
        return (
            self.balanced
            and self.iceberg_duplicate_ids == 0
            and self.postgres_duplicate_ids == 0
            and self.sessions_match
        )

    def rows(self) -> list[tuple[str, str]]:
        return [
            ("events produced (records sent)", f"{self.produced:,}"),
            ("  of which duplicate sends", f"{self.produced_counts.get('duplicate_sends', 0):,}"),
            ("  of which bad records", f"{self.produced_counts.get('bad_records', 0):,}"),
            ("  written with schema v2", f"{self.produced_counts.get('events_v2', 0):,}"),
            ("records read from Kafka", f"{self.read:,}"),
            ("dead-lettered", f"{self.dead_letters:,}"),
            ("quarantined as duplicates", f"{self.quarantined:,}"),
            ("rows in Iceberg", f"{self.iceberg_rows:,}"),
            ("distinct event ids in Iceberg", f"{self.iceberg_distinct_ids:,}"),
            ("duplicate event ids in Iceberg (audit)", f"{self.iceberg_duplicate_ids:,}"),
            ("job runs (each batch continuing the last)", f"{self.runs:,}"),
            ("session rows in PostgreSQL", f"{self.session_rows:,}"),
            ("  sessions of one pass over all events", f"{self.expected_sessions:,}"),
            ("  events counted in sessions", f"{self.session_events:,}"),
            ("overlapping sessions in PostgreSQL", f"{self.postgres_duplicate_ids:,}"),
            ("events too late for sessions (counted)", f"{self.late_dropped:,}"),
            ("throughput (records/s, whole job)", f"{self.read / self.seconds:,.0f}" if self.seconds else "-"),
            (
                "produced = Iceberg distinct + dead + quarantined",
                "yes" if self.balanced else "NO",
            ),
            ("sessions across runs = one pass over all events", "yes" if self.sessions_match else "NO"),
        ]

    def table(self) -> str:
        return table(self.rows())

    def left_behind(self) -> str:
        """What is still running after the demo, where the data is, and the one command that stops it."""
        return left_behind(
            self.left_running, self.data_dir, self.stop_command, "topic, tables, Iceberg warehouse, service logs"
        )


def reset_job_state(config: JobConfig | Mapping[str, Any]) -> None:
    """Drops the demo's topic, tables and Iceberg table so a rerun starts from nothing and its summary is exact."""
    from beamflow.iceberg.catalog import CatalogConfig, open_catalog

    job = as_job_config(config)
    kafka, pg, ice = required(job.kafka, "kafka"), required(job.postgres, "postgres"), required(job.iceberg, "iceberg")
    drop_topics(kafka.bootstrap, [kafka.topic])
    drop_tables(pg.dsn, (pg.sessions_table, pg.dead_letters_table, pg.quarantine_table, pg.first_copies))
    catalog = open_catalog(CatalogConfig(warehouse=ice.catalog.warehouse, uri=ice.catalog.uri))
    with contextlib.suppress(Exception):
        catalog.drop_table(ice.table)


def audit_job(config: JobConfig | Mapping[str, Any]) -> dict[str, int]:
    """Counts what the job's sinks hold: dead letters, quarantine, sessions, and the Iceberg audit."""
    import psycopg
    from psycopg import sql

    from beamflow.iceberg.audit import audit_table
    from beamflow.iceberg.catalog import CatalogConfig, open_catalog

    job = as_job_config(config)
    pg, ice = required(job.postgres, "postgres"), required(job.iceberg, "iceberg")
    out: dict[str, int] = {}
    with psycopg.connect(pg.dsn) as conn:

        def count(query: sql.Composed) -> int:
            row = conn.execute(query).fetchone()
            return int(row[0]) if row else 0

        for name, table in (
            ("dead_letters", pg.dead_letters_table),
            ("quarantined", pg.quarantine_table),
            ("session_rows", pg.sessions_table),
        ):
            out[name] = count(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table)))
        # The primary key rules out two rows for one session start; what could still be wrong is a user with two
        # overlapping sessions (a stale row left behind by a merge, or an event counted in two sessions).
        out["postgres_duplicate_ids"] = count(
            sql.SQL(
                "SELECT count(*) FROM {t} a JOIN {t} b ON a.user_id = b.user_id "
                "AND a.session_start < b.session_start AND b.session_start < a.session_end"
            ).format(t=sql.Identifier(pg.sessions_table))
        )
    catalog = open_catalog(CatalogConfig(warehouse=ice.catalog.warehouse, uri=ice.catalog.uri))
    report = audit_table(catalog.load_table(ice.table), id_column="event_id")
    out["iceberg_rows"] = report.rows
    out["iceberg_distinct_ids"] = report.distinct_ids or 0
    out["iceberg_duplicate_ids"] = report.duplicate_ids or 0
    return out


SessionKey = tuple[str, dt.datetime, dt.datetime, int, int, int]


def expected_sessions(traffic: Iterable[GeneratedTraffic], gap_ms: int) -> list[SessionKey]:
    """(user, start, end, impressions, clicks, events) of one pass over every distinct event generated, sorted:
    what the sessions table must hold whatever runs the events were read in."""
    events: dict[str, set[tuple[int, str, str]]] = {}
    for batch in traffic:
        for r in batch.records:
            if r.kind == "event" and r.event is not None:
                e = r.event
                events.setdefault(e["user_id"], set()).add(
                    (e["event_time"], e["event_type"], e["ad_id"] + e["campaign_id"])
                )
    out: list[SessionKey] = []
    utc = dt.UTC
    for user, mine in events.items():
        ordered = sorted(mine)
        group: list[tuple[int, str, str]] = []
        for item in [*ordered, None]:
            if group and (item is None or item[0] >= group[-1][0] + gap_ms):
                kinds = Counter(k for _, k, _ in group)
                out.append(
                    (
                        user,
                        dt.datetime.fromtimestamp(group[0][0] / 1000, utc),
                        dt.datetime.fromtimestamp((group[-1][0] + gap_ms) / 1000, utc),
                        kinds["impression"],
                        kinds["click"],
                        len(group),
                    )
                )
                group = []
            if item is not None:
                group.append(item)
    return sorted(out)


def stored_sessions(config: JobConfig | Mapping[str, Any]) -> list[SessionKey]:
    """The sessions table as (user, start, end, impressions, clicks, events), sorted."""
    import psycopg
    from psycopg import sql

    pg = required(as_job_config(config).postgres, "postgres")
    with psycopg.connect(pg.dsn) as conn:
        rows = conn.execute(
            sql.SQL(
                "SELECT user_id, session_start, session_end, impressions, clicks, events FROM {} "
                "ORDER BY user_id, session_start"
            ).format(sql.Identifier(pg.sessions_table))
        ).fetchall()
    return sorted((r[0], r[1], r[2], int(r[3]), int(r[4]), int(r[5])) for r in rows)


def continuing(spec: TrafficSpec, previous: GeneratedTraffic, after_ms: int = 60_000) -> TrafficSpec:
    """The next batch: event time continues ``after_ms`` after the previous batch's last event, new seed."""
    last = max(r.event["event_time"] for r in previous.records if r.event is not None)
    return dataclasses.replace(spec, start_ms=last + after_ms, seed=spec.seed + 1)


def run_demo(
    conf_path: str = "conf/clicks.yaml",
    overrides: tuple[str, ...] = (),
    spec: TrafficSpec | None = None,
    services: ServiceSet | None = None,
    progress: Callable[[str], None] = print,
    runs: int = 2,
) -> DemoSummary:
    """Generates ``spec.events`` events in ``runs`` batches, each continuing the last in event time, and runs the job
    after each batch; the summary audits the sinks after the last run."""
    from apache_beam.metrics.metric import MetricsFilter

    import pipelines.clicks as clicks
    from beamflow.kafka.admin import create_topic
    from transforms.hot_key_aggregate import late_dropped

    services = services or ServiceSet()
    # The local runner's job: its flink: section does not apply, so Flink is neither needed nor started.
    config = clicks.for_runner(load_job_config(conf_path, overrides), "DirectRunner")
    needed = start_needed(config, services, progress)
    config = resolve_auto(config, services)
    kafka, registry = required(config.kafka, "kafka"), required(config.registry, "registry")
    progress("resetting the demo's topic and tables")
    reset_job_state(config)

    spec = spec or TrafficSpec(partitions=kafka.partitions or 4)
    create_topic(kafka.bootstrap, kafka.topic, spec.partitions)
    encoder = avro_click_encoder(registry.url, registry.subject or f"{kafka.topic}-value", registry.ca_file)
    per_run = max(1, spec.events // runs)
    # The whole stream ends about now: the first batch starts early enough for every batch to fit before it.
    batch_spec = dataclasses.replace(
        spec,
        events=per_run,
        start_ms=spec.start_ms
        if spec.start_ms is not None
        else int(time.time() * 1000) - spec.events * spec.step_ms - runs * 60_000,
    )
    batches: list[GeneratedTraffic] = []
    seconds = 0.0
    read = late = 0
    for run in range(runs):
        if run:
            batch_spec = continuing(batch_spec, batches[-1])
        if run == runs - 1:
            batch_spec = dataclasses.replace(batch_spec, events=spec.events - per_run * (runs - 1))
        progress(
            f"batch {run + 1}/{runs}: {batch_spec.events:,} click events with skew, duplicates, late data, an idle "
            "stretch, schema v2" + (" (event time continuing the last batch's)" if run else "")
        )
        traffic = generate_traffic(batch_spec, encoder)
        produce_traffic(kafka.bootstrap, kafka.topic, traffic)
        batches.append(traffic)
        progress(f"  produced {len(traffic.records):,} records: {traffic.summary()}")
        progress(f"  running pipelines.clicks on the pinned local runner (FnApiRunner), run {run + 1}/{runs}")
        t0 = time.monotonic()
        result = clicks.run_with_config(config)
        seconds += time.monotonic() - t0
        metrics = result.metrics()
        read += sum(r.committed or 0 for r in metrics.query(MetricsFilter().with_name("records_read"))["counters"])
        late += late_dropped(metrics)
        progress(f"  job finished in {time.monotonic() - t0:.1f}s")
    progress("auditing the sinks")
    counts = audit_job(config)
    expected = expected_sessions(batches, config.sessions.gap_s * 1000)
    stored = stored_sessions(config)
    produced_counts: Counter[str] = Counter()
    for traffic in batches:
        produced_counts.update(traffic.counts)
    return DemoSummary(
        produced=sum(len(t.records) for t in batches),
        produced_counts=dict(sorted(produced_counts.items())),
        read=read,
        seconds=seconds,
        late_dropped=late,
        runs=runs,
        session_events=sum(s[5] for s in stored),
        expected_sessions=len(expected),
        sessions_match=stored == expected,
        left_running={name: address(services, name) for name in needed},
        data_dir=str(services.data),
        stop_command=stop_command(services, needed),
        **counts,
    )


def main(conf: str, overrides: tuple[str, ...], events: int) -> int:
    """``beamflow demo``: runs the demo, prints the audited summary and what it leaves running; 0 when it holds."""
    summary = run_demo(conf, overrides, TrafficSpec(events=events))
    print(summary.table())
    print(
        "demo: OK, every record accounted for exactly once, sessions exact across runs"
        if summary.ok
        else "demo: FAILED, see the table above"
    )
    print(summary.left_behind())
    return 0 if summary.ok else 1

"""The demo a new user runs first: services up, traffic generated, the clicks job run, and an audit of the result.

The summary checks the job's contract, not just that it ran: every produced record is either a distinct row in
Iceberg, a dead letter, or a quarantined duplicate, and neither sink holds a duplicate event id.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from beamflow.config import load_config, resolve_auto
from beamflow.generate import TrafficSpec, avro_click_encoder, generate_traffic, produce_traffic
from beamflow.services import ServiceSet

__all__ = ["DemoSummary", "audit_job", "reset_job_state", "run_demo"]


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

    @property
    def balanced(self) -> bool:
        return self.produced == self.iceberg_distinct_ids + self.dead_letters + self.quarantined

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
            ("session rows in PostgreSQL", f"{self.session_rows:,}"),
            ("overlapping sessions in PostgreSQL", f"{self.postgres_duplicate_ids:,}"),
            ("events too late for sessions (counted)", f"{self.late_dropped:,}"),
            ("throughput (records/s, whole job)", f"{self.read / self.seconds:,.0f}" if self.seconds else "-"),
            (
                "produced = Iceberg distinct + dead + quarantined",
                "yes" if self.balanced else "NO",
            ),
        ]

    def table(self) -> str:
        width = max(len(k) for k, _ in self.rows())
        lines = [f"{k:<{width}}  {v:>12}" for k, v in self.rows()]
        rule = "-" * (width + 14)
        return "\n".join([rule, *lines, rule])


def reset_job_state(config: dict[str, Any]) -> None:
    """Drops the demo's topic, tables and Iceberg table so a rerun starts from nothing and its summary is exact."""
    import psycopg
    from confluent_kafka.admin import AdminClient
    from psycopg import sql

    from beamflow.iceberg.catalog import CatalogConfig, open_catalog

    admin = AdminClient({"bootstrap.servers": config["kafka"]["bootstrap"]})
    topic = config["kafka"]["topic"]
    if topic in admin.list_topics(timeout=10).topics:
        for future in admin.delete_topics([topic]).values():
            future.result(30)
        # Deletion is asynchronous in the broker; wait until the name is free.
        deadline = time.monotonic() + 30
        while topic in admin.list_topics(timeout=10).topics and time.monotonic() < deadline:
            time.sleep(0.5)
    pg = config["postgres"]
    with psycopg.connect(pg["dsn"], autocommit=True) as conn:
        for key in ("sessions_table", "dead_letters_table", "quarantine_table"):
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(pg[key])))
    ice = config["iceberg"]
    catalog = open_catalog(CatalogConfig(warehouse=ice["catalog"]["warehouse"], uri=ice["catalog"].get("uri", "")))
    with contextlib.suppress(Exception):
        catalog.drop_table(ice["table"])


def audit_job(config: dict[str, Any]) -> dict[str, int]:
    """Counts what the job's sinks hold: dead letters, quarantine, sessions, and the Iceberg audit."""
    import psycopg
    from psycopg import sql

    from beamflow.iceberg.audit import audit_table
    from beamflow.iceberg.catalog import CatalogConfig, open_catalog

    pg = config["postgres"]
    out: dict[str, int] = {}
    with psycopg.connect(pg["dsn"]) as conn:

        def count(query: sql.Composed) -> int:
            row = conn.execute(query).fetchone()
            return int(row[0]) if row else 0

        for name, key in (
            ("dead_letters", "dead_letters_table"),
            ("quarantined", "quarantine_table"),
            ("session_rows", "sessions_table"),
        ):
            out[name] = count(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(pg[key])))
        # The primary key rules out two rows for one session start; what could still be wrong is a user with two
        # overlapping sessions (a stale row left behind by a merge, or an event counted in two sessions).
        out["postgres_duplicate_ids"] = count(
            sql.SQL(
                "SELECT count(*) FROM {t} a JOIN {t} b ON a.user_id = b.user_id "
                "AND a.session_start < b.session_start AND b.session_start < a.session_end"
            ).format(t=sql.Identifier(pg["sessions_table"]))
        )
    ice = config["iceberg"]
    catalog = open_catalog(CatalogConfig(warehouse=ice["catalog"]["warehouse"], uri=ice["catalog"].get("uri", "")))
    report = audit_table(catalog.load_table(ice["table"]), id_column="event_id")
    out["iceberg_rows"] = report.rows
    out["iceberg_distinct_ids"] = report.distinct_ids or 0
    out["iceberg_duplicate_ids"] = report.duplicate_ids or 0
    return out


def run_demo(
    conf_path: str = "conf/clicks.yaml",
    overrides: tuple[str, ...] = (),
    spec: TrafficSpec | None = None,
    services: ServiceSet | None = None,
    progress: Callable[[str], None] = print,
) -> DemoSummary:
    from apache_beam.metrics.metric import MetricsFilter

    import pipelines.clicks as clicks
    from beamflow.kafka.admin import create_topic
    from transforms.hot_key_aggregate import late_dropped

    services = services or ServiceSet()
    progress("starting services: kafka, postgres, schema registry (first run downloads and builds them)")
    for name in ("kafka", "postgres", "registry"):
        t0 = time.monotonic()
        services.get(name).up()
        progress(f"  {name} up ({time.monotonic() - t0:.1f}s)")
    config = resolve_auto(load_config(conf_path, overrides), services)
    config.pop("flink", None)
    progress("resetting the demo's topic and tables")
    reset_job_state(config)

    spec = spec or TrafficSpec(partitions=int(config["kafka"].get("partitions", 4)))
    progress(f"generating {spec.events:,} click events with skew, duplicates, late data, an idle stretch, schema v2")
    create_topic(config["kafka"]["bootstrap"], config["kafka"]["topic"], spec.partitions)
    traffic = generate_traffic(spec, avro_click_encoder(config["registry"]["url"], config["registry"]["subject"]))
    produce_traffic(config["kafka"]["bootstrap"], config["kafka"]["topic"], traffic)
    progress(f"  produced {len(traffic.records):,} records: {traffic.summary()}")

    progress("running pipelines.clicks on the pinned local runner (FnApiRunner)")
    t0 = time.monotonic()
    result = clicks.run_with_config(config)
    seconds = time.monotonic() - t0
    metrics = result.metrics()
    read = sum(r.committed or 0 for r in metrics.query(MetricsFilter().with_name("records_read"))["counters"])
    progress(f"  job finished in {seconds:.1f}s; auditing the sinks")
    counts = audit_job(config)
    return DemoSummary(
        produced=len(traffic.records),
        produced_counts=traffic.summary(),
        read=read,
        seconds=seconds,
        late_dropped=late_dropped(metrics),
        **counts,
    )

"""The hand-written single-process baseline: the same work as the clicks job with no framework (the floor)."""

from __future__ import annotations

import datetime as dt
import time
from collections import defaultdict
from typing import Any

from benchmarks.e2e.settings import BASELINE_APPEND_INTERVAL_S
from benchmarks.e2e.variants import _usage


def _session_rows(events_by_user: dict[str, list[tuple[int, str, int, int]]], gap_ms: int) -> list[tuple[Any, ...]]:

    utc = dt.UTC
    rows = []
    for user, events in events_by_user.items():
        events.sort()
        session: list[tuple[int, str, int, int]] = []
        for event in [*events, None]:
            if session and (event is None or event[0] - session[-1][0] >= gap_ms):
                first, last = session[0][0], session[-1][0]
                clicks = sum(1 for _, kind, _, _ in session if kind == "click")
                rows.append(
                    (
                        user,
                        dt.datetime.fromtimestamp(first / 1000, utc),
                        dt.datetime.fromtimestamp((last + gap_ms) / 1000, utc),
                        len(session) - clicks,
                        clicks,
                        dt.datetime.fromtimestamp(first / 1000, utc),
                        dt.datetime.fromtimestamp(last / 1000, utc),
                        len(session),
                        0,
                        True,
                    )
                )
                session = []
            if event is not None:
                session.append(event)
    return rows


def run_baseline(config: dict[str, Any]) -> dict[str, Any]:
    """The same work in one process with no framework: the floor the clicks job is compared with."""
    import psycopg
    from confluent_kafka import Consumer
    from confluent_kafka import TopicPartition as CkTopicPartition
    from psycopg import sql

    from beamflow.avro.registry import SchemaRegistryClient
    from beamflow.avro.serde import AvroDecodeError, AvroDeserializer
    from beamflow.event_id import event_id_from_fields
    from beamflow.generate import load_click_schema
    from beamflow.iceberg.catalog import CatalogConfig, open_catalog
    from beamflow.iceberg.committer import ensure_table, rows_to_arrow
    from beamflow.kafka.confluent_backend import TUNED_DEFAULTS
    from pipelines.clicks import (
        EVENT_ID_FIELDS,
        click_event,
        dead_letter_spec,
        impression_row,
        quarantine_spec,
        sessions_spec,
    )

    kafka, pg, ice = config["kafka"], config["postgres"], config["iceberg"]
    start = time.perf_counter()
    consumer = Consumer(
        {
            **TUNED_DEFAULTS,
            "bootstrap.servers": kafka["bootstrap"],
            "group.id": kafka["group_id"],
            "enable.auto.commit": False,
            "enable.partition.eof": False,
        }
    )
    topic = kafka["topic"]
    partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
    ends = {p: consumer.get_watermark_offsets(CkTopicPartition(topic, p), timeout=10)[1] for p in partitions}
    consumer.assign([CkTopicPartition(topic, p, 0) for p in partitions])
    remaining = {p for p in partitions if ends[p] > 0}
    position = dict.fromkeys(partitions, 0)

    registry = SchemaRegistryClient(config["registry"]["url"])
    decoder = AvroDeserializer(registry, load_click_schema(2))
    catalog = open_catalog(CatalogConfig(warehouse=ice["catalog"]["warehouse"], uri=ice["catalog"].get("uri", "")))
    interval = BASELINE_APPEND_INTERVAL_S
    pending: list[dict[str, Any]] = []
    table = None
    appends = 0

    def append() -> None:
        nonlocal table, pending, appends
        if not pending:
            return
        batch = rows_to_arrow(pending)
        if table is None:
            table = ensure_table(catalog, ice["table"], batch.schema, [("event_time", "day")])
        table.append(batch)
        pending, appends = [], appends + 1

    first_seen: dict[str, int] = {}
    sessions: dict[str, list[tuple[int, str, int, int]]] = defaultdict(list)
    dead: list[tuple[Any, ...]] = []
    quarantined: list[tuple[Any, ...]] = []
    records = 0
    last_append = time.monotonic()
    while remaining:
        for msg in consumer.consume(10_000, 0.5):
            if msg.error():
                raise RuntimeError(msg.error())
            p, offset, value = int(msg.partition() or 0), int(msg.offset() or 0), msg.value()
            records += 1
            position[p] = offset + 1
            if position[p] >= ends[p]:
                remaining.discard(p)
            try:
                decoded = decoder.deserialize(value)
            except AvroDecodeError as exc:
                dead.append(
                    (f"{topic}:{p}:{offset}", "DecodeAvro", str(exc), exc.code, topic, p, offset, None, value or b"")
                )
                continue
            decoded["_kafka"] = {"topic": topic, "partition": p, "offset": offset}
            event = click_event(decoded)
            event_id = event["event_id"] = event_id_from_fields(event, EVENT_ID_FIELDS)
            if event_id in first_seen:
                quarantined.append(
                    (
                        topic,
                        p,
                        offset,
                        event_id,
                        "duplicate",
                        dt.datetime.fromtimestamp(event["event_time"] / 1000, dt.UTC),
                        dt.datetime.fromtimestamp(first_seen[event_id] / 1000, dt.UTC),
                    )
                )
                continue
            first_seen[event_id] = event["event_time"]
            pending.append(impression_row(event))
            sessions[event["user_id"]].append((event["event_time"], event["event_type"], p, offset))
        if time.monotonic() - last_append >= interval:
            append()
            last_append = time.monotonic()
    append()

    session_rows = _session_rows(sessions, int(config["sessions"].get("gap_s", 600)) * 1000)
    with psycopg.connect(pg["dsn"], autocommit=False) as conn:
        for spec, rows in (
            (sessions_spec(pg["sessions_table"]), session_rows),
            (quarantine_spec(pg["quarantine_table"]), quarantined),
            (dead_letter_spec(pg["dead_letters_table"]), dead),
        ):
            assert spec.columns is not None
            columns = list(spec.columns)
            conn.execute(
                sql.SQL("CREATE TABLE IF NOT EXISTS {} ({}, PRIMARY KEY ({}))").format(
                    sql.Identifier(spec.table),
                    sql.SQL(", ").join(sql.SQL(f"{{}} {t}").format(sql.Identifier(c)) for c, t in spec.columns.items()),
                    sql.SQL(", ").join(map(sql.Identifier, spec.key)),
                )
            )
            copy_sql = sql.SQL("COPY {} ({}) FROM STDIN").format(
                sql.Identifier(spec.table), sql.SQL(", ").join(map(sql.Identifier, columns))
            )
            with conn.cursor().copy(copy_sql) as copy:
                for row in rows:
                    copy.write_row(row)
        conn.commit()
    consumer.commit(offsets=[CkTopicPartition(topic, p, position[p]) for p in partitions], asynchronous=False)
    consumer.close()
    registry.close()
    return {
        "seconds": time.perf_counter() - start,
        "records": records,
        "iceberg_appends": appends,
        "unique": len(first_seen),
        "sessions": len(session_rows),
        **_usage(),
    }

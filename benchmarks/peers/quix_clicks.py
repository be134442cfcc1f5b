"""The clicks job written in Quix Streams, as its documentation has a user write it (issue 18).

Runs in its own virtual environment (``benchmarks.peers.quix_python`` creates it), never in beamflow's:

    .cache/peers/quix-venv/bin/python benchmarks/peers/quix_clicks.py CONFIG.json

``CONFIG.json`` is the clicks job's resolved config (``conf/clicks.yaml`` with the services' endpoints, as
``benchmarks.e2e`` writes one per variant) plus a ``quix`` section (``state_dir``, ``catalog_uri``). The job:

- reads the topic with the group of ``kafka.group_id``, ``processing_guarantee="exactly-once"`` (Quix's strongest:
  Kafka transactions for its changelog and output topics and for the offsets; sinks are flushed before each
  checkpoint commits, so for sinks it is at-least-once, as its docs state);
- decodes Avro with Quix's own ``AvroDeserializer`` over the registry's Confluent-compatible API (reader schema v2);
  records it cannot decode reach ``on_consumer_error``, which writes them to the dead-letter table and suppresses
  them (the documented error-callback path); null values are dead-lettered from the dataframe;
- event ids from the same identifying fields with the same function as beamflow (``beamflow/event_id.py``, loaded
  by path: it is stdlib only);
- dedup by event id in Quix state (RocksDB, changelog-backed; state is per message key = user_id, and a duplicate
  send repeats the key), as its docs' fixed-window dedup recipe: written on the first encounter with an event-time
  TTL (``dedup.ttl_s``);
- 10-minute session windows per user with Quix's own ``session_window`` (present in 3.28.1, not in 3.25;
  ``grace_ms`` = the job's allowed lateness), ``.final(closing_strategy="partition")``: each session emitted once,
  when the partition's event time has passed its last event + 2 gaps + grace. Quix has no end of input: the
  sessions still open when the topic ends (the last ~50 minutes of event time per partition) are never emitted, and
  events later than the grace are dropped from sessions (they still reach Iceberg);
- impressions appended to an Iceberg table (pyiceberg SQL catalog) through a custom ``BatchingSink``: Quix's own
  ``IcebergSink`` accepts only ``data_catalog_spec="aws_glue"`` and cannot write to a SQL catalog, so this is its
  documented custom-sink path, written like its ``IcebergSink.write`` (one append per batch);
- sessions, duplicates and dead letters into PostgreSQL with Quix's ``PostgreSQLSink`` (primary keys, upsert for
  sessions and ON CONFLICT DO NOTHING for the immutable rows: the idempotent settings its docs offer).

The job stops once every partition has been processed up to the end offsets it saw at start (``app.stop()``; the
final checkpoint commits), or after ``quix.idle_timeout_s`` without a message (a zombie that lost its partitions).
Prints ``RESULT {json}`` like ``benchmarks.e2e``'s children.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import quixstreams.dataframe.windows.aggregations as agg
from confluent_kafka import Consumer, TopicPartition
from psycopg import connect
from psycopg.conninfo import conninfo_to_dict
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import CommitFailedException, NoSuchTableError
from pyiceberg.transforms import DayTransform
from quixstreams import Application, message_context
from quixstreams.models.serializers.avro import AvroDeserializer
from quixstreams.models.serializers.schema_registry import SchemaRegistryClientConfig
from quixstreams.sinks import BatchingSink, SinkBackpressureError, SinkBatch
from quixstreams.sinks.community.postgresql import PostgreSQLSink

REPO = Path(__file__).resolve().parents[2]
EVENT_ID_FIELDS = ("user_id", "ad_id", "campaign_id", "event_type", "event_time")


def _load(path: str, name: str) -> Any:
    """``name`` from the repository's module file ``path``, loaded alone (beamflow's dependencies are not here)."""
    spec = importlib.util.spec_from_file_location(f"beamflow_{Path(path).stem}", REPO / path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


event_id_from_fields = _load("beamflow/event_id.py", "event_id_from_fields")
own_peak_rss_mb = _load("beamflow/process_memory.py", "own_peak_rss_mb")

IMPRESSION_SCHEMA = pa.schema(
    [
        ("user_id", pa.string()),
        ("ad_id", pa.string()),
        ("campaign_id", pa.string()),
        ("event_type", pa.string()),
        ("event_time", pa.timestamp("us", tz="UTC")),
        ("device", pa.string()),
        ("country", pa.string()),
        ("event_id", pa.string()),
        ("_kafka_topic", pa.string()),
        ("_kafka_partition", pa.int32()),
        ("_kafka_offset", pa.int64()),
    ]
)


class IcebergSqlSink(BatchingSink):
    """Appends each batch to an Iceberg table of a pyiceberg SQL catalog (Quix's custom-sink contract).

    Like Quix's ``IcebergSink``: reload the table, append, and on a commit conflict ask Quix to retry the batch
    (``SinkBackpressureError``). At-least-once: a batch appended before a crash, whose checkpoint did not commit,
    is appended again on replay.
    """

    def __init__(self, table: str, catalog_uri: str, warehouse: str) -> None:
        super().__init__()
        self._identifier = table
        self._catalog = SqlCatalog("beamflow", uri=catalog_uri, warehouse=warehouse)
        self._table: Any = None

    def setup(self) -> None:
        namespace = self._identifier.rsplit(".", 1)[0]
        self._catalog.create_namespace_if_not_exists(namespace)
        try:
            self._table = self._catalog.load_table(self._identifier)
        except NoSuchTableError:
            self._table = self._catalog.create_table_if_not_exists(self._identifier, schema=IMPRESSION_SCHEMA)
            spec_field = self._table.schema().find_field("event_time")
            with self._table.update_spec() as update:
                update.add_field(spec_field.name, DayTransform(), "event_time_day")

    def write(self, batch: SinkBatch) -> None:
        rows = [item.value for item in batch]
        table = pa.Table.from_pylist(rows, schema=IMPRESSION_SCHEMA)
        try:
            self._table = self._catalog.load_table(self._identifier)
            self._table.append(table)
        except CommitFailedException as exc:
            raise SinkBackpressureError(retry_after=1.0) from exc


def _utc(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)


def _end_offsets(bootstrap: str, topic: str, group: str) -> tuple[dict[int, int], dict[int, int]]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        partitions = sorted(consumer.list_topics(topic, timeout=10).topics[topic].partitions)
        tps = [TopicPartition(topic, p) for p in partitions]
        ends = {tp.partition: consumer.get_watermark_offsets(tp, timeout=10, cached=False)[1] for tp in tps}
        committed = {tp.partition: max(tp.offset, 0) for tp in consumer.committed(tps, timeout=10)}
    finally:
        consumer.close()
    return ends, committed


def build_app(config: dict[str, Any]) -> tuple[Application, dict[str, Any]]:
    kafka, pg, ice, quix = config["kafka"], config["postgres"], config["iceberg"], config["quix"]
    topic_name = kafka["topic"]
    ends, committed = _end_offsets(kafka["bootstrap"], topic_name, kafka["group_id"])
    pending = {p for p, end in ends.items() if committed.get(p, 0) < end}
    progress: dict[str, Any] = {"records": 0, "pending": pending, "dead_letters_direct": 0}

    dsn = pg["dsn"]
    conn_args = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    pg_args = {
        "host": conn_args.get("host", "127.0.0.1"),
        "port": int(conn_args.get("port", 5432)),
        "dbname": conn_args.get("dbname", "postgres"),
        "user": conn_args.get("user", "postgres"),
        "password": conn_args.get("password", ""),
    }
    dead_table = pg["dead_letters_table"]
    dead_conn = connect(dsn, autocommit=True)
    dead_conn.execute(
        f'CREATE TABLE IF NOT EXISTS "{dead_table}" (topic text, kafka_partition integer, kafka_offset bigint, '
        "stage text, reason text, error text, payload bytea, PRIMARY KEY (topic, kafka_partition, kafka_offset))"
    )

    def app_stop_if_done(partition: int, offset: int) -> None:
        if offset >= ends[partition] - 1:
            pending.discard(partition)
            if not pending:
                app.stop()

    def on_consumer_error(exc: BaseException, message: Any, logger: Any) -> bool:
        """Undecodable records: written to the dead-letter table, then suppressed (Quix's error-callback path)."""
        if message is None:
            return False
        dead_conn.execute(
            f'INSERT INTO "{dead_table}" VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING',
            (
                message.topic(),
                message.partition(),
                message.offset(),
                "AvroDeserializer",
                "undecodable",
                f"{type(exc).__name__}: {exc}"[:500],
                message.value() or b"",
            ),
        )
        progress["dead_letters_direct"] += 1
        progress["records"] += 1
        app_stop_if_done(message.partition(), message.offset())
        return True

    def on_message_processed(topic: str, partition: int, offset: int) -> None:
        progress["records"] += 1
        app_stop_if_done(partition, offset)

    app = Application(
        broker_address=kafka["bootstrap"],
        consumer_group=kafka["group_id"],
        auto_offset_reset="earliest",
        processing_guarantee="exactly-once",
        commit_interval=float(quix.get("commit_interval_s", 5.0)),
        state_dir=quix["state_dir"],
        consumer_extra_config=quix.get("consumer_extra_config") or {},
        on_consumer_error=on_consumer_error,
        on_message_processed=on_message_processed,
        loglevel="WARNING",
    )
    topic = app.topic(
        topic_name,
        key_deserializer="str",
        value_deserializer=AvroDeserializer(
            schema=json.loads((REPO / "beamflow" / "avro" / "schemas" / "click_v2.avsc").read_text()),
            schema_registry_client_config=SchemaRegistryClientConfig(url=config["registry"]["url"]),
        ),
    )
    sdf = app.dataframe(topic)

    def dead_letter_null(_value: Any) -> dict[str, Any]:
        ctx = message_context()
        return {
            "topic": ctx.topic,
            "kafka_partition": ctx.partition,
            "kafka_offset": ctx.offset,
            "stage": "AvroDeserializer",
            "reason": "null value",
            "error": "null value",
            "payload": b"",
        }

    def click_event(value: dict[str, Any]) -> dict[str, Any]:
        ctx = message_context()
        event = dict(value)
        when = event["event_time"]
        event["event_time"] = int(when.timestamp() * 1000) if isinstance(when, dt.datetime) else int(when)
        event["event_id"] = event_id_from_fields(event, EVENT_ID_FIELDS)
        event["_kafka"] = (ctx.topic, ctx.partition, ctx.offset)
        return event

    dedup_ttl = dt.timedelta(seconds=int(config.get("dedup", {}).get("ttl_s", 86400)))

    def mark_duplicate(event: dict[str, Any], state: Any) -> dict[str, Any]:
        # Quix's "fixed-window dedup" recipe (docs/advanced/stateful-processing.md): the id written on the first
        # encounter only, with an event-time TTL (the job's dedup.ttl_s, as beamflow's dedup keeps ids)
        first_seen = state.get(event["event_id"])
        if first_seen is None:
            state.set(event["event_id"], event["event_time"], ttl=dedup_ttl)
        event["_first_seen"] = first_seen
        return event

    def quarantine_row(event: dict[str, Any]) -> dict[str, Any]:
        topic_, partition, offset = event["_kafka"]
        return {
            "topic": topic_,
            "kafka_partition": partition,
            "kafka_offset": offset,
            "event_id": event["event_id"],
            "reason": "duplicate",
            "event_time": _utc(event["event_time"]),
            "first_seen": _utc(event["_first_seen"]),
        }

    def impression_row(event: dict[str, Any]) -> dict[str, Any]:
        topic_, partition, offset = event["_kafka"]
        return {
            "user_id": event["user_id"],
            "ad_id": event["ad_id"],
            "campaign_id": event["campaign_id"],
            "event_type": event["event_type"],
            "event_time": _utc(event["event_time"]),
            "device": event.get("device"),
            "country": event.get("country"),
            "event_id": event["event_id"],
            "_kafka_topic": topic_,
            "_kafka_partition": partition,
            "_kafka_offset": offset,
        }

    gap_ms = int(config["sessions"].get("gap_s", 600)) * 1000

    def session_row(window: dict[str, Any], key: Any, _ts: int, _headers: Any) -> dict[str, Any]:
        return {
            "user_id": key,
            "session_start": _utc(window["first_event"]),
            # beamflow's and the baseline's convention: a session ends one gap after its last event
            "session_end": _utc(window["last_event"] + gap_ms),
            "impressions": window["events"] - window["clicks"],
            "clicks": window["clicks"],
            "first_event": _utc(window["first_event"]),
            "last_event": _utc(window["last_event"]),
            "events": window["events"],
        }

    def pg_sink(table: str, key: list[str], upsert: bool) -> PostgreSQLSink:
        return PostgreSQLSink(
            **pg_args,
            table_name=table,
            primary_key_columns=key,
            upsert_on_primary_key=upsert,
            on_conflict_do_nothing=not upsert,
            include_metadata=False,
        )

    nulls = sdf.filter(lambda value: value is None)
    nulls.apply(dead_letter_null).sink(pg_sink(dead_table, ["topic", "kafka_partition", "kafka_offset"], False))

    events = sdf.filter(lambda value: value is not None).apply(click_event)
    events = events.apply(mark_duplicate, stateful=True)

    duplicates = events.filter(lambda e: e["_first_seen"] is not None)
    duplicates.apply(quarantine_row).sink(
        pg_sink(pg["quarantine_table"], ["topic", "kafka_partition", "kafka_offset"], False)
    )

    unique = events.filter(lambda e: e["_first_seen"] is None)
    unique.apply(impression_row).sink(IcebergSqlSink(ice["table"], quix["catalog_uri"], ice["catalog"]["warehouse"]))

    sessions = (
        unique.apply(lambda e: {"is_click": int(e["event_type"] == "click"), "event_time": e["event_time"]})
        .session_window(
            inactivity_gap_ms=gap_ms,
            grace_ms=int(config["sessions"].get("allowed_lateness_s", 0)) * 1000,
            on_late=lambda *_args, **_kwargs: False,  # late events are dropped either way; False: not logged one by one
        )
        .agg(
            events=agg.Count(),
            clicks=agg.Sum("is_click"),
            first_event=agg.Min("event_time"),
            last_event=agg.Max("event_time"),
        )
        # "partition": the partition's event time closes every user's sessions (with the default "key" a user who
        # goes quiet never has their last session emitted; the docs advise "partition" for that). "key" only for the
        # cost comparison in docs/benchmarks.md (benchmarks.peers --quix-closing key)
        .final(closing_strategy=quix.get("closing_strategy", "partition"))
    )
    sessions.apply(session_row, metadata=True).sink(pg_sink(pg["sessions_table"], ["user_id", "session_start"], True))
    return app, progress


def main(config_path: str) -> int:
    config = json.loads(Path(config_path).read_text())
    start = time.perf_counter()
    app, progress = build_app(config)
    if progress["pending"]:
        app.run(timeout=float(config["quix"].get("idle_timeout_s", 20.0)), collect=False)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out = {
        "seconds": time.perf_counter() - start,
        "records": progress["records"],
        "dead_letters_direct": progress["dead_letters_direct"],
        "unfinished_partitions": sorted(progress["pending"]),
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": own_peak_rss_mb(),  # not ru_maxrss: it carries the parent's (beamflow/process_memory.py)
    }
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

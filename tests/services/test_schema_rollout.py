"""Schema evolution rollout and dead letters end to end (issue 4, seed 000 q3) on real Kafka, the registry,
PostgreSQL and a local SQLite Iceberg catalog: Kafka -> DecodeAvro -> Iceberg + PostgreSQL, on the pinned runner."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import psycopg
import pyarrow as pa
import pytest
from apache_beam.metrics.metric import MetricsFilter
from confluent_kafka import Consumer, TopicPartition

from beamflow.avro import load_schema
from beamflow.avro.evolution import record_columns
from beamflow.avro.registry import SchemaRegistryClient
from beamflow.avro.serde import AvroSerializer
from beamflow.avro.wire import encode_frame
from beamflow.cli import main as cli_main
from beamflow.deadletter import DeadLetter
from beamflow.iceberg.catalog import CatalogConfig, open_catalog
from beamflow.iceberg.committer import ensure_table
from beamflow.kafka.admin import create_topic, end_offsets, produce
from beamflow.postgres.table import SchemaEvolutionError, TableSpec, avro_columns, create_table
from beamflow.postgres.writer import PostgresUpsertWriter
from beamflow.rollout import RolloutRefusedError, check_rollout, evolve_sinks
from beamflow.services import ServiceState
from beamflow.services.base import wait_until
from runners.direct import local_options
from transforms.decode_avro import DecodeAvro
from transforms.read_from_kafka import ReadFromKafka, StopPolicy
from transforms.write_dead_letters import METRICS_NAMESPACE as DLQ_METRICS
from transforms.write_dead_letters import WriteDeadLetters
from transforms.write_to_iceberg import WriteToIceberg
from transforms.write_to_postgres import WriteToPostgres

pytestmark = pytest.mark.services

V1, V2 = load_schema("click_v1"), load_schema("click_v2")
COORDINATES = {"topic": "text NOT NULL", "kafka_partition": "integer NOT NULL", "kafka_offset": "bigint NOT NULL"}
KEY = ("topic", "kafka_partition", "kafka_offset")


def _uid() -> str:
    return uuid.uuid4().hex[:8]


def _event(user: str, i: int, v2: bool) -> dict[str, Any]:
    event: dict[str, Any] = {
        "user_id": user,
        "ad_id": f"ad{i % 7}",
        "campaign_id": "c1",
        "event_type": "click" if i % 5 == 0 else "impression",
        "event_time": dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(milliseconds=i),
    }
    if v2:
        event.update(device=("ios", "web")[i % 2], country=f"C{i % 9}")
    return event


def _coordinator_ready(bootstrap: str, topic: str, group: str) -> str:
    """Waits until the broker answers committed-offset requests for ``group`` (a freshly started broker answers
    NOT_COORDINATOR while it loads __consumer_offsets, and ReadFromKafka does not retry that); returns group."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        wait_until(
            lambda: consumer.committed([TopicPartition(topic, 0)], timeout=5) is not None,
            60,
            f"the group coordinator for {group}",
            interval=1.0,
        )
    finally:
        consumer.close()
    return group


def raw_row(decoded: dict[str, Any]) -> dict[str, Any]:
    """A decoded record as a raw-events PostgreSQL row: its fields plus its Kafka coordinates (the key)."""
    kafka = decoded["_kafka"]
    row = {k: v for k, v in decoded.items() if k != "_kafka"}
    row.update(topic=kafka["topic"], kafka_partition=kafka["partition"], kafka_offset=kafka["offset"])
    return row


def raw_source(row: Any) -> tuple[str | None, int | None, int | None]:
    return row.get("topic"), row.get("kafka_partition"), row.get("kafka_offset")


def _raw_spec(table: str, schema: dict[str, Any]) -> TableSpec:
    return TableSpec(table, key=KEY, columns=avro_columns(schema, **COORDINATES), extra_fields="evolve")


def _pg_columns(dsn: str, table: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = %s ORDER BY ordinal_position",
            (table,),
        ).fetchall()
    return [r[0] for r in rows]


def _iceberg_v1_table(config: CatalogConfig, identifier: str) -> None:
    """The Iceberg table as it stood before the rollout: the v1 fields and the Kafka coordinates."""
    fields = [c.arrow_field() for c in record_columns(V1)]
    fields += [pa.field("topic", pa.string()), pa.field("partition", pa.int32()), pa.field("offset", pa.int64())]
    ensure_table(open_catalog(config), identifier, pa.schema(fields))


def _registry_subject(client: SchemaRegistryClient, *schemas: dict[str, Any]) -> tuple[str, list[AvroSerializer]]:
    """A fresh subject with ``schemas`` registered in order (compatibility BACKWARD from the first on)."""
    subject = f"rollout-{_uid()}-value"
    serializers = [AvroSerializer(client, subject, schema) for schema in schemas]
    assert serializers[0].schema_id  # registers the first version
    client.set_compatibility("BACKWARD", subject)
    assert all(s.schema_id for s in serializers[1:])
    return subject, serializers


# ---- 1. the v1 -> v2 switch mid-stream --------------------------------------------------------------------


def test_stream_switching_to_v2_evolves_both_sinks_and_loses_nothing(
    kafka: ServiceState, registry: ServiceState, postgres: ServiceState, tmp_path: Path
) -> None:
    bootstrap, dsn, url = kafka.info["bootstrap"], postgres.info["dsn"], registry.info["url"]
    client = SchemaRegistryClient(url)
    subject, _ = _registry_subject(client, V1)
    v1 = AvroSerializer(client, subject, V1)
    topic, run = f"rollout-{_uid()}", _uid()
    create_topic(bootstrap, topic, 2)
    pg_table, ice_table = f"raw_clicks_{run}", f"beamflow.clicks_{run}"
    catalog = CatalogConfig.local(tmp_path / "iceberg")

    # Before the rollout: both sinks hold exactly the v1 columns.
    with psycopg.connect(dsn) as conn:
        create_table(conn, TableSpec(pg_table, key=KEY, columns=avro_columns(V1, **COORDINATES)))
    _iceberg_v1_table(catalog, ice_table)

    # The gate says what each sink will gain; the v2 writer is then registered and the stream switches to it.
    verdict = check_rollout(client, subject, V2, dsn, pg_table, ice_table, catalog)
    assert verdict.safe, verdict.text()
    assert verdict.sink("postgres").add == (("device", "TEXT"), ("country", "TEXT"))  # type: ignore[union-attr]
    assert [n for n, _ in verdict.sink("iceberg").add] == ["device", "country"]  # type: ignore[union-attr]
    v2 = AvroSerializer(client, subject, V2)

    n = 600  # first half v1, second half v2, interleaved over both partitions
    records = []
    for i in range(n):
        is_v2 = i >= n // 2
        value = (v2 if is_v2 else v1).serialize(_event(f"v{2 if is_v2 else 1}-{i}", i, is_v2))
        records.append((f"k{i}".encode(), value, {"partition": i % 2}))
    assert produce(bootstrap, topic, records) == n

    with beam.Pipeline(options=local_options()) as p:
        decoded = (
            p
            | ReadFromKafka(
                bootstrap,
                [topic],
                _coordinator_ready(bootstrap, topic, f"g-{run}"),
                stop=StopPolicy(at_end_offsets=True),
            )
            | DecodeAvro(url, reader_schema=V2)
        )
        ice = decoded.decoded | WriteToIceberg(ice_table, catalog, sink_id=f"rollout-{run}")
        pg_dead = (
            decoded.decoded
            | "ToRawRows" >> beam.Map(raw_row)
            | WriteToPostgres(dsn, _raw_spec(pg_table, V2), source_of=raw_source, max_rows=128)
        ).dead_letters
        (decoded.dead_letters, ice.dead_letters, pg_dead) | beam.Flatten() | beam.Map(_no_dead_letter)

    # PostgreSQL: every record, the new columns added, v1 rows NULL there, v2 rows carry them.
    assert _pg_columns(dsn, pg_table)[-2:] == ["device", "country"]
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(f"SELECT user_id, device, country FROM {pg_table}").fetchall()
    assert len(rows) == n and len({r[0] for r in rows}) == n
    assert all(r[1] is None and r[2] is None for r in rows if r[0].startswith("v1-"))
    assert all(r[1] in ("ios", "web") and r[2] for r in rows if r[0].startswith("v2-"))
    assert sum(r[0].startswith("v2-") for r in rows) == n // 2

    # Iceberg: the same.
    table = open_catalog(catalog).load_table(ice_table)
    assert [f.name for f in table.schema().fields][-2:] == ["device", "country"]
    assert all(not f.required for f in table.schema().fields)
    got = table.scan().to_arrow().select(["user_id", "device", "country", "partition", "offset"]).to_pylist()
    assert len(got) == n and len({(r["partition"], r["offset"]) for r in got}) == n
    assert all(r["device"] is None and r["country"] is None for r in got if r["user_id"].startswith("v1-"))
    assert all(r["device"] in ("ios", "web") and r["country"] for r in got if r["user_id"].startswith("v2-"))

    # Nothing left to add: the gate now says both sinks gain nothing.
    after = check_rollout(client, subject, V2, dsn, pg_table, ice_table, catalog)
    assert after.safe and all(not s.add for s in after.sinks), after.text()


def _no_dead_letter(dead: DeadLetter) -> None:
    raise AssertionError(f"unexpected dead letter: {dead}")


# ---- 2. the gate: explicit evolution, and refusals before any row is written --------------------------------


def _with_field(schema: dict[str, Any], new_field: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "fields": [*schema["fields"], new_field]}


REMOVED = {**V1, "fields": [f for f in V1["fields"] if f["name"] != "event_time"]}
RENAMED = {**V1, "fields": [({**f, "name": "user"} if f["name"] == "user_id" else f) for f in V1["fields"]]}
REQUIRED = _with_field(V1, {"name": "device", "type": "string"})


@pytest.mark.parametrize(
    ("name", "candidate", "why"),
    [
        ("removed", REMOVED, "'event_time' was removed"),
        ("renamed", RENAMED, "'user_id' was renamed to 'user'"),
        ("required", REQUIRED, "'device' has no default"),
    ],
)
def test_unsafe_changes_are_refused_before_any_row_is_written(
    registry: ServiceState, postgres: ServiceState, tmp_path: Path, name: str, candidate: dict[str, Any], why: str
) -> None:
    dsn, client = postgres.info["dsn"], SchemaRegistryClient(registry.info["url"])
    subject, _ = _registry_subject(client, V1)
    client.set_compatibility("NONE", subject)  # the registry would accept anything: beamflow's rule must not
    run = _uid()
    pg_table, ice_table = f"refuse_{name}_{run}", f"beamflow.refuse_{name}_{run}"
    catalog = CatalogConfig.local(tmp_path / "iceberg")
    with psycopg.connect(dsn) as conn:
        create_table(conn, TableSpec(pg_table, key=KEY, columns=avro_columns(V1, **COORDINATES)))
    _iceberg_v1_table(catalog, ice_table)
    pg_before, ice_before = _pg_columns(dsn, pg_table), open_catalog(catalog).load_table(ice_table).schema()

    verdict = check_rollout(client, subject, candidate, dsn, pg_table, ice_table, catalog)
    assert not verdict.safe and why in verdict.text() and "NOT safe to roll out" in verdict.text()
    with pytest.raises(RolloutRefusedError, match="no table was changed") as refused:
        evolve_sinks(client, subject, candidate, dsn, pg_table, ice_table, catalog)
    assert why in str(refused.value)
    if name == "required":  # each sink names the required column itself too
        assert "'device' is required" in verdict.sink("postgres").describe()  # type: ignore[union-attr]
        assert "'device' is required" in verdict.sink("iceberg").describe()  # type: ignore[union-attr]
    assert _pg_columns(dsn, pg_table) == pg_before
    table = open_catalog(catalog).load_table(ice_table)
    assert table.schema() == ice_before and table.current_snapshot() is None

    # The PostgreSQL sink refuses on its own too, declared from the candidate, before writing a single row.
    row = raw_row({**_event("u1", 1, False), "_kafka": {"topic": "t", "partition": 0, "offset": 0}})
    with (
        PostgresUpsertWriter(_raw_spec(pg_table, candidate), dsn=dsn) as writer,
        pytest.raises(SchemaEvolutionError, match="no row was written") as sink_refusal,
    ):
        writer.write_batch([row])
    assert {"removed": "'event_time' is NOT NULL", "renamed": "'user_id' is NOT NULL",
            "required": "new column 'device' is required"}[name] in str(sink_refusal.value)  # fmt: skip
    with psycopg.connect(dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {pg_table}").fetchone() == (0,)
    assert _pg_columns(dsn, pg_table) == pg_before


def test_evolve_sinks_adds_the_columns_explicitly_and_is_idempotent(
    registry: ServiceState, postgres: ServiceState, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dsn, client = postgres.info["dsn"], SchemaRegistryClient(registry.info["url"])
    subject, _ = _registry_subject(client, V1)
    run = _uid()
    pg_table, ice_table = f"evolve_{run}", f"beamflow.evolve_{run}"
    catalog = CatalogConfig.local(tmp_path / "iceberg")
    with psycopg.connect(dsn) as conn:
        create_table(conn, TableSpec(pg_table, key=KEY, columns=avro_columns(V1, **COORDINATES)))
    _iceberg_v1_table(catalog, ice_table)
    # The CLI gate over both sinks, before evolving: exit 0 and what each sink gains.
    (tmp_path / "v2.avsc").write_text(json.dumps(V2))
    sinks = ["--postgres-dsn", dsn, "--table", pg_table, "--iceberg-table", ice_table]
    sinks += ["--catalog-warehouse", catalog.warehouse, "--catalog-uri", catalog.uri]
    argv = ["schema", "check", "--subject", subject, "--schema", str(tmp_path / "v2.avsc")]
    capsys.readouterr()
    assert cli_main([*argv, "--registry", registry.info["url"], *sinks]) == 0
    out = capsys.readouterr().out
    assert f"iceberg: {ice_table} gains device string NULL, country string NULL" in out and "SAFE" in out
    verdict = evolve_sinks(client, subject, V2, dsn, pg_table, ice_table, catalog)
    assert "postgres: evolve_" in verdict.text() and "gains device TEXT NULL, country TEXT NULL" in verdict.text()
    assert _pg_columns(dsn, pg_table)[-2:] == ["device", "country"]
    fields = open_catalog(catalog).load_table(ice_table).schema().fields
    assert [(f.name, str(f.field_type), f.required) for f in fields[-2:]] == [
        ("device", "string", False),
        ("country", "string", False),
    ]
    again = evolve_sinks(client, subject, V2, dsn, pg_table, ice_table, catalog)
    assert all(not s.add for s in again.sinks)
    # The v2 PostgreSQL writer now has nothing to add and writes v1-shaped rows (NULLs) and v2 rows alike.
    rows = [
        raw_row({**_event(f"u{i}", i, i % 2 == 1), "_kafka": {"topic": "t", "partition": 0, "offset": i}})
        for i in range(4)
    ]
    with PostgresUpsertWriter(_raw_spec(pg_table, V2), dsn=dsn) as writer:
        assert writer.write_batch(rows) == []
    with psycopg.connect(dsn) as conn:
        got = conn.execute(f"SELECT kafka_offset, device FROM {pg_table} ORDER BY 1").fetchall()
    assert got == [(0, None), (1, "web"), (2, None), (3, "web")]


# ---- 3. ten kinds of bad input among 10,000 good records, both DLQ sinks -------------------------------------

GOOD = 10_000
BAD_PER_KIND = 3
DECODE_KINDS = (
    "null_value",
    "bad_magic_byte",
    "truncated_header",
    "empty_body",
    "unknown_schema_id",
    "truncated_body",
    "trailing_bytes",
    "corrupt_body",
    "schema_resolution",
)
SINK_KIND = "23514"  # a value that violates the sink's CHECK constraint (decodes fine, PostgreSQL refuses it)


@pytest.fixture(scope="module")
def mixed_topic(kafka: ServiceState, registry: ServiceState) -> Iterator[dict[str, Any]]:
    """10,000 good records (v1 then v2) and ten kinds of bad ones, three of each, spread through the stream."""
    bootstrap, url = kafka.info["bootstrap"], registry.info["url"]
    client = SchemaRegistryClient(url)
    subject, (v1, v2) = _registry_subject(client, V1, V2)
    narrow = AvroSerializer(client, f"{subject}-narrow", {
        "type": "record", "name": "ClickEvent", "namespace": "beamflow.demo",
        "fields": [{"name": "user_id", "type": "string"}]})  # fmt: skip
    good = v2.serialize(_event("x", 99, True))
    v1_frame = v1.serialize(_event("x", 98, False))
    bad_enum = encode_frame(v1.schema_id, v1.encode_body(_event("x", 97, False))[:-7] + b"\x0a" + b"\x00" * 6)
    bad_values: dict[str, Any] = {
        "null_value": None,
        "bad_magic_byte": b"\x01" + good[1:],
        "truncated_header": b"\x00\x00\x01",
        "empty_body": good[:5],
        "unknown_schema_id": encode_frame(987_654, good[5:]),
        "truncated_body": good[:-3],
        "trailing_bytes": v1_frame + b"\x02xy",
        "corrupt_body": bad_enum,
        "schema_resolution": narrow.serialize({"user_id": "narrow"}),
        SINK_KIND: v2.serialize(_event("", 1, True)),  # an empty user_id: the raw table's CHECK refuses it
    }
    bad_plan = [kind for kind in bad_values for _ in range(BAD_PER_KIND)]
    every = GOOD // (len(bad_plan) + 1)
    records: list[tuple[bytes | None, bytes | None, dict[str, Any]]] = []
    for i in range(GOOD):
        version = v2 if i >= GOOD // 2 else v1
        records.append((f"u{i}".encode(), version.serialize(_event(f"u{i}", i, i >= GOOD // 2)), {"partition": i % 3}))
        if bad_plan and i % every == every - 1:
            records.append((b"bad", bad_values[bad_plan.pop()], {"partition": (i + 1) % 3}))
    topic = f"mixed-{_uid()}"
    create_topic(bootstrap, topic, 3)
    assert produce(bootstrap, topic, records) == GOOD + 10 * BAD_PER_KIND
    yield {"topic": topic, "read": sum(end_offsets(bootstrap, topic).values())}


def _raw_table_with_check(dsn: str, table: str) -> TableSpec:
    spec = _raw_spec(table, V2)
    with psycopg.connect(dsn) as conn:
        create_table(conn, spec)
        conn.execute(f"ALTER TABLE {table} ADD CONSTRAINT user_id_present CHECK (user_id <> '')")
    return spec


def _read_dlq_topic(bootstrap: str, topic: str) -> list[DeadLetter]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"dlq-{_uid()}", "enable.auto.commit": False})
    try:
        ends = end_offsets(bootstrap, topic)
        consumer.assign([TopicPartition(topic, partition, 0) for partition in ends])
        out: list[DeadLetter] = []
        while len(out) < sum(ends.values()):
            for message in consumer.consume(500, 1.0):
                assert message.error() is None, message.error()
                dead = DeadLetter.from_dict(json.loads(message.value() or b""))
                assert message.key() == dead.key  # the original record's key
                out.append(dead)
        return out
    finally:
        consumer.close()


@pytest.mark.parametrize("sink", ["postgres", "kafka"])
def test_bad_input_lands_in_the_dlq_with_its_reason(
    kafka: ServiceState, registry: ServiceState, postgres: ServiceState, mixed_topic: dict[str, Any], sink: str
) -> None:
    bootstrap, dsn, url = kafka.info["bootstrap"], postgres.info["dsn"], registry.info["url"]
    run = _uid()
    raw_table, dlq_table, dlq_topic = f"raw_{run}", f"dlq_{run}", f"dlq-{run}"
    spec = _raw_table_with_check(dsn, raw_table)
    if sink == "kafka":
        create_topic(bootstrap, dlq_topic, 1)
        dlq = WriteDeadLetters("kafka", bootstrap=bootstrap, topic=dlq_topic)
    else:
        dlq = WriteDeadLetters("postgres", dsn=dsn, table=dlq_table)

    p = beam.Pipeline(options=local_options())
    decoded = (
        p
        | ReadFromKafka(
            bootstrap,
            [mixed_topic["topic"]],
            _coordinator_ready(bootstrap, mixed_topic["topic"], f"g-{run}"),
            stop=StopPolicy(at_end_offsets=True),
        )
        | DecodeAvro(url, reader_schema=V2)
    )
    pg_dead = (
        decoded.decoded | "ToRawRows" >> beam.Map(raw_row) | WriteToPostgres(dsn, spec, source_of=raw_source)
    ).dead_letters
    (decoded.dead_letters, pg_dead) | beam.Flatten() | dlq
    result = p.run()
    result.wait_until_finish()

    with psycopg.connect(dsn) as conn:
        good = conn.execute(f"SELECT count(*), count(DISTINCT user_id) FROM {raw_table}").fetchone()
    assert good == (GOOD, GOOD)

    if sink == "kafka":
        letters = _read_dlq_topic(bootstrap, dlq_topic)
        # At-least-once: a retried bundle may repeat a message; the coordinates identify the input.
        by_input = {(d.stage, d.topic, d.partition, d.offset): d for d in letters}
        dead = list(by_input.values())
    else:
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(
                "SELECT stage, reason, error, topic, kafka_partition, kafka_offset, record_key, payload "
                f"FROM {dlq_table}"
            ).fetchall()
        dead = [DeadLetter(payload=bytes(r[7]), stage=r[0], reason=r[1], error=r[2], topic=r[3], partition=r[4],
                           offset=r[5], key=bytes(r[6]) if r[6] is not None else None) for r in rows]  # fmt: skip

    assert Counter(d.error for d in dead) == {kind: BAD_PER_KIND for kind in (*DECODE_KINDS, SINK_KIND)}
    assert all(d.reason and d.topic == mixed_topic["topic"] and d.offset is not None for d in dead)
    assert all(d.key == b"bad" for d in dead if d.stage == "decode_avro")
    sink_dead = [d for d in dead if d.error == SINK_KIND]
    assert all(d.stage == f"postgres:{raw_table}" and "user_id_present" in d.reason for d in sink_dead)
    assert len({(d.partition, d.offset) for d in dead}) == len(dead) == 10 * BAD_PER_KIND
    # The invariant: good + dead = read, and the DLQ counter agrees.
    assert good[0] + len(dead) == mixed_topic["read"] == GOOD + 10 * BAD_PER_KIND
    counters = result.metrics().query(MetricsFilter().with_namespace(DLQ_METRICS).with_name("dead_letters"))
    assert sum(c.committed or c.attempted for c in counters["counters"]) == 10 * BAD_PER_KIND

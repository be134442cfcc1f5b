"""DecodeAvro on the local runner against the real registry: schema evolution and every kind of bad input."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import apache_beam as beam
import pytest
from apache_beam.metrics.metric import MetricsFilter

from beamflow.avro import load_schema
from beamflow.avro.registry import SchemaRegistryClient
from beamflow.avro.serde import AvroSerializer
from beamflow.avro.wire import encode_frame
from beamflow.deadletter import DeadLetter
from beamflow.kafka.record import KafkaRecord
from beamflow.services import ServiceState
from runners.direct import local_options
from transforms.decode_avro import KAFKA_KEY, METRICS_NAMESPACE, DecodeAvro

pytestmark = pytest.mark.services

# Filled by the pipeline's sinks: FnApiRunner runs in this process.
_COLLECTED: dict[str, list[Any]] = {}


def _collect(name: str) -> beam.PTransform:
    def add(elements: list[Any]) -> None:
        _COLLECTED[name] = list(elements)

    return beam.combiners.ToList() | beam.Map(add)


def _event(i: int, v2: bool) -> dict[str, Any]:
    event: dict[str, Any] = {
        "user_id": f"u{i}",
        "ad_id": f"ad{i % 3}",
        "campaign_id": "c1",
        "event_type": "click" if i % 2 else "impression",
        "event_time": dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=i),
    }
    if v2:
        event.update(device="mobile", country=f"C{i}")
    return event


def test_mixed_writers_and_bad_input(registry: ServiceState) -> None:
    url = registry.info["url"]
    client = SchemaRegistryClient(url)
    subject = f"clicks-{uuid.uuid4().hex[:8]}-value"
    v1 = AvroSerializer(client, subject, load_schema("click_v1"))
    v2 = AvroSerializer(client, subject, load_schema("click_v2"))
    # A writer the v2 reader cannot resolve: ad_id etc. missing and the reader has no defaults for them.
    narrow_schema = {"type": "record", "name": "ClickEvent", "namespace": "beamflow.demo",
                     "fields": [{"name": "user_id", "type": "string"}]}  # fmt: skip
    narrow = AvroSerializer(client, f"{subject}-narrow", narrow_schema)

    values: list[Any] = []
    expected_dead: dict[int, str] = {}
    for i in range(24):
        values.append(v1.serialize(_event(i, False)) if i % 2 else v2.serialize(_event(i, True)))
    good = v2.serialize(_event(99, True))
    v1_frame = v1.serialize(_event(98, False))
    bad_enum = encode_frame(v1.schema_id, v1.encode_body(_event(97, False))[:-7] + b"\x0a" + b"\x00" * 6)
    bad: list[tuple[str, Any]] = [
        ("null_value", None),
        ("bad_magic_byte", b"\x01" + good[1:]),
        ("bad_magic_byte", b'{"user_id": "u1"}'),
        ("truncated_header", b"\x00\x00\x01"),
        ("truncated_header", b""),
        ("empty_body", good[:5]),
        ("unknown_schema_id", encode_frame(987654, good[5:])),
        ("truncated_body", good[:-3]),
        ("trailing_bytes", v1_frame + b"\x02xy"),
        ("schema_resolution", narrow.serialize({"user_id": "u-narrow"})),
        ("corrupt_body", bad_enum),
        ("decode_error", "not bytes"),
    ]
    # Interleave the bad records among the good ones.
    for n, (_code, value) in enumerate(bad):
        position = 2 * n + 1
        values.insert(position, value)
    for offset, value in enumerate(values):
        for code, bad_value in bad:
            if value is bad_value:
                expected_dead[offset] = code
    records = [
        KafkaRecord("clicks", 0, offset, 1_700_000_000_000 + offset, f"k{offset}".encode(), value)
        for offset, value in enumerate(values)
    ]
    assert len(expected_dead) == len(bad)

    _COLLECTED.clear()
    pipeline = beam.Pipeline(options=local_options())
    decoded, dead = (
        pipeline | beam.Create(records, reshuffle=False) | DecodeAvro(url, reader_schema=load_schema("click_v2"))
    )
    _ = decoded | "CollectDecoded" >> _collect("decoded")
    _ = dead | "CollectDead" >> _collect("dead")
    result = pipeline.run()
    result.wait_until_finish()

    rows, letters = _COLLECTED["decoded"], _COLLECTED["dead"]
    assert len(rows) + len(letters) == len(records)  # nothing silently dropped
    assert len(rows) == 24

    # Old-writer rows read with the v2 reader get the defaults; v2 rows keep their values.
    by_user = {row["user_id"]: row for row in rows}
    for i in range(24):
        row = by_user[f"u{i}"]
        assert row["event_type"] == ("click" if i % 2 else "impression")
        assert row["event_time"] == dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=i)
        if i % 2:
            assert (row["device"], row["country"]) == (None, None)
            assert row[KAFKA_KEY]["schema_id"] == v1.schema_id
        else:
            assert (row["device"], row["country"]) == ("mobile", f"C{i}")
            assert row[KAFKA_KEY]["schema_id"] == v2.schema_id
        coords = row[KAFKA_KEY]
        assert coords["topic"] == "clicks" and coords["partition"] == 0
        assert records[coords["offset"]].value is not None
        assert coords["key"] == f"k{coords['offset']}".encode()
        assert coords["timestamp_ms"] == 1_700_000_000_000 + coords["offset"]

    assert all(isinstance(letter, DeadLetter) for letter in letters)
    got = {letter.offset: letter.error for letter in letters}
    assert got == expected_dead
    for letter in letters:
        assert letter.stage == "decode_avro" and letter.topic == "clicks" and letter.partition == 0
        assert letter.reason.startswith(f"{letter.error}: ") and len(letter.reason) > len(letter.error) + 10
        original = records[letter.offset].value
        assert letter.payload == (original if isinstance(original, bytes) else b"")
        assert letter.key == f"k{letter.offset}".encode()

    counters = {
        c.key.metric.name: c.committed
        for c in result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))["counters"]
    }
    assert counters == {"decoded": 24, "dead_letters": len(bad)}

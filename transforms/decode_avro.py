"""``DecodeAvro``: Confluent-framed Avro Kafka values to dicts, bad messages to dead letters with reasons."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.pvalue import TaggedOutput

from beamflow.avro.registry import SchemaRegistryClient
from beamflow.avro.serde import AvroDecodeError, AvroDeserializer
from beamflow.deadletter import DeadLetter
from beamflow.kafka.record import KafkaRecord
from transforms.sink_base import DEAD_LETTERS  # the one output name of every stage's dead letters

__all__ = ["DEAD_LETTERS", "KAFKA_KEY", "METRICS_NAMESPACE", "STAGE", "DecodeAvro", "DecodeAvroResult"]

METRICS_NAMESPACE = "beamflow.decode_avro"
KAFKA_KEY = "_kafka"
STAGE = "decode_avro"


class DecodeAvroResult(NamedTuple):
    """``decoded``: dicts of the record's fields plus ``_kafka``; ``dead_letters``: ``DeadLetter``s."""

    decoded: beam.PCollection
    dead_letters: beam.PCollection


def _field(element: Any, name: str, default: Any = None) -> Any:
    if isinstance(element, Mapping):
        return element.get(name, default)
    return getattr(element, name, default)


def _coordinates_and_value(element: Any) -> tuple[dict[str, Any], Any]:
    if type(element) is KafkaRecord:  # the common case, without the generic lookups below (per record)
        coords = {
            "topic": element.topic,
            "partition": element.partition,
            "offset": element.offset,
            "timestamp_ms": element.timestamp_ms,
            "key": element.key,
        }
        return coords, element.value
    timestamp = _field(element, "timestamp_ms")
    if timestamp is None:
        timestamp = _field(element, "timestamp")
    coords = {
        "topic": _field(element, "topic"),
        "partition": _field(element, "partition"),
        "offset": _field(element, "offset"),
        "timestamp_ms": timestamp,
        "key": _field(element, "key"),
    }
    return coords, _field(element, "value")


class _DecodeFn(beam.DoFn):
    """One registry client and deserializer per DoFn instance (``setup``); writer schemas cached by id."""

    def __init__(self, registry_url: str, reader_schema: dict[str, Any] | None, ca_file: str | None = None) -> None:
        self._registry_url = registry_url
        self._reader_schema = reader_schema
        self._ca_file = ca_file  # the path travels with the DoFn; the worker reads the file when it connects
        self._client: SchemaRegistryClient | None = None
        self._deserializer: AvroDeserializer | None = None
        self._decoded = Metrics.counter(METRICS_NAMESPACE, "decoded")
        self._dead = Metrics.counter(METRICS_NAMESPACE, "dead_letters")

    def setup(self) -> None:
        self._client = SchemaRegistryClient(self._registry_url, ca_file=self._ca_file)
        self._deserializer = AvroDeserializer(self._client, self._reader_schema)

    def teardown(self) -> None:
        if self._client is not None:
            self._client.close()

    def process(self, element: Any) -> Iterator[Any]:
        assert self._deserializer is not None, "setup() was not called"
        coords, value = _coordinates_and_value(element)
        try:
            if value is not None and not isinstance(value, bytes | bytearray | memoryview):
                raise AvroDecodeError(f"value is a {type(value).__name__}, not bytes")
            record = self._deserializer.deserialize(bytes(value) if value is not None else None)
        except AvroDecodeError as exc:
            # RegistryUnavailableError is deliberately not caught: an outage must fail the bundle (and be
            # retried), not turn every record into a dead letter.
            self._dead.inc()
            key = coords["key"]
            yield TaggedOutput(
                DEAD_LETTERS,
                DeadLetter(
                    payload=bytes(value) if isinstance(value, bytes | bytearray | memoryview) else b"",
                    stage=STAGE,
                    reason=f"{exc.code}: {exc}",
                    topic=coords["topic"],
                    partition=coords["partition"],
                    offset=coords["offset"],
                    key=bytes(key) if isinstance(key, bytes | bytearray) else None,
                    error=exc.code,
                ),
            )
            return
        self._decoded.inc()
        assert value is not None  # a null value raised NullValueError above
        coords["schema_id"] = int.from_bytes(value[1:5], "big")
        record[KAFKA_KEY] = coords
        yield record


class DecodeAvro(beam.PTransform):
    """Decodes Kafka record values in the Confluent Avro wire format, resolving them into a reader schema.

    Input: any element with ``topic``, ``partition``, ``offset``, ``key``, ``value`` (bytes) and
    ``timestamp_ms`` (or ``timestamp``) as attributes or dict keys, e.g. ``KafkaRecord``.

    Output ``decoded``: one dict per record with the reader schema's fields (defaults filled in for data
    written by older schemas, fields unknown to the reader dropped) and the source under ``_kafka``:
    ``{"topic", "partition", "offset", "timestamp_ms", "key", "schema_id"}`` (the key other beamflow
    transforms and sinks read coordinates from). Output ``dead_letters``: a ``DeadLetter`` per
    message that cannot be decoded, with ``error`` one of ``null_value``, ``bad_magic_byte``,
    ``truncated_header``, ``empty_body``, ``unknown_schema_id``, ``truncated_body``, ``trailing_bytes``,
    ``corrupt_body``, ``schema_resolution``, ``decode_error``. ``decoded + dead_letters == input``.

    Needs a Confluent-compatible registry (``registry_url``); an ``https://`` one is verified with ``ca_file`` (a
    PEM path that must exist where the workers run; None: the system's CAs). Writer schemas are fetched once per id
    and DoFn instance. A registry outage fails the bundle (retried by the runner) instead of producing dead letters.

    Delivery: a pure per-element function, so it inherits the guarantee of its source and sinks (exactly-once
    with beamflow's Kafka read and idempotent sinks).

    Example::

        import apache_beam as beam
        from beamflow.avro import load_schema
        from runners.direct import local_options
        from transforms import DecodeAvro, ReadFromKafka, StopPolicy, WriteDeadLetters

        with beam.Pipeline(options=local_options()) as p:
            records = p | ReadFromKafka("127.0.0.1:9092", ["clicks"], "clicks-job",
                                        stop=StopPolicy(at_end_offsets=True))
            decoded, dead = records | DecodeAvro("http://127.0.0.1:8081", reader_schema=load_schema("click_v2"))
            decoded | beam.Map(lambda click: print(click["user_id"], click["_kafka"]["offset"]))
            dead | WriteDeadLetters("postgres", dsn="postgresql://postgres@127.0.0.1:5432/beamflow",
                                    table="example_dead_letters")
    """

    def __init__(
        self, registry_url: str, reader_schema: dict[str, Any] | None = None, ca_file: str | None = None
    ) -> None:
        super().__init__()
        self.registry_url = registry_url
        self.reader_schema = reader_schema
        self.ca_file = ca_file

    def expand(self, records: beam.PCollection) -> DecodeAvroResult:
        outputs = records | "Decode" >> beam.ParDo(
            _DecodeFn(self.registry_url, self.reader_schema, self.ca_file)
        ).with_outputs(DEAD_LETTERS, main="decoded")
        return DecodeAvroResult(outputs.decoded, outputs[DEAD_LETTERS])

"""``WriteDeadLetters``: the dead-letter queue sink, a PostgreSQL table or a Kafka topic, counted."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics

from beamflow.deadletter import DeadLetter
from beamflow.postgres.table import TableSpec
from transforms.sink_base import Declared, Guarantee, SinkFn, SinkResult, write_with
from transforms.write_to_postgres import WriteToPostgres

__all__ = [
    "DEAD_LETTER_COLUMNS",
    "METRICS_NAMESPACE",
    "SINKS",
    "WriteDeadLetters",
    "dead_letter_id",
    "dead_letter_row",
    "dead_letter_spec",
]

METRICS_NAMESPACE = "beamflow.dead_letters"
SINKS = ("postgres", "kafka")

DEAD_LETTER_COLUMNS: dict[str, str] = {
    "dead_letter_id": "text NOT NULL",
    "stage": "text NOT NULL",
    "reason": "text NOT NULL",
    "error": "text",
    "topic": "text",
    "kafka_partition": "integer",
    "kafka_offset": "bigint",
    "record_key": "bytea",
    "payload": "bytea NOT NULL",
}


def dead_letter_spec(table: str, schema: str | None = None) -> TableSpec:
    """The dead-letter table: immutable rows keyed by ``dead_letter_id`` (a replay adds nothing)."""
    return TableSpec(table, key=("dead_letter_id",), columns=dict(DEAD_LETTER_COLUMNS), schema=schema)


def dead_letter_id(dead: DeadLetter) -> str:
    """A deterministic id: the stage and Kafka coordinates, or (without coordinates) the stage and payload digest.

    The same input rejected again by the same stage (a replayed bundle, a restarted job) gets the same id.
    """
    identity = hashlib.blake2b(digest_size=16)
    for part in (dead.stage, dead.topic, dead.partition, dead.offset):
        identity.update(repr(part).encode() + b"\x00")
    if dead.offset is None:  # no coordinates: the payload itself identifies the input
        identity.update(dead.payload)
    return identity.hexdigest()


def dead_letter_row(dead: DeadLetter) -> dict[str, Any]:
    """The dead-letter table row for ``dead`` (columns as in ``DEAD_LETTER_COLUMNS``)."""
    return {
        "dead_letter_id": dead_letter_id(dead),
        "stage": dead.stage,
        "reason": dead.reason,
        "error": dead.error,
        "topic": dead.topic,
        "kafka_partition": dead.partition,
        "kafka_offset": dead.offset,
        "record_key": dead.key,
        "payload": dead.payload,
    }


class _Count(beam.DoFn):
    def __init__(self) -> None:
        self._dead = Metrics.counter(METRICS_NAMESPACE, "dead_letters")

    def process(self, dead: DeadLetter) -> Iterator[DeadLetter]:
        if not isinstance(dead, DeadLetter):
            raise TypeError(f"WriteDeadLetters takes DeadLetter elements, got {type(dead).__name__}")
        self._dead.inc()
        Metrics.counter(METRICS_NAMESPACE, f"stage:{dead.stage}").inc()
        yield dead


def _refuse_lost(dead: DeadLetter) -> None:
    # The dead-letter table is the last resort: if it rejects a row, the job fails rather than lose it.
    raise RuntimeError(f"the dead-letter table rejected a dead letter ({dead.reason}); refusing to lose it")


# The PostgreSQL variant writes through WriteToPostgres (_UpsertFn), keyed by dead_letter_id.
_TABLE_GUARANTEE = Declared(Guarantee.IDEMPOTENT, "the dead-letter id: stage + Kafka coordinates (or payload digest)")


class _ProduceFn(SinkFn):
    """Produces each dead letter; ``flush`` (``finish_bundle``) waits until every one is acked, so a bundle (and the
    Kafka offsets it covers) never finalizes before its dead letters are durable."""

    GUARANTEE = Declared(Guarantee.AT_LEAST_ONCE, "readers dedupe on stage + topic/partition/offset")
    STAGE = "write_dead_letters"

    def __init__(self, bootstrap: str, topic: str, producer_config: dict[str, Any], flush_timeout_s: float) -> None:
        super().__init__()
        self._bootstrap = bootstrap
        self._topic = topic
        self._config = producer_config
        self._flush_timeout_s = flush_timeout_s
        self._producer: Any = None
        self._errors: list[str] = []
        self._acked_in_bundle = 0
        self._acked = Metrics.counter(METRICS_NAMESPACE, "kafka_acked")

    def open(self) -> None:
        from confluent_kafka import Producer

        from beamflow.secrets import kafka_client_config

        self._producer = Producer(
            kafka_client_config(  # secret references resolved here, in the worker: the DoFn carries the names only
                {
                    "bootstrap.servers": self._bootstrap,
                    "linger.ms": 5,
                    **self._config,
                    # Not overridable: the guarantee below depends on them.
                    "acks": "all",
                    "enable.idempotence": True,
                }
            )
        )

    def _on_delivery(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self._errors.append(str(err))
        else:
            self._acked_in_bundle += 1
            self._acked.inc()

    def add(self, dead: DeadLetter) -> tuple[()]:
        producer = self._producer
        while True:
            try:
                producer.produce(self._topic, key=dead.key, value=dead.to_json(), on_delivery=self._on_delivery)
                break
            except BufferError:  # local queue full: let deliveries drain
                producer.poll(0.1)
        producer.poll(0)
        return ()

    def flush(self) -> list[dict[str, Any]]:
        remaining = self._producer.flush(self._flush_timeout_s)
        errors, self._errors = self._errors, []
        acked, self._acked_in_bundle = self._acked_in_bundle, 0
        if remaining or errors:
            # Failing the bundle makes the runner retry it (and its input is not committed): at-least-once.
            raise RuntimeError(
                f"dead-letter topic {self._topic}: {remaining} not acked after {self._flush_timeout_s:.0f}s, "
                f"{len(errors)} failed: {errors[:3]}"
            )
        return [{"topic": self._topic, "rows_written": acked}] if acked else []

    def close(self) -> None:
        if self._producer is not None:
            self._producer.flush(self._flush_timeout_s)


class WriteDeadLetters(beam.PTransform):
    """Writes ``DeadLetter`` records to the dead-letter queue: a PostgreSQL table or a Kafka topic.

    ::

        import apache_beam as beam
        from beamflow.deadletter import DeadLetter
        from runners.direct import local_options
        from transforms import WriteDeadLetters

        dead = [DeadLetter(b"\\x00garbage", "decode_avro", "not Confluent wire format", "clicks", 0, 42)]
        with beam.Pipeline(options=local_options()) as p:
            letters = p | beam.Create(dead)   # in a job: (decoded.dead_letters, iceberg.dead_letters, ...) | Flatten()
            letters | "ToTable" >> WriteDeadLetters(
                "postgres", dsn="postgresql://postgres@127.0.0.1:5432/beamflow", table="example_dead_letters"
            )
            letters | "ToTopic" >> WriteDeadLetters("kafka", bootstrap="127.0.0.1:9092", topic="clicks-dlq")

    ``sink="postgres"``: one immutable row per dead letter in ``table`` (created if missing, columns
    ``DEAD_LETTER_COLUMNS``), keyed by ``dead_letter_id``: a digest of the stage and the Kafka coordinates, or of the
    stage and the payload when there are none. Guarantee: **idempotent** (replays insert nothing new), hence
    effectively exactly-once per rejected input. If the table itself rejects a row the job fails rather than lose it.

    ``sink="kafka"``: one JSON message per dead letter (``DeadLetter.to_json``, read back with
    ``DeadLetter.from_dict(json.loads(value))``), key = the original record's key, produced with ``acks=all`` and
    idempotence; every bundle waits in ``finish_bundle`` until its dead letters are acked and fails otherwise.
    Guarantee: **at-least-once**: a bundle retried after its messages were acked produces them again (dedupe on
    stage + topic/partition/offset when reading the topic).

    Counts every dead letter in the ``beamflow.dead_letters`` metrics namespace (``dead_letters`` and
    ``stage:<stage>``). Needs: PostgreSQL (``dsn``) or a Kafka broker (``bootstrap``) with ``topic`` existing or
    auto-created. Returns a ``SinkResult``: a report per written batch, complete once every dead letter is written
    (for ``CommitOffsetsAfter``), and ``dead_letters``, always empty (a dead letter that cannot be written fails the
    bundle instead).
    """

    GUARANTEES = {"postgres": _TABLE_GUARANTEE, "kafka": _ProduceFn.GUARANTEE}

    def __init__(
        self,
        sink: str,
        *,
        dsn: str | None = None,
        table: str | None = None,
        schema: str | None = None,
        bootstrap: str | None = None,
        topic: str | None = None,
        producer_config: dict[str, Any] | None = None,
        flush_timeout_s: float = 60.0,
    ) -> None:
        super().__init__()
        if sink not in SINKS:
            raise ValueError(f"dead-letter sink must be one of {', '.join(SINKS)}, not {sink!r}")
        if sink == "postgres" and (not dsn or not table):
            raise ValueError("WriteDeadLetters('postgres') needs dsn= and table=")
        if sink == "kafka" and (not bootstrap or not topic):
            raise ValueError("WriteDeadLetters('kafka') needs bootstrap= and topic=")
        self.sink = sink
        self.dsn = dsn
        self.spec = dead_letter_spec(table, schema) if sink == "postgres" and table else None
        self.bootstrap = bootstrap
        self.topic = topic
        self.producer_config = dict(producer_config or {})
        self.flush_timeout_s = flush_timeout_s

    def expand(self, dead_letters: beam.PCollection) -> SinkResult:
        counted = dead_letters | "Count" >> beam.ParDo(_Count())
        if self.sink == "postgres":
            assert self.dsn is not None and self.spec is not None
            table = (
                counted
                | "ToRows" >> beam.Map(dead_letter_row)
                | "Upsert" >> WriteToPostgres(self.dsn, self.spec, create=True)
            )
            lost = table.dead_letters | "FailOnLostDeadLetter" >> beam.Map(_refuse_lost)
            return SinkResult(written=table.written, dead_letters=lost)
        assert self.bootstrap is not None and self.topic is not None
        return write_with(
            counted, _ProduceFn(self.bootstrap, self.topic, self.producer_config, self.flush_timeout_s), "Produce"
        )

"""``WriteToPostgres``: idempotent batched upserts of dict rows into a PostgreSQL table, with dead letters."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics

from beamflow.postgres.retry import RetryPolicy
from beamflow.postgres.table import TableSpec
from beamflow.postgres.writer import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ROWS,
    DEFAULT_MAX_SECONDS,
    PostgresUpsertWriter,
    SourceOf,
    open_pool,
)
from transforms.sink_base import DEAD_LETTERS, Declared, Guarantee, SinkFn, SinkResult, write_with

__all__ = ["DEAD_LETTERS", "METRICS_NAMESPACE", "WriteToPostgres"]

METRICS_NAMESPACE = "beamflow.postgres"


class _UpsertFn(SinkFn):
    """Buffers rows per bundle; flushes at thresholds and always before the bundle ends (so before any
    checkpoint)."""

    GUARANTEE = Declared(Guarantee.IDEMPOTENT, "deterministic keys and versions (a newer version wins)")
    STAGE = "write_to_postgres"

    def __init__(
        self,
        dsn: str,
        spec: TableSpec,
        max_rows: int,
        max_bytes: int,
        max_seconds: float,
        create: bool,
        retry: RetryPolicy | None,
        source_of: SourceOf | None,
    ) -> None:
        super().__init__()
        self._dsn = dsn
        self._spec = spec
        self._max_rows = max_rows
        self._max_bytes = max_bytes
        self._max_seconds = max_seconds
        self._create = create
        self._retry = retry
        self._source_of = source_of
        self._writer: PostgresUpsertWriter | None = None
        self._pool: Any = None
        self._rows = Metrics.counter(METRICS_NAMESPACE, "rows_written")
        self._dead = Metrics.counter(METRICS_NAMESPACE, "dead_letters")
        self._retries = Metrics.counter(METRICS_NAMESPACE, "retries")

    def open(self) -> None:
        # One pool per DoFn instance, reused across bundles; never one per element.
        self._pool = open_pool(self._dsn)
        self._writer = PostgresUpsertWriter(
            self._spec,
            pool=self._pool,
            max_rows=self._max_rows,
            max_bytes=self._max_bytes,
            max_seconds=self._max_seconds,
            create=self._create,
            retry=self._retry,
            source_of=self._source_of,
        )
        if self._spec.evolves:
            # Refusals (required new column, type change, a NOT NULL column no longer declared) fail the job here,
            # before this worker writes any row.
            self._writer.columns()

    def add(self, row: Mapping[str, Any]) -> list[Any]:
        assert self._writer is not None
        return self._track(self._writer.add, row)

    def flush(self) -> list[Any]:
        assert self._writer is not None
        return self._track(lambda _: self._writer.flush(), None)

    def _track(self, call: Any, arg: Any) -> list[Any]:
        """The call's dead letters, plus a report of the rows it wrote (when it wrote any), counted in metrics."""
        assert self._writer is not None
        stats = self._writer.stats
        before = (stats.rows_written, stats.retries)
        outputs: list[Any] = call(arg)
        written = stats.rows_written - before[0]
        if written or stats.retries != before[1]:
            self._rows.inc(written)
            self._retries.inc(stats.retries - before[1])
        if outputs:
            self._dead.inc(len(outputs))
        if written:
            outputs.append({"table": self._spec.table, "rows_written": written})
        return outputs

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


class WriteToPostgres(beam.PTransform):
    """Upserts dict rows into a PostgreSQL table; returns a ``SinkResult``: a report per written batch
    (``{"table", "rows_written"}``) and the ``DeadLetter`` of every rejected row.

    ::

        import apache_beam as beam
        from beamflow.postgres.table import TableSpec
        from runners.direct import local_options
        from transforms import WriteDeadLetters, WriteToPostgres

        dsn = "postgresql://postgres@127.0.0.1:5432/beamflow"
        spec = TableSpec("example_orders", key=("order_id",), version=("event_time", "kafka_offset"),
                         columns={"order_id": "text", "event_time": "timestamptz NOT NULL",
                                  "kafka_offset": "bigint NOT NULL", "amount": "numeric(12, 2)"})
        rows = [{"order_id": "o1", "event_time": "2026-01-01T00:00:00Z", "kafka_offset": 7, "amount": 9.5},
                {"order_id": "o2", "event_time": None, "kafka_offset": 8, "amount": 1}]   # NOT NULL: a dead letter
        with beam.Pipeline(options=local_options()) as p:
            result = p | beam.Create(rows) | WriteToPostgres(dsn, spec, create=True)
            result.written | beam.Map(print)                  # {"table": "example_orders", "rows_written": 1}
            result.dead_letters | WriteDeadLetters("postgres", dsn=dsn, table="example_dead_letters")

    Guarantee: idempotent, hence effectively exactly-once given deterministic keys and versions. Rows are
    written in batches of one transaction each (COPY into a temp table, then ``INSERT ... ON CONFLICT``); a
    newer version replaces an older one, an equal or older one changes nothing (no version columns: first
    write wins). Every buffered row is flushed before the bundle finishes, so a runner that replays
    uncommitted input after a failure (at-least-once delivery) rewrites only rows whose rewrite is a no-op.
    Transient database failures are retried with backoff; rows rejected for their data (NOT NULL, type, range,
    check) come out as dead letters carrying the database's message, and the rest of their batch commits.
    Nothing is silently dropped.

    Schema evolution: with ``TableSpec(extra_fields="evolve", columns=avro_columns(reader_schema, ...))`` a
    declared column the table lacks is added, nullable, before the first row carrying that field is written (old
    rows read NULL there). Anything else (a required new column, a type change, a NOT NULL column the declaration
    lacks) raises ``SchemaEvolutionError`` when the worker starts, before any row is written::

        from beamflow.avro import load_schema
        from beamflow.postgres.table import TableSpec, avro_columns

        spec = TableSpec("raw_clicks", key=("topic", "kafka_partition", "kafka_offset"), extra_fields="evolve",
                         columns=avro_columns(load_schema("click_v2"), topic="text NOT NULL",
                                              kafka_partition="integer NOT NULL", kafka_offset="bigint NOT NULL"))

    Needs: a reachable PostgreSQL (``dsn``), and a table with a primary key or unique index on ``spec.key``
    (or ``create=True`` with declared ``spec.columns``). Names must be plain identifiers; others are rejected.
    """

    GUARANTEES = {"": _UpsertFn.GUARANTEE}

    def __init__(
        self,
        dsn: str,
        spec: TableSpec,
        *,
        max_rows: int = DEFAULT_MAX_ROWS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_seconds: float = DEFAULT_MAX_SECONDS,
        create: bool = False,
        retry: RetryPolicy | None = None,
        source_of: SourceOf | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(spec, TableSpec):
            raise TypeError(f"spec must be a TableSpec, got {type(spec).__name__}")
        self._fn = _UpsertFn(dsn, spec, max_rows, max_bytes, max_seconds, create, retry, source_of)

    def expand(self, rows: beam.PCollection) -> SinkResult:
        return write_with(rows, self._fn, "Upsert")

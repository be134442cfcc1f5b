"""``WriteSessions``: session rows merged into a PostgreSQL sessions table through ``beamflow.postgres.sessions``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics

from beamflow.postgres.sessions import SessionStore
from beamflow.postgres.writer import open_pool
from transforms.sink_base import Declared, Guarantee, SinkFn, SinkResult, write_with

__all__ = ["DEFAULT_BATCH_ROWS", "METRICS_NAMESPACE", "WriteSessions"]

METRICS_NAMESPACE = "beamflow.sessions"
# Users per transaction: each takes an advisory lock, which counts against PostgreSQL's shared lock table.
DEFAULT_BATCH_ROWS = 500


class _MergeSessionsFn(SinkFn):
    """Buffers rows per bundle; merges them into the table at ``batch_rows`` and always before the bundle ends
    (so before any checkpoint, and before a bounded run's offset commit, which waits for this step)."""

    GUARANTEE = Declared(
        Guarantee.EXACTLY_ONCE, "session rows whose counts are backed by Kafka offsets (partition, offset), one topic"
    )
    STAGE = "write_sessions"

    def __init__(self, dsn: str, table: str, batch_rows: int) -> None:
        super().__init__()
        self._dsn = dsn
        self._table = table
        self._batch_rows = batch_rows
        self._pool: Any = None
        self._buffer: list[Mapping[str, Any]] = []
        self._inserted = Metrics.counter(METRICS_NAMESPACE, "rows_inserted")
        self._deleted = Metrics.counter(METRICS_NAMESPACE, "rows_replaced")
        self._replayed = Metrics.counter(METRICS_NAMESPACE, "events_already_stored")

    def open(self) -> None:
        self._pool = open_pool(self._dsn)
        self._store = SessionStore(self._pool.connection, self._table)
        self._store.ensure_table()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def add(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        self._buffer.append(row)
        return self.flush() if len(self._buffer) >= self._batch_rows else []

    def flush(self) -> list[dict[str, Any]]:
        rows, self._buffer = self._buffer, []
        if not rows:
            return []
        stats = self._store.write(rows)
        self._inserted.inc(stats.rows_inserted)
        self._deleted.inc(stats.rows_deleted)
        self._replayed.inc(stats.events_already_stored)
        return [
            {
                "table": self._table,
                "rows_written": stats.rows_inserted,
                "rows_replaced": stats.rows_deleted,
                "events_already_stored": stats.events_already_stored,
            }
        ]


class WriteSessions(beam.PTransform):
    """Merges session rows (dicts with ``beamflow.postgres.sessions.SESSION_COLUMNS``) into ``table``.

    ::

        import apache_beam as beam
        from apache_beam.transforms.window import Sessions, TimestampedValue
        from beamflow.aggregates import SessionClicksFn
        from pipelines.clicks import session_row
        from runners.direct import local_options
        from transforms import HotKeyAggregate, WriteSessions

        events = [("u1", {"event_type": kind, "event_time": ms, "event_id": f"e{offset}", "kafka_partition": 0,
                          "kafka_offset": offset}) for offset, (kind, ms) in enumerate([("impression", 1_000),
                                                                                         ("click", 61_000)])]
        with beam.Pipeline(options=local_options()) as p:
            (
                p
                | beam.Create(events)
                | beam.Map(lambda kv: TimestampedValue(kv, kv[1]["event_time"] / 1000))
                | HotKeyAggregate(SessionClicksFn(), windowfn=Sessions(600), strategy="bundle_partials")
                | beam.Map(session_row)
                | WriteSessions("postgresql://postgres@127.0.0.1:5432/beamflow", "example_sessions")
            )

    Guarantee (across runs, not only within one): the table holds, per user, the sessions one pass over every event
    delivered so far would form, each event counted once. A row that overlaps stored sessions of its user replaces
    them with their merge, in the same transaction as the write (``SessionStore``), and events the stored rows already
    count (identified by Kafka partition and offset) are not counted again. So consecutive bounded runs, a rerun
    after a crash between the sinks and the offset commit, a restored streaming job replaying events, and late
    panes that widen a session all leave the rows one run over all the events would. Each batch commits whole or
    not at all; rows are flushed before every bundle ends.

    Needs: rows whose counts are all backed by offsets (events carrying ``kafka_partition``/``kafka_offset`` into
    ``SessionClicksFn``), from one topic. Returns a ``SinkResult``: a report per merged batch (``rows_written``
    inserted, ``rows_replaced``, ``events_already_stored``), complete when every row is written (for
    ``CommitOffsetsAfter(after=[...])``), and ``dead_letters`` (none: a row the store refuses fails the bundle).
    """

    GUARANTEES = {"": _MergeSessionsFn.GUARANTEE}

    def __init__(self, dsn: str, table: str, batch_rows: int = DEFAULT_BATCH_ROWS) -> None:
        super().__init__()
        if batch_rows < 1:
            raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
        self._fn = _MergeSessionsFn(dsn, table, batch_rows)

    def expand(self, rows: beam.PCollection) -> SinkResult:
        return write_with(rows, self._fn, "MergeIntoStore")

"""``WriteVersionedCells``: HBase-style versioned cells (row, family:qualifier, timestamp -> value) into
PostgreSQL."""

from __future__ import annotations

from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics

from beamflow.postgres.cells import BufferedMutator, Cell, PostgresCellStore, RowKeySalter
from beamflow.postgres.retry import RetryPolicy
from beamflow.postgres.writer import open_pool
from transforms.sink_base import DEAD_LETTERS, Declared, Guarantee, SinkFn, SinkResult, write_with

__all__ = ["DEAD_LETTERS", "WriteVersionedCells"]


class _MutateFn(SinkFn):
    GUARANTEE = Declared(Guarantee.IDEMPOTENT, "deterministic row keys and cell timestamps (the newest timestamp wins)")
    STAGE = "write_versioned_cells"

    def __init__(
        self,
        dsn: str,
        table: str,
        schema: str | None,
        max_cells: int,
        max_bytes: int,
        max_seconds: float,
        salt_buckets: int | None,
        retry: RetryPolicy | None,
    ) -> None:
        super().__init__()
        self._dsn = dsn
        self._table = table
        self._schema = schema
        self._max_cells = max_cells
        self._max_bytes = max_bytes
        self._max_seconds = max_seconds
        self._salt_buckets = salt_buckets
        self._retry = retry
        self._pool: Any = None
        self._dead = Metrics.counter("beamflow.cells", "dead_letters")

    def open(self) -> None:
        self._pool = open_pool(self._dsn)
        self._store = PostgresCellStore(self._table, pool=self._pool, schema=self._schema, retry=self._retry)
        salter = RowKeySalter(self._salt_buckets) if self._salt_buckets else None
        self._mutator = BufferedMutator(self._store, self._max_cells, self._max_bytes, self._max_seconds, salter)

    def add(self, cell: Any) -> list[Any]:
        if not isinstance(cell, Cell):
            self._dead.inc()
            return [self.dead_letter(cell, f"expected a Cell, got {type(cell).__name__}", error="TypeError")]
        return self._report(self._mutator.mutate, cell)

    def flush(self) -> list[Any]:
        return self._report(lambda _: self._mutator.flush(), None)

    def _report(self, call: Any, arg: Any) -> list[Any]:
        """The call's dead letters, and a report of the cell versions it stored (replays store none)."""
        stats = self._store.writer.stats
        before = stats.rows_written
        outputs: list[Any] = call(arg)
        self._dead.inc(len(outputs))
        if stats.rows_written > before:
            outputs.append({"table": self._table, "rows_written": stats.rows_written - before})
        return outputs

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


class WriteVersionedCells(beam.PTransform):
    """Writes ``Cell`` elements to a versioned cell table; returns a ``SinkResult``: a report per written batch
    (``{"table", "rows_written"}``, cell versions newly stored) and the ``DeadLetter`` of every refused element.

    ::

        import apache_beam as beam
        from beamflow.postgres.cells import Cell, PostgresCellStore, RowKeySalter
        from runners.direct import local_options
        from transforms import WriteVersionedCells

        dsn = "postgresql://postgres@127.0.0.1:5432/beamflow"
        events = [{"user": "u1", "ts_ms": 2, "email": "new@example.com"}, {"user": "u1", "ts_ms": 1, "email": "old@x"}]
        with beam.Pipeline(options=local_options()) as p:
            cells = p | beam.Create(events) | beam.Map(
                lambda e: Cell(e["user"].encode(), "profile:email", e["ts_ms"], e["email"].encode())
            )
            cells | WriteVersionedCells(dsn, "example_user_cells", salt_buckets=16)
        store = PostgresCellStore("example_user_cells", dsn=dsn)
        assert store.get(RowKeySalter(16).salt(b"u1"), "profile:email").value == b"new@example.com"  # newest wins
        store.close()

    Guarantee: idempotent, hence effectively exactly-once given deterministic row keys and cell timestamps:
    every cell version is stored once (a replayed version is a no-op) and reads return the newest timestamp,
    whatever order the versions arrived in. Cells are flushed in batches (by count, bytes, age) and always
    before a bundle ends. ``salt_buckets`` prefixes row keys with a deterministic bucket byte so time-ordered
    keys spread out.

    Needs: a reachable PostgreSQL (``dsn``); the table is created if missing.
    """

    GUARANTEES = {"": _MutateFn.GUARANTEE}

    def __init__(
        self,
        dsn: str,
        table: str,
        *,
        schema: str | None = None,
        max_cells: int = 10_000,
        max_bytes: int = 8 * 1024 * 1024,
        max_seconds: float = 5.0,
        salt_buckets: int | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__()
        if salt_buckets is not None:
            RowKeySalter(salt_buckets)  # validates the bucket count now, not on a worker
        self._fn = _MutateFn(dsn, table, schema, max_cells, max_bytes, max_seconds, salt_buckets, retry)

    def expand(self, cells: beam.PCollection) -> SinkResult:
        return write_with(cells, self._fn, "Mutate")

"""``WriteVersionedCells``: HBase-style versioned cells (row, family:qualifier, timestamp -> value) into
PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.pvalue import TaggedOutput
from apache_beam.transforms.window import GlobalWindows

from beamflow.deadletter import DeadLetter, encode_payload
from beamflow.postgres.cells import BufferedMutator, Cell, PostgresCellStore, RowKeySalter
from beamflow.postgres.retry import RetryPolicy
from beamflow.postgres.writer import open_pool

__all__ = ["DEAD_LETTERS", "WriteVersionedCells"]

DEAD_LETTERS = "dead_letters"
_STAGE = "write_versioned_cells"


class _MutateFn(beam.DoFn):
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
        self._dsn = dsn
        self._table = table
        self._schema = schema
        self._max_cells = max_cells
        self._max_bytes = max_bytes
        self._max_seconds = max_seconds
        self._salt_buckets = salt_buckets
        self._retry = retry
        self._dead = Metrics.counter("beamflow.cells", "dead_letters")

    def setup(self) -> None:
        self._pool = open_pool(self._dsn)
        self._store = PostgresCellStore(self._table, pool=self._pool, schema=self._schema, retry=self._retry)
        salter = RowKeySalter(self._salt_buckets) if self._salt_buckets else None
        self._mutator = BufferedMutator(self._store, self._max_cells, self._max_bytes, self._max_seconds, salter)

    def process(self, cell: Any) -> Iterator[TaggedOutput]:
        if not isinstance(cell, Cell):
            self._dead.inc()
            yield TaggedOutput(
                DEAD_LETTERS,
                DeadLetter(
                    encode_payload(repr(cell)),
                    _STAGE,
                    f"expected a Cell, got {type(cell).__name__}",
                    error="TypeError",
                ),
            )
            return
        for dead in self._mutator.mutate(cell):
            self._dead.inc()
            yield TaggedOutput(DEAD_LETTERS, dead)

    def finish_bundle(self) -> Iterator[TaggedOutput]:
        for dead in self._mutator.flush():
            self._dead.inc()
            yield TaggedOutput(DEAD_LETTERS, GlobalWindows.windowed_value(dead))

    def teardown(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.close()


class WriteVersionedCells(beam.PTransform):
    """Writes ``Cell`` elements to a versioned cell table; returns the PCollection of ``DeadLetter``.

    ::

        cells = events | beam.Map(
            lambda e: Cell(e["user"].encode(), "profile:email", e["ts_ms"], e["email"].encode())
        )
        dead_letters = cells | WriteVersionedCells(dsn, "user_cells", salt_buckets=16)
        # read back: PostgresCellStore("user_cells", dsn=dsn).get(RowKeySalter(16).salt(b"u1"),
        # "profile:email")

    Guarantee: idempotent, hence effectively exactly-once given deterministic row keys and cell timestamps:
    every cell version is stored once (a replayed version is a no-op) and reads return the newest timestamp,
    whatever order the versions arrived in. Cells are flushed in batches (by count, bytes, age) and always
    before a bundle ends. ``salt_buckets`` prefixes row keys with a deterministic bucket byte so time-ordered
    keys spread out.

    Needs: a reachable PostgreSQL (``dsn``); the table is created if missing.
    """

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

    def expand(self, cells: beam.PCollection) -> beam.PCollection:
        outputs = cells | "Mutate" >> beam.ParDo(self._fn).with_outputs(DEAD_LETTERS)
        return outputs[DEAD_LETTERS]

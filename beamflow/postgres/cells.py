"""HBase-style versioned cells: (row key, "family:qualifier", timestamp) -> value; reads see the newest.

The model is HBase's, so a real HBase backend can implement the same small ``CellStore`` protocol later:

- a ``Cell`` has a row key (bytes), a column ``family:qualifier``, an explicit timestamp that is its version,
  and a value (bytes);
- ``BufferedMutator`` batches mutations like HBase's, flushing by cell count or bytes;
- ``RowKeySalter`` prefixes keys with a deterministic bucket byte (a stable hash of the key mod N) so that
  time-ordered keys spread over N ranges instead of hammering one;
- ``PostgresCellStore`` keeps every version in one table keyed by (row, family, qualifier, ts); reads take the
  newest.

Writing a cell is idempotent: a cell version is immutable (``ON CONFLICT DO NOTHING``), so replays change
nothing and deliveries in any order converge on the same newest values. Explicit, deterministic timestamps are
what make this effectively exactly-once; never use wall-clock write time as the version.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from psycopg import sql
from psycopg_pool import ConnectionPool

from beamflow.deadletter import DeadLetter
from beamflow.postgres.retry import RetryPolicy
from beamflow.postgres.table import TableSpec
from beamflow.postgres.writer import PostgresUpsertWriter, open_pool

__all__ = ["BufferedMutator", "Cell", "CellStore", "PostgresCellStore", "RowKeySalter", "split_column"]


def split_column(column: str) -> tuple[str, str]:
    """``"family:qualifier"`` -> (family, qualifier); the family non-empty, printable, no ':'."""
    if not isinstance(column, str) or ":" not in column:
        raise ValueError(f"column {column!r} must be 'family:qualifier'")
    family, qualifier = column.split(":", 1)
    if not family or not family.isprintable():
        raise ValueError(f"column {column!r} has an empty or unprintable family")
    return family, qualifier


@dataclass(frozen=True)
class Cell:
    """One version of one cell. ``timestamp`` is the version (e.g. event time in ms); ``value``: raw bytes."""

    row: bytes
    column: str
    timestamp: int
    value: bytes

    def __post_init__(self) -> None:
        if isinstance(self.row, str):
            object.__setattr__(self, "row", self.row.encode("utf-8"))
        if not isinstance(self.row, bytes) or not self.row:
            raise ValueError(f"cell row key must be non-empty bytes, got {self.row!r}")
        split_column(self.column)
        if not isinstance(self.timestamp, int) or isinstance(self.timestamp, bool):
            raise ValueError(f"cell timestamp must be an int (the version), got {self.timestamp!r}")
        if not isinstance(self.value, bytes):
            raise ValueError(f"cell value must be bytes, got {type(self.value).__name__}")

    def size(self) -> int:
        return len(self.row) + len(self.column) + len(self.value) + 8


class CellStore(Protocol):
    """What a versioned cell backend offers (PostgreSQL here; HBase/Bigtable can follow)."""

    def mutate(self, cells: Sequence[Cell]) -> list[DeadLetter]:
        """Writes the cells (idempotently); returns the ones the backend rejected."""
        ...

    def get(self, row: bytes, column: str) -> Cell | None:
        """The newest version of one cell, or None."""
        ...

    def scan(
        self,
        start_row: bytes | None = None,
        stop_row: bytes | None = None,
        columns: Sequence[str] | None = None,
        limit: int | None = None,
    ) -> Iterator[Cell]:
        """Newest version of every cell with start_row <= row < stop_row, ordered by row then column."""
        ...


class RowKeySalter:
    """Deterministic bucket prefix: ``bytes([stable_hash(key) % buckets]) + key``.

    The bucket depends only on the key, so a replay lands in the same place; readers of one key compute the
    same prefix, and range scans fan out over ``prefixes()``.
    """

    def __init__(self, buckets: int) -> None:
        if not 1 <= buckets <= 256:
            raise ValueError(f"buckets must be between 1 and 256, got {buckets}")
        self.buckets = buckets

    def bucket(self, key: bytes) -> int:
        return hashlib.blake2b(key, digest_size=8).digest()[0] % self.buckets

    def salt(self, key: bytes) -> bytes:
        return bytes([self.bucket(key)]) + key

    def unsalt(self, salted: bytes) -> bytes:
        return salted[1:]

    def prefixes(self) -> list[bytes]:
        return [bytes([b]) for b in range(self.buckets)]


class BufferedMutator:
    """Collects cells and hands them to a ``CellStore`` in batches (by count, bytes, or age), like HBase's."""

    def __init__(
        self,
        store: CellStore,
        max_cells: int = 10_000,
        max_bytes: int = 8 * 1024 * 1024,
        max_seconds: float = 5.0,
        salter: RowKeySalter | None = None,
    ) -> None:
        self.store = store
        self.max_cells = max_cells
        self.max_bytes = max_bytes
        self.max_seconds = max_seconds
        self.salter = salter
        self._cells: list[Cell] = []
        self._bytes = 0
        self._since: float | None = None

    def mutate(self, cell: Cell) -> list[DeadLetter]:
        if self.salter is not None:
            cell = Cell(self.salter.salt(cell.row), cell.column, cell.timestamp, cell.value)
        if not self._cells:
            self._since = time.monotonic()
        self._cells.append(cell)
        self._bytes += cell.size()
        return self.flush() if self.due() else []

    def due(self) -> bool:
        if not self._cells:
            return False
        if len(self._cells) >= self.max_cells or self._bytes >= self.max_bytes:
            return True
        return self._since is not None and time.monotonic() - self._since >= self.max_seconds

    def flush(self) -> list[DeadLetter]:
        if not self._cells:
            return []
        cells, self._cells, self._bytes, self._since = self._cells, [], 0, None
        return self.store.mutate(cells)


class PostgresCellStore:
    """Cells in a table ``(row_key bytea, family text, qualifier text, ts bigint, value bytea)``."""

    def __init__(
        self,
        table: str,
        *,
        dsn: str | None = None,
        pool: ConnectionPool | None = None,
        schema: str | None = None,
        retry: RetryPolicy | None = None,
        create: bool = True,
    ) -> None:
        self.spec = TableSpec(
            table=table,
            schema=schema,
            key=("row_key", "family", "qualifier", "ts"),
            version=(),  # a cell version is immutable: replays are no-ops
            columns={
                "row_key": "bytea NOT NULL",
                "family": "text NOT NULL",
                "qualifier": "text NOT NULL",
                "ts": "bigint NOT NULL",
                "value": "bytea NOT NULL",
            },
        )
        if (dsn is None) == (pool is None):
            raise ValueError("pass exactly one of dsn= or pool=")
        self._own_pool = pool is None
        self.pool: ConnectionPool = pool if pool is not None else open_pool(str(dsn))
        self.retry = retry or RetryPolicy()
        self.writer = PostgresUpsertWriter(
            self.spec,
            pool=self.pool,
            create=create,
            retry=self.retry,
            stage=f"cells:{self.spec.display_name}",
        )

    def mutate(self, cells: Sequence[Cell]) -> list[DeadLetter]:
        rows: list[Mapping[str, Any]] = []
        for cell in cells:
            family, qualifier = split_column(cell.column)
            rows.append(
                {
                    "row_key": cell.row,
                    "family": family,
                    "qualifier": qualifier,
                    "ts": cell.timestamp,
                    "value": cell.value,
                }
            )
        return self.writer.write_batch(rows)

    def get(self, row: bytes, column: str) -> Cell | None:
        family, qualifier = split_column(column)
        query = sql.SQL(
            "SELECT ts, value FROM {t} WHERE row_key = %s AND family = %s AND qualifier = %s ORDER BY ts DESC LIMIT 1"
        ).format(t=self.spec.qualified)

        def read() -> Any:
            with self.pool.connection() as conn:
                return conn.execute(query, (row, family, qualifier)).fetchone()

        found = self.retry.call(read)
        if found is None:
            return None
        return Cell(row, column, int(found[0]), bytes(found[1]))

    def versions(self, row: bytes, column: str, limit: int = 10) -> list[Cell]:
        """Up to ``limit`` versions of one cell, newest first."""
        family, qualifier = split_column(column)
        query = sql.SQL(
            "SELECT ts, value FROM {t} WHERE row_key = %s AND family = %s AND qualifier = %s ORDER BY ts DESC LIMIT %s"
        ).format(t=self.spec.qualified)

        def read() -> list[Any]:
            with self.pool.connection() as conn:
                return conn.execute(query, (row, family, qualifier, limit)).fetchall()

        return [Cell(row, column, int(ts), bytes(value)) for ts, value in self.retry.call(read)]

    def scan(
        self,
        start_row: bytes | None = None,
        stop_row: bytes | None = None,
        columns: Sequence[str] | None = None,
        limit: int | None = None,
    ) -> Iterator[Cell]:
        conditions: list[sql.Composable] = []
        params: list[Any] = []
        if start_row is not None:
            conditions.append(sql.SQL("row_key >= %s"))
            params.append(start_row)
        if stop_row is not None:
            conditions.append(sql.SQL("row_key < %s"))
            params.append(stop_row)
        if columns:
            pairs = [split_column(c) for c in columns]
            conditions.append(sql.SQL("(family, qualifier) IN (SELECT * FROM unnest(%s::text[], %s::text[]))"))
            params.extend([[f for f, _ in pairs], [q for _, q in pairs]])
        where = sql.SQL(" WHERE ") + sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("")
        query = sql.SQL(
            "SELECT DISTINCT ON (row_key, family, qualifier) row_key, family, qualifier, ts, value "
            "FROM {t}{where} ORDER BY row_key, family, qualifier, ts DESC{limit}"
        ).format(
            t=self.spec.qualified,
            where=where,
            limit=sql.SQL(" LIMIT {}").format(sql.Literal(int(limit))) if limit is not None else sql.SQL(""),
        )

        def read() -> list[Any]:
            with self.pool.connection() as conn:
                return conn.execute(query, params).fetchall()

        for row_key, family, qualifier, ts, value in self.retry.call(read):
            yield Cell(bytes(row_key), f"{family}:{qualifier}", int(ts), bytes(value))

    def close(self) -> None:
        if self._own_pool:
            self.pool.close()

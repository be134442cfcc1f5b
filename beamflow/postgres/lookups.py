"""Lookup handlers (``beamflow.enrichment.LookupHandler``) for a PostgreSQL table and for the versioned cell store.

Each answers a batch of keys with one statement (``WHERE key = ANY(%s)``, keys bound as one array parameter, never
formatted into the SQL), from a small pool opened in ``__enter__`` (once per worker) and sized to the lookups in
flight. Every statement has a server-side deadline (``statement_timeout``) and connections a connect timeout, so a
hung server turns into a retryable error instead of a stuck bundle.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from psycopg import sql
from psycopg_pool import ConnectionPool

from beamflow.postgres.cells import RowKeySalter, split_column
from beamflow.postgres.retry import is_transient
from beamflow.postgres.table import TableSpec

__all__ = ["CellStoreLookup", "PostgresTableLookup"]

_QUERY_CANCELED = "57014"  # statement_timeout fired: the server was slow, not the request wrong


class _PooledLookup:
    """The connection handling both handlers share: a pool with connect and statement timeouts."""

    columns: tuple[str, ...]

    def __init__(self, dsn: str, timeout_s: float, pool_size: int) -> None:
        self.dsn = dsn
        self.timeout_s = timeout_s
        self.pool_size = pool_size
        self._pool: ConnectionPool | None = None

    def __enter__(self) -> Any:
        if self._pool is None:
            from beamflow.postgres.writer import open_pool

            # The statement timeout and the connection wait share the lookup's deadline; autocommit: reads only.
            self._pool = open_pool(
                self.dsn,
                max_size=self.pool_size,
                timeout=self.timeout_s,
                statement_timeout_s=self.timeout_s,
                autocommit=True,
                name="beamflow-lookup",
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_pool"] = None  # handlers travel to workers unopened
        return state

    def is_transient(self, exc: BaseException) -> bool:
        return is_transient(exc) or getattr(exc, "sqlstate", None) == _QUERY_CANCELED

    def cache_key(self, key: Hashable) -> Hashable:
        return key

    def _fetch(self, query: sql.Composed, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        if self._pool is None:
            self.__enter__()
        assert self._pool is not None
        with self._pool.connection() as conn:
            return conn.execute(query, params).fetchall()


class PostgresTableLookup(_PooledLookup):
    """Rows of a dimension table by key: ``SELECT key, columns FROM table WHERE key = ANY(%s)``.

    A returned row maps each of ``columns`` to its value. Keys the table lacks are absent from the answer.
    """

    def __init__(
        self,
        dsn: str,
        table: str,
        key_column: str,
        columns: Sequence[str],
        *,
        schema: str | None = None,
        timeout_s: float = 5.0,
        pool_size: int = 4,
    ) -> None:
        super().__init__(dsn, timeout_s, pool_size)
        if not columns:
            raise ValueError("PostgresTableLookup needs at least one column to return")
        self.table = table
        self.key_column = key_column
        self.columns = tuple(columns)
        target = TableSpec(table, key=(key_column,), schema=schema).qualified
        self._query = sql.SQL("SELECT {key}, {columns} FROM {table} WHERE {key} = ANY(%s)").format(
            key=sql.Identifier(key_column),
            columns=sql.SQL(", ").join(map(sql.Identifier, self.columns)),
            table=target,
        )

    @property
    def name(self) -> str:
        return self.table

    def cache_key(self, key: Hashable) -> Hashable:
        return (self.table, key)

    def lookup(self, keys: Sequence[Hashable]) -> dict[Hashable, Mapping[str, Any]]:
        rows = self._fetch(self._query, (list(keys),))
        return {row[0]: dict(zip(self.columns, row[1:], strict=True)) for row in rows}


def _utf8(value: bytes) -> Any:
    return value.decode("utf-8")


class CellStoreLookup(_PooledLookup):
    """The newest version of some cells of each row of a ``PostgresCellStore`` table (HBase multi-get).

    ``columns`` are ``family:qualifier`` names; a returned row maps each column's qualifier (or ``alias``) to its
    decoded value (``decode``: UTF-8 text by default), None for a cell the row lacks. A key with none of the cells is
    absent. With ``salt_buckets`` the row keys are salted as ``WriteVersionedCells`` salted them. Keys are str (UTF-8)
    or bytes.
    """

    def __init__(
        self,
        dsn: str,
        table: str,
        columns: Sequence[str],
        *,
        schema: str | None = None,
        salt_buckets: int | None = None,
        alias: Mapping[str, str] | None = None,
        decode: Callable[[bytes], Any] = _utf8,
        timeout_s: float = 5.0,
        pool_size: int = 4,
    ) -> None:
        super().__init__(dsn, timeout_s, pool_size)
        if not columns:
            raise ValueError("CellStoreLookup needs at least one column")
        pairs = [split_column(c) for c in columns]
        self.table = table
        self.cells = tuple(columns)
        names = dict(alias or {})
        self.columns = tuple(names.get(c, q) for c, (_, q) in zip(columns, pairs, strict=True))
        self._by_cell = {pair: name for pair, name in zip(pairs, self.columns, strict=True)}
        self._families = [f for f, _ in pairs]
        self._qualifiers = [q for _, q in pairs]
        self.salter = RowKeySalter(salt_buckets) if salt_buckets else None
        self.decode = decode
        target = TableSpec(table, key=("row_key",), schema=schema).qualified
        self._query = sql.SQL(
            "SELECT DISTINCT ON (row_key, family, qualifier) row_key, family, qualifier, value FROM {table} "
            "WHERE row_key = ANY(%s) AND (family, qualifier) IN (SELECT * FROM unnest(%s::text[], %s::text[])) "
            "ORDER BY row_key, family, qualifier, ts DESC"
        ).format(table=target)

    @property
    def name(self) -> str:
        return self.table

    def cache_key(self, key: Hashable) -> Hashable:
        return (self.table, key)

    def _row_key(self, key: Hashable) -> bytes:
        raw = key.encode("utf-8") if isinstance(key, str) else key
        if not isinstance(raw, bytes):
            raise TypeError(f"cell store keys are str or bytes, got {type(key).__name__}")
        return self.salter.salt(raw) if self.salter is not None else raw

    def lookup(self, keys: Sequence[Hashable]) -> dict[Hashable, Mapping[str, Any]]:
        by_row = {self._row_key(k): k for k in keys}
        found = self._fetch(self._query, (list(by_row), self._families, self._qualifiers))
        out: dict[Hashable, dict[str, Any]] = {}
        for row_key, family, qualifier, value in found:
            key = by_row[bytes(row_key)]
            row = out.setdefault(key, dict.fromkeys(self.columns))
            row[self._by_cell[(family, qualifier)]] = self.decode(bytes(value))
        return dict(out)

"""Idempotent batched upserts into PostgreSQL: COPY into a temp staging table, then INSERT ... ON CONFLICT.

Each batch is one transaction:

1. rows are deduplicated by key, keeping the highest version (``ON CONFLICT`` may not touch a row twice in
   one statement);
2. ``COPY`` (binary when every value is safe to encode in binary, else text) into a session-local ``TEMP``
   table with the target's column types, emptied at commit;
3. ``INSERT INTO target SELECT ... FROM staging ON CONFLICT (key) DO UPDATE SET ... WHERE (target.version) <
   (excluded.version)``, or ``DO NOTHING`` for immutable rows (no version columns).

Writing the same rows again, in any order and with any batch boundaries, leaves the table as one clean run
would: the write is idempotent, so replays after a crash give effectively exactly-once results as long as keys
and versions are deterministic. Transient failures (connection lost, server restart, serialization failure,
deadlock) are retried with exponential backoff and jitter. A batch that fails because of its DATA is bisected
until the offending rows are isolated; those become ``DeadLetter`` records carrying the database's message,
and every other row commits.

Schema evolution (``TableSpec(extra_fields="evolve", columns=...)``): when the table is first read, the declared
columns are compared with it (``table.plan_evolution``) and anything but an addition of nullable columns is refused
with ``SchemaEvolutionError`` before any row is written. A declared column the table lacks is added (``ALTER TABLE
... ADD COLUMN IF NOT EXISTS``, nullable) in its own transaction just before the first batch whose rows carry that
field; rows without it keep working (NULL). The session-local staging table is named after the column set, so a
pooled session that staged the old columns gets a fresh one with the new columns.
"""

from __future__ import annotations

import hashlib
import logging
import operator
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from psycopg import sql
from psycopg.types.json import Json, Jsonb
from psycopg_pool import ConnectionPool

from beamflow.deadletter import DeadLetter, encode_payload
from beamflow.postgres.retry import RetryPolicy, error_code, error_message, is_data_error
from beamflow.postgres.table import (
    Column,
    SchemaEvolutionError,
    TableSpec,
    add_columns,
    create_table,
    plan_evolution,
    table_columns,
)

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_ROWS", "PostgresUpsertWriter", "WriterStats", "open_pool"]

log = logging.getLogger(__name__)

DEFAULT_MAX_ROWS = 10_000  # below ~10k rows per transaction the commit overhead shows (benchmarks/postgres_upsert.py)
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_SECONDS = 5.0

# Integer OIDs whose binary dumpers in psycopg silently truncate out-of-range Python ints (measured: 2**40
# into int4 stores 0), so those values are range-checked before binary COPY; anything else unusual goes
# through text COPY.
_INT_RANGES = {21: (-(2**15), 2**15 - 1), 23: (-(2**31), 2**31 - 1), 20: (-(2**63), 2**63 - 1)}
# Types whose binary dumpers accept the matching Python values exactly; other OIDs are still tried in binary,
# and a client-side encoding failure sends that batch through text COPY, where the server parses (and judges)
# every value.
_FLOAT_OIDS = {700, 701}
_NUMERIC_OID = 1700
_JSON_OID = 114
_JSONB_OID = 3802
_SIZE_SAMPLE = 8

SourceOf = Callable[[Mapping[str, Any]], tuple[str | None, int | None, int | None]]


# A writer frozen inside a transaction (a SIGSTOPped zombie instance, a worker descheduled for minutes) holds its
# row locks, and every other instance writing the same keys waits on them for as long as it stays frozen (found by
# benchmarks/peers.py's zombie drill: 3.5 minutes, until the frozen one was resumed by hand). The server ends such a
# session after this long; its transaction rolls back, which every beamflow sink survives (the bundle is retried and
# the writes are idempotent or claimed by Kafka coordinates). Far above any real pause inside a sink's transaction.
IDLE_IN_TRANSACTION_TIMEOUT_S = 120.0
# A connection lent less than this long ago is lent again unchecked: it was just working, and a server that died
# since fails the next statement as it would fail one in flight (the caller retries). The check costs a round trip,
# which a writer borrowing a connection several times per batch would pay each time.
RECENTLY_LENT_S = 1.0


class _CheckUnlessRecent:
    """The pool's ``check``: a ping, skipped for a connection lent less than ``RECENTLY_LENT_S`` ago. (Stamped on
    lending, not on return: a ``reset`` callback would make the pool return connections through its worker thread.)"""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.lent: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()

    def __call__(self, conn: Any) -> None:
        now = self.clock()
        last, self.lent[conn] = self.lent.get(conn), now
        if last is None or now - last >= RECENTLY_LENT_S:
            ConnectionPool.check_connection(conn)


def open_pool(
    dsn: str,
    max_size: int = 2,
    timeout: float = 10.0,
    idle_in_transaction_timeout_s: float | None = IDLE_IN_TRANSACTION_TIMEOUT_S,
    *,
    statement_timeout_s: float | None = None,
    autocommit: bool = False,
    name: str = "beamflow-postgres",
) -> ConnectionPool:
    """A small psycopg pool, the one every beamflow store and lookup opens.

    - Connections are health-checked on checkout (a restarted server leaves dead ones) unless lent less than
      ``RECENTLY_LENT_S`` ago.
    - The server ends a session that sits idle inside a transaction for ``idle_in_transaction_timeout_s`` (None:
      the server's setting), so a frozen instance cannot block the others.
    - ``statement_timeout_s`` (None: the server's setting) bounds each statement on the server.
    - ``timeout`` bounds the wait for a connection and each connection attempt.

    Settings the DSN's own ``options`` give win over these (they are sent after them): a user who sets one decides.
    A login the server refuses raises ``PostgresRefused`` here, in one line.
    """
    from psycopg.conninfo import conninfo_to_dict

    from beamflow.postgres.retry import check_login
    from beamflow.secrets import postgres_conninfo

    conninfo = postgres_conninfo(dsn)  # a password reference (env:/file:) is resolved here, in the worker that connects
    connect_timeout = max(1, int(timeout))
    check_login(conninfo, connect_timeout)  # a refused login fails here, not as pool timeouts retried for minutes
    settings = []
    if idle_in_transaction_timeout_s is not None:
        settings.append(f"-c idle_in_transaction_session_timeout={int(idle_in_transaction_timeout_s * 1000)}")
    if statement_timeout_s is not None:
        settings.append(f"-c statement_timeout={int(statement_timeout_s * 1000)}")
    own_options = conninfo_to_dict(conninfo).get("options")
    if own_options:
        settings.append(str(own_options))  # later -c settings override earlier ones
    kwargs: dict[str, Any] = {"connect_timeout": connect_timeout, "autocommit": autocommit}
    if settings:
        kwargs["options"] = " ".join(settings)
    pool = ConnectionPool(
        conninfo,
        min_size=1,
        max_size=max_size,
        timeout=timeout,
        open=False,
        check=_CheckUnlessRecent(),
        kwargs=kwargs,
        name=name,
    )
    pool.open(wait=False)
    return pool


@dataclass
class WriterStats:
    rows_in: int = 0
    rows_written: int = 0  # rows the database inserted or updated (replays of older versions do not count)
    batches: int = 0
    transactions: int = 0
    retries: int = 0
    text_fallbacks: int = 0
    dead_letters: int = 0
    duplicates_in_batch: int = 0


# One row on its way: (the element as given, its values in table column order). A plain tuple, because
# a class instance per row costs a Python-level call at 100k rows/s.
_Item = tuple[Mapping[str, Any], tuple[Any, ...]]


class _ClientEncodingError(Exception):
    """A value could not be encoded for binary COPY; the batch is retried in text format."""


class PostgresUpsertWriter:
    """Buffers rows (mappings of column name to value) and upserts them in batches; see the module docstring.

    ``add``/``add_many`` flush when ``max_rows``, ``max_bytes`` or ``max_seconds`` (since the first buffered
    row) is reached; ``flush`` writes whatever is buffered. All three return the dead letters of what they
    flushed. ``pool`` may be a shared ``ConnectionPool``; with ``dsn`` the writer opens and closes its own.
    """

    def __init__(
        self,
        spec: TableSpec,
        *,
        dsn: str | None = None,
        pool: ConnectionPool | None = None,
        max_rows: int = DEFAULT_MAX_ROWS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_seconds: float = DEFAULT_MAX_SECONDS,
        create: bool = False,
        binary: bool = True,
        retry: RetryPolicy | None = None,
        source_of: SourceOf | None = None,
        stage: str | None = None,
    ) -> None:
        if (dsn is None) == (pool is None):
            raise ValueError("pass exactly one of dsn= or pool=")
        if max_rows < 1 or max_bytes < 1 or max_seconds <= 0:
            raise ValueError("max_rows, max_bytes and max_seconds must be positive")
        self.spec = spec
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.max_seconds = max_seconds
        self.create = create
        self.binary = binary
        self.retry = retry or RetryPolicy()
        self.source_of = source_of
        self.stage = stage or f"postgres:{spec.display_name}"
        self.stats = WriterStats()
        self._own_pool = pool is None
        self._pool: ConnectionPool = pool if pool is not None else open_pool(str(dsn))
        self._columns: list[Column] | None = None
        self._evolvable: dict[str, str] = {}  # declared columns the table lacks: name -> SQL type
        self._staging_names: dict[tuple[str, ...], sql.Identifier] = {}
        self._buffer: list[Mapping[str, Any]] = []
        self._buffer_bytes = 0
        self._first_buffered_at: float | None = None

    # ---- buffering ---------------------------------------------------------------------------------------

    def add(self, row: Mapping[str, Any]) -> list[DeadLetter]:
        dead = self.add_many((row,))
        # add_many reads the clock only every 256 rows; a single add on a slow stream must honour max_seconds.
        if self._buffer and self._aged():
            dead.extend(self.flush())
        return dead

    def add_many(self, rows: Iterable[Mapping[str, Any]]) -> list[DeadLetter]:
        """``add`` for many rows without the per-call overhead (the age threshold is checked every 256 rows)."""
        dead: list[DeadLetter] = []
        buffer = self._buffer
        stats = self.stats
        for row in rows:
            if not buffer:
                self._first_buffered_at = time.monotonic()
            buffer.append(row)
            stats.rows_in += 1
            if not stats.rows_in % _SIZE_SAMPLE:  # sampled: sizing every row costs as much as the COPY
                self._buffer_bytes += _SIZE_SAMPLE * _approx_size(row)
            if (
                len(buffer) >= self.max_rows
                or self._buffer_bytes >= self.max_bytes
                or (not stats.rows_in % 256 and self._aged())
            ):
                dead.extend(self.flush())
                buffer = self._buffer
        return dead

    def _aged(self) -> bool:
        since = self._first_buffered_at
        return since is not None and time.monotonic() - since >= self.max_seconds

    def due(self) -> bool:
        """True when the buffer has reached a row, byte or age threshold."""
        if not self._buffer:
            return False
        if len(self._buffer) >= self.max_rows or self._buffer_bytes >= self.max_bytes:
            return True
        return self._first_buffered_at is not None and time.monotonic() - self._first_buffered_at >= self.max_seconds

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def flush(self) -> list[DeadLetter]:
        """Writes the buffered rows; returns the dead letters (rows the database or the encoder rejected)."""
        if not self._buffer:
            return []
        rows, self._buffer, self._buffer_bytes, self._first_buffered_at = self._buffer, [], 0, None
        return self.write_batch(rows)

    def close(self) -> None:
        """Flushes nothing (call ``flush`` first); closes the pool if this writer opened it."""
        if self._own_pool:
            self._pool.close()

    def __enter__(self) -> PostgresUpsertWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- one batch ---------------------------------------------------------------------------------------

    def columns(self) -> list[Column]:
        """The target's columns (creating the table first when asked), read once per writer."""
        if self._columns is None:

            def load() -> list[Column]:
                with self._pool.connection() as conn:
                    if self.create:
                        create_table(conn, self.spec)
                    columns = table_columns(conn, self.spec)
                    if self.spec.evolves:
                        assert self.spec.columns is not None  # TableSpec checks this
                        plan = plan_evolution(conn, self.spec, columns, self.spec.columns)
                        plan.raise_if_refused()  # before any row is written
                        self._evolvable = dict(plan.add)
                    return columns

            self._columns = self.retry.call(load, on_retry=self._count_retry)
        return self._columns

    def evolve(self, names: Iterable[str] | None = None) -> list[str]:
        """Adds the declared columns the table lacks (``names`` of them, or all), nullable; returns the added
        names. Raises ``SchemaEvolutionError`` if the spec does not evolve or a name is not declared."""
        self.columns()
        wanted = list(self._evolvable) if names is None else list(dict.fromkeys(names))
        if not self.spec.evolves:
            raise SchemaEvolutionError(f"table {self.spec.display_name}: TableSpec(extra_fields='evolve') not set")
        unknown = [n for n in wanted if n not in self._evolvable]
        if unknown:
            raise SchemaEvolutionError(f"table {self.spec.display_name}: no declared type for new column(s) {unknown}")
        if not wanted:
            return []
        additions = [(n, self._evolvable[n]) for n in wanted]

        def alter() -> None:
            with self._pool.connection() as conn, conn.transaction():
                add_columns(conn, self.spec, additions)

        self.retry.call(alter, on_retry=self._count_retry)
        log.info("added nullable columns %s to %s", wanted, self.spec.display_name)
        self._columns = None  # re-read (and re-plan) with the new columns
        self.columns()
        return wanted

    def _fields_to_evolve(self, rows: Sequence[Mapping[str, Any]], known: frozenset[str]) -> list[str]:
        found: dict[str, None] = {}
        evolvable = self._evolvable
        for row in rows:
            if isinstance(row, Mapping) and not known.issuperset(row):
                found.update((k, None) for k in row if k in evolvable)
        return list(found)

    def write_batch(self, rows: Sequence[Mapping[str, Any]]) -> list[DeadLetter]:
        """Upserts ``rows`` now (no buffering); returns the dead letters."""
        columns = self.columns()
        names = [c.name for c in columns]
        known = frozenset(names)
        if self._evolvable:
            new_fields = self._fields_to_evolve(rows, known)
            if new_fields:  # the table gains them before the first row carrying them is written
                self.evolve(new_fields)
                columns = self.columns()
                names = [c.name for c in columns]
                known = frozenset(names)
        check_extra = self.spec.extra_fields != "ignore"
        all_values = operator.itemgetter(*names) if len(names) > 1 else lambda r: (r[names[0]],)
        dead: list[DeadLetter] = []
        items: list[_Item] = []
        for row in rows:
            if type(row) is not dict and not isinstance(row, Mapping):
                dead.append(self._dead(row, "TypeError", f"expected a mapping of column -> value, got {type(row)}"))
                continue
            if check_extra and not known.issuperset(row):
                unknown = [k for k in row if k not in known]
                dead.append(
                    self._dead(row, "UnknownColumn", f"table {self.spec.display_name} has no column(s) {unknown}")
                )
                continue
            try:
                values = all_values(row)
            except KeyError:  # fields the row lacks are written as NULL
                values = tuple(row.get(n) for n in names)
            items.append((row, values))
        items = self._dedupe(items, names)
        self.stats.batches += 1
        if items:
            dead.extend(self._write_isolating(items, columns))
        self.stats.dead_letters += len(dead)
        return dead

    def _dedupe(self, items: list[_Item], names: list[str]) -> list[_Item]:
        key_of = operator.itemgetter(*[names.index(k) for k in self.spec.key])
        version_idx = [names.index(v) for v in self.spec.version]
        best: dict[Any, _Item] = {}
        for item in items:
            key = key_of(item[1])
            try:
                current = best.get(key)
            except TypeError:  # an unhashable key value: let the database judge the row on its own
                key, current = ("unhashable", id(item)), None
            if current is None:
                best[key] = item
                continue
            self.stats.duplicates_in_batch += 1
            if version_idx and _newer(item, current, version_idx):
                best[key] = item
        return list(best.values())

    def _write_isolating(self, items: list[_Item], columns: list[Column]) -> list[DeadLetter]:
        """Writes ``items``; on a data error splits them in halves until the bad rows stand alone."""
        try:
            self.retry.call(lambda: self._write_once(items, columns), on_retry=self._count_retry)
            return []
        except Exception as exc:
            if not is_data_error(exc):
                raise
            if len(items) == 1:
                return [self._dead(items[0][0], error_code(exc), error_message(exc))]
            middle = len(items) // 2
            return self._write_isolating(items[:middle], columns) + self._write_isolating(items[middle:], columns)

    def _write_once(self, items: list[_Item], columns: list[Column]) -> None:
        if self.binary and _binary_safe(items, columns):
            try:
                self._transaction(items, columns, binary=True)
                return
            except _ClientEncodingError:
                self.stats.text_fallbacks += 1
        self._transaction(items, columns, binary=False)

    def _staging_for(self, names: list[str]) -> sql.Identifier:
        """The session-local staging table for this column set: a new column set (after ``evolve``) gets a new
        name, because a pooled session may still hold the staging table created with the old columns."""
        key = tuple(names)
        staging = self._staging_names.get(key)
        if staging is None:
            digest = hashlib.sha1("\x00".join((self.spec.display_name, *names)).encode()).hexdigest()[:12]
            staging = self._staging_names[key] = sql.Identifier(f"beamflow_stage_{digest}")
        return staging

    def _transaction(self, items: list[_Item], columns: list[Column], binary: bool) -> None:
        names = [c.name for c in columns]
        staging = self._staging_for(names)
        with self._pool.connection() as conn:
            self.stats.transactions += 1
            with conn.transaction():
                conn.execute(
                    # Same column types (typmods included) but no NOT NULL: constraint errors then name the
                    # target table, not the staging table. Emptied at every commit; one per pooled session.
                    sql.SQL(
                        "CREATE TEMP TABLE IF NOT EXISTS {staging} ON COMMIT DELETE ROWS "
                        "AS SELECT {columns} FROM {target} WITH NO DATA"
                    ).format(
                        staging=staging,
                        columns=sql.SQL(", ").join(map(sql.Identifier, names)),
                        target=self.spec.qualified,
                    )
                )
                copy_sql = sql.SQL("COPY {staging} ({columns}) FROM STDIN{fmt}").format(
                    staging=staging,
                    columns=sql.SQL(", ").join(map(sql.Identifier, names)),
                    fmt=sql.SQL(" (FORMAT BINARY)" if binary else ""),
                )
                with conn.cursor() as cur:
                    if binary:
                        try:
                            converters = _binary_converters(columns, items)
                            with cur.copy(copy_sql) as copy:
                                copy.set_types([c.type_oid for c in columns])
                                for item in items:
                                    copy.write_row(_convert(item[1], converters))
                        except Exception as exc:
                            if getattr(exc, "sqlstate", None) is None and is_data_error(exc):
                                raise _ClientEncodingError(str(exc)) from exc
                            raise
                    else:
                        with cur.copy(copy_sql) as copy:
                            for item in items:
                                copy.write_row(tuple(_text_value(v) for v in item[1]))
                    cur.execute(self._upsert_sql(names, staging))
                    self.stats.rows_written += max(cur.rowcount, 0)

    def _upsert_sql(self, names: list[str], staging: sql.Identifier) -> sql.Composed:
        cols = sql.SQL(", ").join(map(sql.Identifier, names))
        key = sql.SQL(", ").join(map(sql.Identifier, self.spec.key))
        updates = [n for n in names if n not in self.spec.key]
        if self.spec.version and updates:
            target_version = sql.SQL(", ").join(sql.Identifier("t", v) for v in self.spec.version)
            new_version = sql.SQL(", ").join(sql.Identifier("excluded", v) for v in self.spec.version)
            action = sql.SQL("DO UPDATE SET {sets} WHERE ROW({old}) < ROW({new})").format(
                sets=sql.SQL(", ").join(
                    sql.SQL("{} = {}").format(sql.Identifier(n), sql.Identifier("excluded", n)) for n in updates
                ),
                old=target_version,
                new=new_version,
            )
        else:
            action = sql.Composed([sql.SQL("DO NOTHING")])
        return sql.SQL(
            "INSERT INTO {target} AS t ({cols}) SELECT {cols} FROM {staging} ON CONFLICT ({key}) {action}"
        ).format(target=self.spec.qualified, cols=cols, staging=staging, key=key, action=action)

    # ---- helpers
    # ---------------------------------------------------------------------------------------------------

    def _count_retry(self, exc: BaseException) -> None:
        self.stats.retries += 1

    def _dead(self, element: Any, code: str, reason: str) -> DeadLetter:
        topic: str | None = None
        partition: int | None = None
        offset: int | None = None
        if self.source_of is not None and isinstance(element, Mapping):
            try:
                topic, partition, offset = self.source_of(element)
            except Exception as exc:  # a broken source_of must not lose the dead letter itself
                log.warning("source_of failed on a dead letter: %s", exc)
        return DeadLetter(
            payload=encode_payload(element),
            stage=self.stage,
            reason=reason,
            topic=topic,
            partition=partition,
            offset=offset,
            error=code,
        )


def _newer(item: _Item, current: _Item, version_idx: list[int]) -> bool:
    """Whether ``item``'s version is strictly greater (NULLs sort lowest, like a row that can never win)."""
    new = tuple((item[1][i] is not None, item[1][i]) for i in version_idx)
    old = tuple((current[1][i] is not None, current[1][i]) for i in version_idx)
    try:
        return new > old
    except TypeError:
        return False


def _binary_safe(items: list[_Item], columns: list[Column]) -> bool:
    """False if an integer column gets a non-int or an out-of-range int (psycopg's binary dumpers would
    truncate it silently), or a float column a non-number; such batches go through text COPY instead."""
    for idx, column in enumerate(columns):
        bounds = _INT_RANGES.get(column.type_oid)
        if bounds is None and column.type_oid not in _FLOAT_OIDS:
            continue
        values = [item[1][idx] for item in items]
        kinds = set(map(type, values))
        kinds.discard(type(None))
        if bounds is None:
            if not kinds <= {float, int}:
                return False
            continue
        if not kinds:
            continue
        if kinds != {int}:
            return False
        present = [v for v in values if v is not None] if len(values) != values.count(None) else []
        if present and (min(present) < bounds[0] or max(present) > bounds[1]):
            return False
    return True


def _binary_converters(columns: list[Column], items: list[_Item]) -> list[tuple[int, Callable[[Any], Any]]]:
    """Per-column conversions that make binary COPY mean what text COPY means for the same Python value;
    only for columns of this batch that hold such values (most batches need none)."""
    converters: list[tuple[int, Callable[[Any], Any]]] = []
    for idx, column in enumerate(columns):
        convert: Callable[[Any], Any]
        kind: type
        if column.type_oid == _NUMERIC_OID:
            convert, kind = _float_as_decimal, float
        elif column.type_oid == _JSONB_OID:
            convert, kind = _str_as_jsonb_text, str
        elif column.type_oid == _JSON_OID:
            convert, kind = _str_as_json_text, str
        else:
            continue
        if kind in {type(item[1][idx]) for item in items}:
            converters.append((idx, convert))
    return converters


def _float_as_decimal(value: Any) -> Any:
    # The Decimal of the float's repr: exactly the digits text COPY would have sent.
    return Decimal(repr(value)) if type(value) is float else value


def _raw_json(text: str) -> str:
    return text


def _str_as_jsonb_text(value: Any) -> Any:
    # A str bound for jsonb is JSON text (the server parses and validates it), as in text COPY; without this,
    # the binary dumper would store it as a JSON string literal.
    return Jsonb(value, dumps=_raw_json) if type(value) is str else value


def _str_as_json_text(value: Any) -> Any:
    return Json(value, dumps=_raw_json) if type(value) is str else value


def _convert(values: tuple[Any, ...], converters: list[tuple[int, Callable[[Any], Any]]]) -> tuple[Any, ...]:
    if not converters:
        return values
    converted = list(values)
    for idx, convert in converters:
        converted[idx] = convert(converted[idx])
    return tuple(converted)


def _text_value(value: Any) -> Any:
    """Values for text COPY: JSON-able containers as JSON text; the server parses each per column type."""
    if isinstance(value, dict | list):
        import json

        return json.dumps(value)
    return value


def _approx_size(row: Any) -> int:
    """Roughly the bytes a row costs on the wire: string/bytes lengths plus 8 per other value."""
    try:
        values = row.values()
    except AttributeError:
        return 64
    return 8 * len(values) + sum([len(v) for v in values if type(v) in _SIZED])


_SIZED = (str, bytes, bytearray)

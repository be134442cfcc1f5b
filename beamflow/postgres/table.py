"""Validated table declarations: names that can only be identifiers, SQL types that can only be types.

Every name from configuration goes through ``validate_identifier`` (a plausible PostgreSQL identifier or a
clear ValueError) and is composed into SQL only with ``psycopg.sql.Identifier``; a quote, semicolon or comment
in a configured name is rejected before any SQL is built. SQL keywords (``order``, ``select``) are valid
names: quoting makes them safe.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

__all__ = ["Column", "TableSpec", "create_table", "table_columns", "validate_identifier", "validate_sql_type"]

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A type name (possibly several words), optional (precision[, scale]), optional trailing words ("with time
# zone", "NOT NULL"), optional []: no quotes, semicolons, commas outside the parentheses or comments can get
# through.
_SQL_TYPE = re.compile(
    r"[A-Za-z_][A-Za-z0-9_]*(?: [A-Za-z_][A-Za-z0-9_]*)*"
    r"(?: ?\(\s*\d+\s*(?:,\s*\d+\s*)?\))?"
    r"(?: [A-Za-z_][A-Za-z0-9_]*)*"
    r"(?:\[\])?"
    r"(?: NOT NULL| NULL)?",
    re.IGNORECASE,
)
MAX_IDENTIFIER_BYTES = 63


def validate_identifier(name: object, what: str = "identifier") -> str:
    """Returns ``name`` if it is a plausible PostgreSQL identifier (letters, digits, _; at most 63 bytes)."""
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name) or len(name) > MAX_IDENTIFIER_BYTES:
        raise ValueError(
            f"invalid {what} {name!r}: use letters, digits and underscores, "
            f"starting with a letter or underscore, at most {MAX_IDENTIFIER_BYTES} characters"
        )
    return name


def validate_sql_type(type_text: object, column: str) -> str:
    """Returns ``type_text`` if it looks like a column type, e.g. ``bigint``, ``numeric(12, 2)``, ``text NOT
    NULL``."""
    if not isinstance(type_text, str) or not _SQL_TYPE.fullmatch(type_text.strip()):
        raise ValueError(
            f"invalid SQL type {type_text!r} for column {column!r}: expected a type name with optional "
            "(precision, scale), [] and NOT NULL, e.g. 'numeric(12, 2) NOT NULL'"
        )
    return type_text.strip()


@dataclass(frozen=True)
class Column:
    """A target column as the database reports it."""

    name: str
    type_oid: int
    type_name: str
    not_null: bool


@dataclass(frozen=True)
class TableSpec:
    """An upsert target: table, key columns, version columns and, optionally, declared column types for
    creation.

    ``version`` empty means rows are immutable events: a key already present is left alone (``DO NOTHING``).
    With version columns, a row replaces the stored one only if its version, compared as a row value ``(v1,
    v2, ...)``, is strictly greater: replays and out-of-order deliveries cannot move a row backwards.
    """

    table: str
    key: tuple[str, ...]
    version: tuple[str, ...] = ()
    columns: Mapping[str, str] | None = None
    schema: str | None = None
    extra_fields: str = "error"  # what to do with element fields the table lacks: "error" (dead letter) or "ignore"

    def __post_init__(self) -> None:
        validate_identifier(self.table, "table name")
        if self.schema is not None:
            validate_identifier(self.schema, "schema name")
        object.__setattr__(self, "key", tuple(self.key))
        object.__setattr__(self, "version", tuple(self.version))
        if not self.key:
            raise ValueError(f"table {self.table!r}: at least one key column is required")
        for name in self.key:
            validate_identifier(name, "key column name")
        for name in self.version:
            validate_identifier(name, "version column name")
        if set(self.key) & set(self.version):
            raise ValueError(f"table {self.table!r}: a column cannot be both key and version")
        if self.columns is not None:
            columns = dict(self.columns)
            for name, type_text in columns.items():
                validate_identifier(name, "column name")
                validate_sql_type(type_text, name)
            missing = [c for c in (*self.key, *self.version) if c not in columns]
            if missing:
                raise ValueError(f"table {self.table!r}: key/version columns {missing} are not declared in columns")
            object.__setattr__(self, "columns", columns)
        if self.extra_fields not in ("error", "ignore"):
            raise ValueError(f"extra_fields must be 'error' or 'ignore', not {self.extra_fields!r}")

    @property
    def qualified(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.table) if self.schema else sql.Identifier(self.table)

    @property
    def display_name(self) -> str:
        return f"{self.schema}.{self.table}" if self.schema else self.table


def create_table(conn: psycopg.Connection[Any], spec: TableSpec) -> None:
    """``CREATE TABLE IF NOT EXISTS`` from the declared columns, primary key = the key columns."""
    if spec.columns is None:
        raise ValueError(f"table {spec.display_name!r}: declare columns (name -> SQL type) to create it")
    column_defs = [sql.SQL("{} {}").format(sql.Identifier(n), sql.SQL(t)) for n, t in spec.columns.items()]
    statement = sql.SQL("CREATE TABLE IF NOT EXISTS {table} ({columns}, PRIMARY KEY ({key}))").format(
        table=spec.qualified,
        columns=sql.SQL(", ").join(column_defs),
        key=sql.SQL(", ").join(sql.Identifier(k) for k in spec.key),
    )
    if spec.schema:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(spec.schema)))
    conn.execute(statement)


def table_columns(conn: psycopg.Connection[Any], spec: TableSpec) -> list[Column]:
    """The target's writable columns in table order (generated columns excluded); a clear error if it is
    missing."""
    regclass = spec.qualified.as_string(conn)
    rows = conn.execute(
        """
        SELECT a.attname, a.atttypid::int, format_type(a.atttypid, a.atttypmod), a.attnotnull
        FROM pg_attribute a
        WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
        ORDER BY a.attnum
        """,
        (regclass,),
    ).fetchall()
    if not rows:
        raise LookupError(f"table {spec.display_name!r} does not exist (or has no columns)")
    columns = [Column(name=r[0], type_oid=r[1], type_name=r[2], not_null=r[3]) for r in rows]
    names = {c.name for c in columns}
    missing = [c for c in (*spec.key, *spec.version) if c not in names]
    if missing:
        raise LookupError(f"table {spec.display_name!r} has no columns {missing} (declared as key/version)")
    return columns


def column_names(columns: Sequence[Column]) -> list[str]:
    return [c.name for c in columns]

"""Validated table declarations: names that can only be identifiers, SQL types that can only be types.

Every name from configuration goes through ``validate_identifier`` (a plausible PostgreSQL identifier or a
clear ValueError) and is composed into SQL only with ``psycopg.sql.Identifier``; a quote, semicolon or comment
in a configured name is rejected before any SQL is built. SQL keywords (``order``, ``select``) are valid
names: quoting makes them safe.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

__all__ = [
    "EXTRA_FIELDS",
    "Column",
    "EvolutionPlan",
    "SchemaEvolutionError",
    "TableSpec",
    "add_columns",
    "avro_columns",
    "create_table",
    "existing_columns",
    "lock_creation",
    "parse_table_name",
    "plan_evolution",
    "table_columns",
    "validate_identifier",
    "validate_sql_type",
]

EXTRA_FIELDS = ("error", "ignore", "evolve")
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
    has_default: bool = False


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
    # What to do with element fields the table lacks: "error" (dead letter), "ignore", or "evolve" (add the declared
    # column, nullable, before the first row carrying it is written; undeclared fields stay dead letters).
    extra_fields: str = "error"

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
        if self.extra_fields not in EXTRA_FIELDS:
            raise ValueError(f"extra_fields must be one of {', '.join(EXTRA_FIELDS)}, not {self.extra_fields!r}")
        if self.extra_fields == "evolve" and self.columns is None:
            raise ValueError(
                f"table {self.table!r}: extra_fields='evolve' needs declared columns (name -> SQL type) to know the "
                "type of a new column; e.g. columns=avro_columns(reader_schema)"
            )

    @property
    def qualified(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.table) if self.schema else sql.Identifier(self.table)

    @property
    def display_name(self) -> str:
        return f"{self.schema}.{self.table}" if self.schema else self.table

    @property
    def evolves(self) -> bool:
        return self.extra_fields == "evolve"


def lock_creation(conn: psycopg.Connection[Any], name: str) -> None:
    """Serialises the creation of ``name`` (a table and whatever goes with it) across processes.

    Parallel workers create the same table at once, and ``CREATE TABLE IF NOT EXISTS`` is not safe against that: the
    loser fails on pg_type's unique index (seen at parallelism 2 on Flink, where both subtasks' ``setup`` create the
    dedup's first-copies table: the job restarted). Call it first in the creating transaction: the advisory lock is
    transaction-scoped, so the commit (the end of the pool's connection block) releases it.
    """
    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"beamflow.create_table:{name}",))


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
    lock_creation(conn, spec.display_name)
    if spec.schema:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(spec.schema)))
    conn.execute(statement)


def table_columns(conn: psycopg.Connection[Any], spec: TableSpec) -> list[Column]:
    """The target's writable columns in table order (generated columns excluded); a clear error if it is
    missing."""
    regclass = spec.qualified.as_string(conn)
    rows = conn.execute(
        """
        SELECT a.attname, a.atttypid::int, format_type(a.atttypid, a.atttypmod), a.attnotnull, a.atthasdef
        FROM pg_attribute a
        WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
        ORDER BY a.attnum
        """,
        (regclass,),
    ).fetchall()
    if not rows:
        raise LookupError(f"table {spec.display_name!r} does not exist (or has no columns)")
    columns = [Column(name=r[0], type_oid=r[1], type_name=r[2], not_null=r[3], has_default=r[4]) for r in rows]
    names = {c.name for c in columns}
    missing = [c for c in (*spec.key, *spec.version) if c not in names]
    if missing:
        raise LookupError(f"table {spec.display_name!r} has no columns {missing} (declared as key/version)")
    return columns


def column_names(columns: Sequence[Column]) -> list[str]:
    return [c.name for c in columns]


# ---- schema evolution ----------------------------------------------------------------------------------------


class SchemaEvolutionError(ValueError):
    """A table change beamflow refuses to make (a required new column, a type change, a NOT NULL column the rows
    no longer carry); raised before any row is written, the message says which columns and why."""


_NULLITY = re.compile(r"\s+(NOT\s+)?NULL\s*$", re.IGNORECASE)


def _is_not_null(type_text: str) -> bool:
    match = _NULLITY.search(type_text)
    return bool(match and match.group(1))


def _bare_type(type_text: str) -> str:
    return _NULLITY.sub("", type_text).strip()


def avro_columns(schema: Mapping[str, Any] | str, **extra: str) -> dict[str, str]:
    """Declared columns (name -> SQL type) for an Avro record schema, plus ``extra`` (e.g. Kafka coordinates).

    A field that is neither nullable nor has a default is ``NOT NULL`` (every record carries it); any other field
    is nullable. Types come from ``beamflow.avro.evolution`` (the same mapping the Iceberg sink and the rollout
    gate use).
    """
    import json

    from beamflow.avro.evolution import avro_type_to_column

    parsed = json.loads(schema) if isinstance(schema, str) else dict(schema)
    declared: dict[str, str] = {}
    for avro_field in parsed.get("fields", []):
        column = avro_type_to_column(avro_field["name"], avro_field["type"])
        required = not column.nullable and "default" not in avro_field
        declared[validate_identifier(column.name, "column name")] = column.sql_type + (" NOT NULL" if required else "")
    for name, type_text in extra.items():
        declared[validate_identifier(name, "column name")] = validate_sql_type(type_text, name)
    return declared


@dataclass(frozen=True)
class EvolutionPlan:
    """What a table needs for a set of declared columns: nullable columns to add, and what is refused (why)."""

    table: str
    add: tuple[tuple[str, str], ...] = ()
    refused: tuple[str, ...] = field(default=())

    @property
    def safe(self) -> bool:
        return not self.refused

    def describe(self) -> str:
        if self.refused:
            return f"{self.table}: REFUSED: " + "; ".join(self.refused)
        if not self.add:
            return f"{self.table} gains no columns"
        return f"{self.table} gains " + ", ".join(f"{name} {type_text} NULL" for name, type_text in self.add)

    def raise_if_refused(self) -> None:
        if self.refused:
            raise SchemaEvolutionError(
                f"refusing to evolve table {self.table}: " + "; ".join(self.refused) + " (no row was written)"
            )


def parse_table_name(table: str) -> tuple[str | None, str]:
    """``"[schema.]name"`` as (schema or None, name), both validated identifiers."""
    schema, _, name = table.rpartition(".")
    return (validate_identifier(schema, "schema name") if schema else None), validate_identifier(name, "table name")


def _target(table: TableSpec | str) -> tuple[sql.Identifier, str]:
    if isinstance(table, TableSpec):
        return table.qualified, table.display_name
    schema, name = parse_table_name(table)
    return (sql.Identifier(schema, name) if schema else sql.Identifier(name)), table


def existing_columns(conn: psycopg.Connection[Any], table: TableSpec | str) -> list[Column] | None:
    """The table's writable columns in table order, or None if there is no such table."""
    qualified, _ = _target(table)
    rows = conn.execute(
        """
        SELECT a.attname, a.atttypid::int, format_type(a.atttypid, a.atttypmod), a.attnotnull, a.atthasdef
        FROM pg_attribute a
        WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
        ORDER BY a.attnum
        """,
        (qualified.as_string(conn),),
    ).fetchall()
    if not rows:
        return None
    return [Column(name=r[0], type_oid=r[1], type_name=r[2], not_null=r[3], has_default=r[4]) for r in rows]


def plan_evolution(
    conn: psycopg.Connection[Any],
    table: TableSpec | str,
    existing: Sequence[Column],
    declared: Mapping[str, str],
    complete: bool = True,
) -> EvolutionPlan:
    """Compares ``declared`` columns (name -> SQL type) with the table's ``existing`` ones.

    Only additive changes pass: a declared column the table lacks is added nullable (rows already in the table
    have no value for it), unless it is declared ``NOT NULL`` (a required new column: refused). A declared type
    that differs from the existing column's base type is refused (type changes need a new column), and so is a
    ``NOT NULL`` column without a default that is not declared any more (a removed or renamed field: every row
    would be rejected); ``complete=False`` skips that last check, for declarations that cover only some columns
    (e.g. an Avro schema without the Kafka coordinate columns).
    """
    _, display = _target(table)
    have = {c.name: c for c in existing}
    refused: list[str] = []
    add: list[tuple[str, str]] = []
    to_compare: list[tuple[str, str]] = []
    for name, type_text in declared.items():
        bare = _bare_type(type_text)
        if name not in have:
            if _is_not_null(type_text):
                refused.append(
                    f"new column {name!r} is required ({type_text}): rows already written have no value for it; "
                    'declare it nullable (in Avro: a union with null and "default": null)'
                )
            else:
                add.append((name, bare))
        else:
            to_compare.append((name, bare))
    if to_compare:
        rows = conn.execute(
            "SELECT t, to_regtype(t)::oid::int FROM unnest(%s::text[]) AS t", ([t for _, t in to_compare],)
        ).fetchall()
        oid_of = {r[0]: r[1] for r in rows}
        for name, bare in to_compare:
            column = have[name]
            oid = oid_of.get(bare)
            if oid is None:
                refused.append(f"column {name!r}: declared type {bare!r} is not a known type")
            elif oid != column.type_oid:
                refused.append(
                    f"column {name!r} has type {column.type_name} but is declared {bare}: type changes are refused; "
                    "add a new field instead"
                )
    for column in existing if complete else ():
        if column.name not in declared and column.not_null and not column.has_default:
            refused.append(
                f"column {column.name!r} is NOT NULL without a default but the declared columns lack it "
                "(a removed or renamed field?): every row would be rejected"
            )
    return EvolutionPlan(display, tuple(add), tuple(refused))


def add_columns(conn: psycopg.Connection[Any], table: TableSpec | str, columns: Sequence[tuple[str, str]]) -> None:
    """``ALTER TABLE ... ADD COLUMN IF NOT EXISTS name type`` (nullable) for each column, in one statement."""
    if not columns:
        return
    qualified, _ = _target(table)
    clauses = []
    for name, type_text in columns:
        validate_identifier(name, "column name")
        bare = _bare_type(validate_sql_type(type_text, name))
        clauses.append(sql.SQL("ADD COLUMN IF NOT EXISTS {} {}").format(sql.Identifier(name), sql.SQL(bare)))
    conn.execute(sql.SQL("ALTER TABLE {} {}").format(qualified, sql.SQL(", ").join(clauses)))

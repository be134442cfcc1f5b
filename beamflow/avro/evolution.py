"""Which schema changes beamflow rolls out, and what they mean for sink tables. Pure functions, no I/O.

beamflow's rollout rule is stricter than any registry compatibility level, because a change must be safe for
three readers at once: consumers still on the old reader schema, the new reader over old data, and the sink
tables. The only safe change is **adding a field with a default** (in practice: nullable, default null).
Everything else is refused with a message saying why:

- a removed field: old readers expect it; sink columns would silently go null;
- a renamed field (same type, old name gone; or an ``aliases`` entry naming the old field): Avro resolution
  treats it as remove + add and the sink column is orphaned;
- a new field without a default: data written by the old schema cannot be read with the new one;
- a type change (including making a field nullable or not, and int to long promotions): the sink column's type
  is fixed; migrate with a new field instead;
- a changed record name or namespace: Avro resolution matches records by full name.

The column half maps Avro record fields to sink columns (Arrow type for Iceberg, SQL type for PostgreSQL) and
diffs them against a table's existing columns, so a sink can add the new columns, nullable, before writing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

__all__ = [
    "Change",
    "Column",
    "EvolutionReport",
    "UnsupportedTypeError",
    "avro_type_to_column",
    "classify_change",
    "columns_to_add",
    "record_columns",
]


@dataclass(frozen=True)
class Change:
    """One difference between two versions. ``kind``: added_optional, added_required, removed, renamed,
    type_changed, default_changed, record_renamed."""

    kind: str
    field: str
    safe: bool
    message: str


@dataclass(frozen=True)
class EvolutionReport:
    changes: tuple[Change, ...] = ()

    @property
    def safe(self) -> bool:
        return all(change.safe for change in self.changes)

    @property
    def refused(self) -> tuple[Change, ...]:
        return tuple(c for c in self.changes if not c.safe)

    @property
    def added_fields(self) -> tuple[str, ...]:
        return tuple(c.field for c in self.changes if c.kind == "added_optional")

    def summary(self) -> str:
        if not self.changes:
            return "no field changes"
        verdict = "safe to roll out" if self.safe else "NOT safe to roll out"
        lines = [f"{verdict}: {len(self.changes)} change(s)"]
        lines += [f"  [{'ok' if c.safe else 'REFUSED'}] {c.message}" for c in self.changes]
        return "\n".join(lines)


def _load(schema: Mapping[str, Any] | str) -> dict[str, Any]:
    parsed = json.loads(schema) if isinstance(schema, str) else dict(schema)
    if parsed.get("type") != "record":
        raise ValueError(f"expected an Avro record schema, got type {parsed.get('type')!r}")
    return parsed


def _full_name(schema: Mapping[str, Any]) -> str:
    name = str(schema.get("name", ""))
    namespace = schema.get("namespace")
    return name if "." in name or not namespace else f"{namespace}.{name}"


_IGNORED_KEYS = {"doc", "aliases", "order"}


def _strip(avro_type: Any) -> Any:
    """The type without documentation-only keys, so a doc edit is not a type change."""
    if isinstance(avro_type, list):
        return [_strip(t) for t in avro_type]
    if isinstance(avro_type, dict):
        out = {k: _strip(v) for k, v in avro_type.items() if k not in _IGNORED_KEYS and k != "default"}
        if isinstance(out.get("fields"), list):
            out["fields"] = [
                {k: _strip(v) for k, v in f.items() if k not in _IGNORED_KEYS} for f in avro_type["fields"]
            ]
        return out
    return avro_type


def _type_text(avro_type: Any) -> str:
    return json.dumps(_strip(avro_type), separators=(",", ":"), sort_keys=True)


def classify_change(old: Mapping[str, Any] | str, new: Mapping[str, Any] | str) -> EvolutionReport:
    """Classifies every field-level difference from ``old`` to ``new`` as safe or refused, with reasons."""
    old_schema, new_schema = _load(old), _load(new)
    changes: list[Change] = []
    if _full_name(old_schema) != _full_name(new_schema):
        changes.append(
            Change(
                "record_renamed",
                _full_name(new_schema),
                False,
                f"record name changed from {_full_name(old_schema)} to {_full_name(new_schema)}: "
                "Avro resolution matches records by full name",
            )
        )
    old_fields = {f["name"]: f for f in old_schema.get("fields", [])}
    new_fields = {f["name"]: f for f in new_schema.get("fields", [])}
    removed = [name for name in old_fields if name not in new_fields]
    added = [name for name in new_fields if name not in old_fields]

    renamed_from: dict[str, str] = {}  # new name -> old name
    for name in added:
        aliases = new_fields[name].get("aliases") or []
        hit = next((old for old in removed if old in aliases), None)
        if hit is None:
            # Same type, one removed and one added: most likely a rename without an alias.
            same_type = [
                old
                for old in removed
                if _type_text(old_fields[old]["type"]) == _type_text(new_fields[name]["type"])
                and old not in renamed_from.values()
            ]
            if len(removed) == len(added) and same_type:
                hit = same_type[0]
        if hit is not None:
            renamed_from[name] = hit

    for name in old_fields:
        if name in new_fields:
            old_type, new_type = old_fields[name]["type"], new_fields[name]["type"]
            if _type_text(old_type) != _type_text(new_type):
                changes.append(
                    Change(
                        "type_changed",
                        name,
                        False,
                        f"field {name!r} changed type from {_type_text(old_type)} to {_type_text(new_type)}: "
                        "sink columns have fixed types; add a new field instead",
                    )
                )
            elif (
                "default" in old_fields[name]
                and "default" in new_fields[name]
                and (old_fields[name]["default"] != new_fields[name]["default"])
            ):
                changes.append(
                    Change(
                        "default_changed",
                        name,
                        True,
                        f"field {name!r} default changed from {old_fields[name]['default']!r} to "
                        f"{new_fields[name]['default']!r} (affects only old data read with the new schema)",
                    )
                )
        elif name not in renamed_from.values():
            changes.append(
                Change(
                    "removed",
                    name,
                    False,
                    f"field {name!r} was removed: readers on the old schema need it and its sink column "
                    "would "
                    "silently fill with nulls",
                )
            )
    for name in added:
        if name in renamed_from:
            old_name = renamed_from[name]
            changes.append(
                Change(
                    "renamed",
                    name,
                    False,
                    f"field {old_name!r} was renamed to {name!r}: a rename is a remove plus an add for Avro "
                    "readers and orphans the sink column; keep the old field",
                )
            )
        elif "default" not in new_fields[name]:
            changes.append(
                Change(
                    "added_required",
                    name,
                    False,
                    f"new field {name!r} has no default: records written with the old schema cannot be read "
                    'with the new one; make it nullable with "default": null',
                )
            )
        else:
            changes.append(
                Change(
                    "added_optional",
                    name,
                    True,
                    f"new field {name!r} with default {json.dumps(new_fields[name]['default'])}",
                )
            )
    return EvolutionReport(tuple(changes))


# -- sink columns --------------------------------------------------------------------------------


class UnsupportedTypeError(ValueError):
    """An Avro type with no flat column mapping (arrays, maps, nested records, multi-type unions)."""


@dataclass(frozen=True)
class Column:
    """A sink column for one Avro field: ``arrow_type`` for Iceberg (pyarrow), ``sql_type`` for PostgreSQL."""

    name: str
    arrow_type: pa.DataType = field(compare=False)
    sql_type: str
    nullable: bool

    def as_nullable(self) -> Column:
        return Column(self.name, self.arrow_type, self.sql_type, True)

    def arrow_field(self) -> pa.Field:
        return pa.field(self.name, self.arrow_type, nullable=self.nullable)


_PRIMITIVES: dict[str, tuple[pa.DataType, str]] = {
    "boolean": (pa.bool_(), "BOOLEAN"),
    "int": (pa.int32(), "INTEGER"),
    "long": (pa.int64(), "BIGINT"),
    "float": (pa.float32(), "REAL"),
    "double": (pa.float64(), "DOUBLE PRECISION"),
    "string": (pa.string(), "TEXT"),
    "bytes": (pa.binary(), "BYTEA"),
}

# Iceberg stores timestamps in microseconds, so millisecond Avro timestamps widen to "us" (lossless).
_LOGICAL: dict[str, tuple[pa.DataType, str]] = {
    "timestamp-millis": (pa.timestamp("us", tz="UTC"), "TIMESTAMPTZ"),
    "timestamp-micros": (pa.timestamp("us", tz="UTC"), "TIMESTAMPTZ"),
    "local-timestamp-millis": (pa.timestamp("us"), "TIMESTAMP"),
    "local-timestamp-micros": (pa.timestamp("us"), "TIMESTAMP"),
    "date": (pa.date32(), "DATE"),
    "time-millis": (pa.time64("us"), "TIME"),
    "time-micros": (pa.time64("us"), "TIME"),
    "uuid": (pa.string(), "UUID"),
}


def avro_type_to_column(name: str, avro_type: Any) -> Column:
    """Maps one field's Avro type to a column; a union with null makes it nullable."""
    nullable = False
    if isinstance(avro_type, list):
        branches = [t for t in avro_type if t != "null"]
        nullable = len(branches) < len(avro_type)
        if len(branches) != 1:
            raise UnsupportedTypeError(
                f"field {name!r}: union {json.dumps(avro_type)} has {len(branches)} non-null branches; "
                "only [null, T] maps to a column"
            )
        avro_type = branches[0]
    if isinstance(avro_type, str) and avro_type in _PRIMITIVES:
        arrow_type, sql_type = _PRIMITIVES[avro_type]
        return Column(name, arrow_type, sql_type, nullable)
    if isinstance(avro_type, dict):
        logical = avro_type.get("logicalType")
        if logical == "decimal":
            precision, scale = int(avro_type["precision"]), int(avro_type.get("scale", 0))
            return Column(name, pa.decimal128(precision, scale), f"NUMERIC({precision},{scale})", nullable)
        if logical in _LOGICAL:
            arrow_type, sql_type = _LOGICAL[logical]
            return Column(name, arrow_type, sql_type, nullable)
        base = avro_type.get("type")
        if base == "enum":
            return Column(name, pa.string(), "TEXT", nullable)
        if base == "fixed":
            return Column(name, pa.binary(int(avro_type["size"])), "BYTEA", nullable)
        if isinstance(base, str) and base in _PRIMITIVES:
            arrow_type, sql_type = _PRIMITIVES[base]
            return Column(name, arrow_type, sql_type, nullable)
    raise UnsupportedTypeError(f"field {name!r}: Avro type {json.dumps(avro_type)} has no flat column mapping")


def record_columns(schema: Mapping[str, Any] | str) -> list[Column]:
    """The columns for every field of a record schema, in field order."""
    return [avro_type_to_column(f["name"], f["type"]) for f in _load(schema).get("fields", [])]


def columns_to_add(schema: Mapping[str, Any] | str, existing: Iterable[str]) -> list[Column]:
    """Columns the sink lacks for ``schema``, all nullable (rows already in the table have no value for them).

    ``existing`` are the table's column names. PostgreSQL folds unquoted names to lower case, so names are
    compared case-insensitively.
    """
    have = {name.lower() for name in existing}
    return [column.as_nullable() for column in record_columns(schema) if column.name.lower() not in have]

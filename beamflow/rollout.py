"""The schema rollout gate (seed 000, question 3): is a candidate Avro schema safe for the registry AND the sink
tables, and evolving the tables explicitly before the job writes the new fields. No Beam.

``check_rollout`` asks, and explains in lines a human can read:

1. the registry: is the candidate compatible with the subject's latest version under the subject's level?
2. beamflow's rollout rule (``beamflow.avro.evolution.classify_change``): only new fields with defaults; removals,
   renames, required new fields and type changes are refused;
3. each sink table given (PostgreSQL, Iceberg): which nullable columns it will gain, and whether an existing
   column clashes with the candidate (a different type, a required column the candidate no longer has, a required
   new field).

``evolve_sinks`` runs the same check and, only if everything says yes, adds the new nullable columns to the
PostgreSQL and Iceberg tables (the streaming sinks would also add them on their own before the first row carrying
them; doing it explicitly first means the running job never changes a table's schema in the middle of a commit).
Nothing is changed when the verdict is not safe: ``RolloutRefusedError`` carries the verdict's explanation.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from beamflow.avro.evolution import (
    Column,
    EvolutionReport,
    UnsupportedTypeError,
    avro_type_to_column,
    classify_change,
)
from beamflow.avro.registry import SchemaRegistryClient, SubjectNotFoundError
from beamflow.iceberg.catalog import CatalogConfig

__all__ = [
    "RolloutRefusedError",
    "RolloutVerdict",
    "SinkVerdict",
    "check_rollout",
    "evolve_sinks",
]

log = logging.getLogger(__name__)


class RolloutRefusedError(RuntimeError):
    """The candidate schema is not safe to roll out; nothing was changed. ``verdict`` says why."""

    def __init__(self, verdict: RolloutVerdict) -> None:
        super().__init__("schema rollout refused, no table was changed:\n" + verdict.text())
        self.verdict = verdict


@dataclass(frozen=True)
class SinkVerdict:
    """One sink table: the columns it would gain (name, type text) and what it refuses."""

    sink: str  # "postgres" | "iceberg"
    table: str
    exists: bool
    add: tuple[tuple[str, str], ...] = ()
    refused: tuple[str, ...] = ()

    @property
    def safe(self) -> bool:
        return not self.refused

    def describe(self) -> str:
        if not self.exists:
            return f"{self.sink}: table {self.table} does not exist yet (created on first write)"
        if self.refused:
            return f"{self.sink}: {self.table} REFUSES the candidate: " + "; ".join(self.refused)
        if not self.add:
            return f"{self.sink}: {self.table} gains no columns"
        return f"{self.sink}: {self.table} gains " + ", ".join(f"{n} {t} NULL" for n, t in self.add)


@dataclass
class RolloutVerdict:
    """Everything ``check_rollout`` found; ``safe`` only if the registry, the rule and every sink say yes."""

    subject: str
    candidate: dict[str, Any]
    latest_version: int | None = None
    latest_schema_id: int | None = None
    registry_level: str | None = None
    registry_compatible: bool = True
    registry_messages: tuple[str, ...] = ()
    report: EvolutionReport | None = None
    sinks: list[SinkVerdict] = field(default_factory=list)

    @property
    def safe(self) -> bool:
        return (
            self.registry_compatible
            and (self.report is None or self.report.safe)
            and all(sink.safe for sink in self.sinks)
        )

    def sink(self, name: str) -> SinkVerdict | None:
        return next((s for s in self.sinks if s.sink == name), None)

    def lines(self) -> list[str]:
        out: list[str] = []
        if self.latest_version is None:
            out.append(f"subject {self.subject!r} has no versions yet: the candidate would be version 1")
        else:
            out.append(f"latest: {self.subject} version {self.latest_version} (schema id {self.latest_schema_id})")
            out.append(
                f"registry ({self.registry_level}): {'compatible' if self.registry_compatible else 'INCOMPATIBLE'}"
                + "".join(f"\n  {m}" for m in self.registry_messages)
            )
        if self.report is not None:
            out.append(f"beamflow rollout rule: {self.report.summary()}")
        out.extend(sink.describe() for sink in self.sinks)
        return out

    def text(self) -> str:
        return "\n".join([*self.lines(), "SAFE to roll out" if self.safe else "NOT safe to roll out"])


# ---- the check -------------------------------------------------------------------------------------------------


def _candidate_columns(candidate: Mapping[str, Any]) -> tuple[list[tuple[Column, bool]], list[str]]:
    """(column, required) per candidate field, and fields with no flat column mapping (refused by every sink)."""
    columns: list[tuple[Column, bool]] = []
    unmapped: list[str] = []
    for avro_field in candidate.get("fields", []):
        try:
            column = avro_type_to_column(avro_field["name"], avro_field["type"])
        except UnsupportedTypeError as exc:
            unmapped.append(str(exc))
            continue
        columns.append((column, not column.nullable and "default" not in avro_field))
    return columns, unmapped


def _postgres_verdict(dsn: str, table: str, candidate: Mapping[str, Any]) -> SinkVerdict:
    import psycopg

    from beamflow.postgres.table import avro_columns, existing_columns, plan_evolution
    from beamflow.secrets import postgres_conninfo

    with psycopg.connect(postgres_conninfo(dsn)) as conn:
        existing = existing_columns(conn, table)
        if existing is None:
            return SinkVerdict("postgres", table, exists=False)
        try:
            declared = avro_columns(candidate)
        except UnsupportedTypeError as exc:
            return SinkVerdict("postgres", table, exists=True, refused=(str(exc),))
        # complete=False: the table may hold columns the schema never had (Kafka coordinates, event ids); fields
        # removed from the schema are caught by the rollout rule against the registry's latest version.
        plan = plan_evolution(conn, table, existing, declared, complete=False)
    return SinkVerdict("postgres", table, exists=True, add=plan.add, refused=plan.refused)


def _normalized(arrow_type: pa.DataType) -> pa.DataType:
    if pa.types.is_large_string(arrow_type):
        return pa.string()
    if pa.types.is_large_binary(arrow_type):
        return pa.binary()
    return arrow_type


# Candidate type -> table types it is written into without loss (the Iceberg sink casts).
_WIDENS = {pa.int32(): (pa.int64(),), pa.float32(): (pa.float64(),)}


def _iceberg_verdict(catalog_config: CatalogConfig, identifier: str, candidate: Mapping[str, Any]) -> SinkVerdict:
    from pyiceberg.exceptions import NoSuchTableError

    from beamflow.iceberg.catalog import open_catalog

    full = identifier if "." in identifier else f"default.{identifier}"
    try:
        table = open_catalog(catalog_config).load_table(full)
    except NoSuchTableError:
        return SinkVerdict("iceberg", full, exists=False)
    schema = table.schema()
    arrow = schema.as_arrow()
    required = {f.name for f in schema.fields if f.required}
    columns, unmapped = _candidate_columns(candidate)
    refused = list(unmapped)
    add: list[tuple[str, str]] = []
    names = set()
    for column, required_field in columns:
        names.add(column.name)
        if column.name not in arrow.names:
            if required_field:
                refused.append(
                    f"new field {column.name!r} is required (no default): the table's existing rows have no value; "
                    'make it nullable with "default": null'
                )
            else:
                add.append((column.name, str(column.arrow_type)))
            continue
        have = _normalized(arrow.field(column.name).type)
        want = _normalized(column.arrow_type)
        if not (have.equals(want) or any(have.equals(t) for t in _WIDENS.get(want, ()))):
            refused.append(
                f"column {column.name!r} is {have} in the table but {want} in the candidate: type changes are "
                "refused; add a new field instead"
            )
    for name in sorted(required - names):
        refused.append(f"required column {name!r} is not in the candidate (a removed or renamed field?)")
    return SinkVerdict("iceberg", full, exists=True, add=tuple(add), refused=tuple(refused))


def check_rollout(
    registry_client: SchemaRegistryClient,
    subject: str,
    candidate_schema: Mapping[str, Any] | str,
    postgres_dsn: str | None = None,
    pg_table: str | None = None,
    iceberg_table: str | None = None,
    iceberg_catalog: CatalogConfig | None = None,
) -> RolloutVerdict:
    """The verdict on rolling out ``candidate_schema`` under ``subject`` (see the module docstring).

    ``pg_table`` is ``[schema.]name`` in ``postgres_dsn``; ``iceberg_table`` a ``namespace.name`` in the catalog
    ``iceberg_catalog``. Sinks not given are not checked. Raises ``RegistryError`` if the registry cannot answer
    and ``ValueError`` for a candidate that is not a record schema.
    """
    candidate: dict[str, Any] = (
        json.loads(candidate_schema) if isinstance(candidate_schema, str) else dict(candidate_schema)
    )
    if candidate.get("type") != "record":
        raise ValueError(f"expected an Avro record schema, got type {candidate.get('type')!r}")
    if (postgres_dsn is None) != (pg_table is None):
        raise ValueError("pass both postgres_dsn and pg_table, or neither")
    if (iceberg_table is None) != (iceberg_catalog is None):
        raise ValueError("pass both iceberg_table and iceberg_catalog, or neither")
    verdict = RolloutVerdict(subject, candidate)
    try:
        latest = registry_client.get_latest(subject)
    except SubjectNotFoundError:
        latest = None
    if latest is not None:
        verdict.latest_version = latest.version
        verdict.latest_schema_id = latest.schema_id
        verdict.registry_level = registry_client.get_compatibility(subject)
        compat = registry_client.check_compatibility(subject, candidate)
        verdict.registry_compatible = compat.is_compatible
        verdict.registry_messages = compat.messages
        verdict.report = classify_change(latest.schema, candidate)
    if postgres_dsn is not None and pg_table is not None:
        verdict.sinks.append(_postgres_verdict(postgres_dsn, pg_table, candidate))
    if iceberg_table is not None and iceberg_catalog is not None:
        verdict.sinks.append(_iceberg_verdict(iceberg_catalog, iceberg_table, candidate))
    return verdict


# ---- applying it ----------------------------------------------------------------------------------------------


def _evolve_postgres(dsn: str, table: str, add: tuple[tuple[str, str], ...]) -> None:
    import psycopg

    from beamflow.postgres.table import add_columns
    from beamflow.secrets import postgres_conninfo

    with psycopg.connect(postgres_conninfo(dsn)) as conn, conn.transaction():
        add_columns(conn, table, add)


def _evolve_iceberg(catalog_config: CatalogConfig, identifier: str, candidate: Mapping[str, Any]) -> None:
    from pyiceberg.exceptions import CommitFailedException

    from beamflow.iceberg.catalog import open_catalog
    from beamflow.iceberg.committer import evolve_schema

    catalog = open_catalog(catalog_config)
    columns, _ = _candidate_columns(candidate)
    wanted = pa.schema([column.as_nullable().arrow_field() for column, _ in columns])
    for attempt in range(1, 11):
        try:
            # Adds only what the table lacks, as optional (the running job may commit concurrently: retry).
            evolve_schema(catalog.load_table(identifier), wanted)
            return
        except CommitFailedException:
            if attempt == 10:
                raise
            time.sleep(0.1 * attempt)


def evolve_sinks(
    registry_client: SchemaRegistryClient,
    subject: str,
    candidate_schema: Mapping[str, Any] | str,
    postgres_dsn: str | None = None,
    pg_table: str | None = None,
    iceberg_table: str | None = None,
    iceberg_catalog: CatalogConfig | None = None,
) -> RolloutVerdict:
    """Checks like ``check_rollout``; if safe, adds the new nullable columns to the given (existing) sink tables.

    Raises ``RolloutRefusedError`` (and changes nothing) when the verdict is not safe. Idempotent: running it
    again adds nothing. Returns the verdict that was applied.
    """
    verdict = check_rollout(
        registry_client, subject, candidate_schema, postgres_dsn, pg_table, iceberg_table, iceberg_catalog
    )
    if not verdict.safe:
        raise RolloutRefusedError(verdict)
    pg = verdict.sink("postgres")
    if pg is not None and pg.exists and pg.add and postgres_dsn is not None:
        _evolve_postgres(postgres_dsn, pg.table, pg.add)
        log.info("postgres: added %s to %s", [n for n, _ in pg.add], pg.table)
    ice = verdict.sink("iceberg")
    if ice is not None and ice.exists and ice.add and iceberg_catalog is not None:
        _evolve_iceberg(iceberg_catalog, ice.table, verdict.candidate)
        log.info("iceberg: added %s to %s", [n for n, _ in ice.add], ice.table)
    return verdict

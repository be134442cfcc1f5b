"""``beamflow schema check|register``: is a candidate Avro schema safe to roll out, and register it.

``check`` asks two questions and exits nonzero unless both say yes:

1. the registry: is the candidate compatible with the subject's latest version under the subject's level?
2. beamflow's rollout rule (``beamflow.avro.evolution``): only new fields with defaults.

With ``--postgres-dsn`` and ``--table`` it also lists the nullable columns the sink will add.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from beamflow.avro.evolution import EvolutionReport, UnsupportedTypeError, classify_change, columns_to_add
from beamflow.avro.registry import RegistryError, SchemaRegistryClient, SubjectNotFoundError

__all__ = ["register"]

EXIT_SAFE = 0
EXIT_UNSAFE = 1
EXIT_ERROR = 2


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("schema", help="check or register Avro schemas in the schema registry")
    actions = parser.add_subparsers(dest="schema_action", required=True)

    check = actions.add_parser("check", help="is a candidate schema safe to roll out? (exit 0 if yes)")
    _common(check)
    check.add_argument("--postgres-dsn", help="also show the columns the PostgreSQL sink table would gain")
    check.add_argument("--table", help="sink table ([schema.]name) for --postgres-dsn")
    check.set_defaults(func=run_check)

    reg = actions.add_parser("register", help="register a schema under a subject (after checking it)")
    _common(reg)
    reg.add_argument("--force", action="store_true", help="register even if beamflow's rollout rule refuses")
    reg.set_defaults(func=run_register)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--subject", required=True, help="registry subject, e.g. clicks-value")
    parser.add_argument("--schema", required=True, type=Path, help="candidate schema (.avsc)")
    parser.add_argument(
        "--registry",
        help="Confluent-compatible registry URL (default: $BEAMFLOW_REGISTRY_URL, else the local service)",
    )


def _registry_url(explicit: str | None) -> str:
    if explicit:
        return explicit
    if os.environ.get("BEAMFLOW_REGISTRY_URL"):
        return os.environ["BEAMFLOW_REGISTRY_URL"]
    from beamflow.services import ServiceSet

    state = ServiceSet().get("registry").state()
    if state is None or not state.alive():
        raise SystemExit(
            "no --registry given and the local registry is not running (beamflow services up registry)"
        )
    return str(state.info["url"])


def _load(path: Path) -> dict[str, Any]:
    try:
        schema: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"cannot read schema {path}: {exc}") from exc
    return schema


def _postgres_columns(dsn: str, table: str) -> list[str] | None:
    """The table's column names, or None if it does not exist."""
    import psycopg

    schema_name, _, name = table.rpartition(".")
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = %s "
            "AND table_schema = COALESCE(NULLIF(%s, ''), current_schema()) ORDER BY ordinal_position",
            (name, schema_name),
        ).fetchall()
    return [str(r[0]) for r in rows] or None


def check(client: SchemaRegistryClient, subject: str, candidate: dict[str, Any]) -> tuple[bool, list[str]]:
    """The verdict and the lines explaining it (registry verdict first, then beamflow's rule)."""
    lines: list[str] = []
    try:
        latest = client.get_latest(subject)
    except SubjectNotFoundError:
        return True, [f"subject {subject!r} has no versions yet: the candidate would be version 1"]
    lines.append(f"latest: {subject} version {latest.version} (schema id {latest.schema_id})")
    level = client.get_compatibility(subject)
    verdict = client.check_compatibility(subject, candidate)
    lines.append(
        f"registry ({level}): {'compatible' if verdict.is_compatible else 'INCOMPATIBLE'}"
        + "".join(f"\n  {m}" for m in verdict.messages)
    )
    report: EvolutionReport = classify_change(latest.schema, candidate)
    lines.append(f"beamflow rollout rule: {report.summary()}")
    return verdict.is_compatible and report.safe, lines


def run_check(args: argparse.Namespace) -> int:
    candidate = _load(args.schema)
    client = SchemaRegistryClient(_registry_url(args.registry))
    try:
        safe, lines = check(client, args.subject, candidate)
    except (RegistryError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.postgres_dsn:
        if not args.table:
            print("error: --postgres-dsn needs --table", file=sys.stderr)
            return EXIT_ERROR
        existing = _postgres_columns(args.postgres_dsn, args.table)
        if existing is None:
            lines.append(f"postgres: table {args.table} does not exist yet (created on first write)")
        else:
            try:
                added = columns_to_add(candidate, existing)
            except UnsupportedTypeError as exc:
                lines.append(f"postgres: {exc}")
                safe = False
            else:
                lines.append(
                    f"postgres: {args.table} gains "
                    + (", ".join(f"{c.name} {c.sql_type} NULL" for c in added) if added else "no columns")
                )
    print("\n".join(lines))
    print("SAFE to roll out" if safe else "NOT safe to roll out")
    return EXIT_SAFE if safe else EXIT_UNSAFE


def run_register(args: argparse.Namespace) -> int:
    candidate = _load(args.schema)
    client = SchemaRegistryClient(_registry_url(args.registry))
    try:
        safe, lines = check(client, args.subject, candidate)
        print("\n".join(lines))
        if not safe and not args.force:
            print("refused: not safe to roll out (use --force to register anyway)")
            return EXIT_UNSAFE
        schema_id = client.register(args.subject, candidate)
    except (RegistryError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(f"registered {args.subject}: schema id {schema_id}")
    return EXIT_SAFE

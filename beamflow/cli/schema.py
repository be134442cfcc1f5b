"""``beamflow schema check|register|evolve``: is a candidate Avro schema safe to roll out; register it; evolve
the sink tables for it.

``check`` exits nonzero unless the registry (compatibility under the subject's level), beamflow's rollout rule
(only new fields with defaults) and every sink table given all say yes; it lists the nullable columns each sink
table will gain. ``evolve`` does the same check and then adds those columns (``beamflow.rollout.evolve_sinks``):
the explicit step before the job writes the new fields. The logic lives in ``beamflow.rollout``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from beamflow.avro.registry import RegistryError, SchemaRegistryClient
from beamflow.iceberg.catalog import CatalogConfig
from beamflow.rollout import RolloutRefusedError, RolloutVerdict, check_rollout, evolve_sinks

__all__ = ["check", "register"]

EXIT_SAFE = 0
EXIT_UNSAFE = 1
EXIT_ERROR = 2


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("schema", help="check or register Avro schemas; evolve sink tables for them")
    actions = parser.add_subparsers(dest="schema_action", required=True)

    check_parser = actions.add_parser("check", help="is a candidate schema safe to roll out? (exit 0 if yes)")
    _common(check_parser)
    _sinks(check_parser)
    check_parser.set_defaults(func=run_check)

    evolve = actions.add_parser(
        "evolve", help="check, then add the candidate's new nullable columns to the sink tables (exit 0 if done)"
    )
    _common(evolve)
    _sinks(evolve)
    evolve.set_defaults(func=run_evolve)

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
    parser.add_argument(
        "--registry-ca-file",
        default=os.environ.get("BEAMFLOW_REGISTRY_CA_FILE"),
        help="PEM CA file an https:// registry is verified with (default: $BEAMFLOW_REGISTRY_CA_FILE, else the "
        "system's CAs)",
    )


def _sinks(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--postgres-dsn", help="PostgreSQL holding the sink table --table")
    parser.add_argument("--table", "--pg-table", dest="table", help="PostgreSQL sink table ([schema.]name)")
    parser.add_argument("--iceberg-table", help="Iceberg sink table (namespace.name) in the catalog below")
    parser.add_argument("--catalog-warehouse", help="Iceberg warehouse folder (with --iceberg-table)")
    parser.add_argument(
        "--catalog-uri", default="", help="Iceberg SQL catalog URI (default: SQLite in the warehouse folder)"
    )
    parser.add_argument("--catalog-name", default="beamflow", help="Iceberg catalog name (default: %(default)s)")


def _registry_url(explicit: str | None) -> str:
    if explicit:
        return explicit
    if os.environ.get("BEAMFLOW_REGISTRY_URL"):
        return os.environ["BEAMFLOW_REGISTRY_URL"]
    from beamflow.services import ServiceSet

    state = ServiceSet().get("registry").state()
    if state is None or not state.alive():
        raise SystemExit("no --registry given and the local registry is not running (beamflow services up registry)")
    return str(state.info["url"])


def _load(path: Path) -> dict[str, Any]:
    try:
        schema: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"cannot read schema {path}: {exc}") from exc
    return schema


def _sink_args(args: argparse.Namespace) -> dict[str, Any]:
    if bool(args.postgres_dsn) != bool(args.table):
        raise ValueError("--postgres-dsn and --table go together")
    if bool(args.iceberg_table) != bool(args.catalog_warehouse):
        raise ValueError("--iceberg-table needs --catalog-warehouse (and optionally --catalog-uri)")
    catalog = None
    if args.iceberg_table:
        catalog = CatalogConfig(warehouse=args.catalog_warehouse, uri=args.catalog_uri, name=args.catalog_name)
    return {
        "postgres_dsn": args.postgres_dsn or None,
        "pg_table": args.table or None,
        "iceberg_table": args.iceberg_table or None,
        "iceberg_catalog": catalog,
    }


def check(client: SchemaRegistryClient, subject: str, candidate: dict[str, Any]) -> tuple[bool, list[str]]:
    """The registry and rollout-rule verdict and the lines explaining it (no sinks)."""
    verdict = check_rollout(client, subject, candidate)
    return verdict.safe, verdict.lines()


def _print(verdict: RolloutVerdict) -> None:
    print(verdict.text())


def run_check(args: argparse.Namespace) -> int:
    candidate = _load(args.schema)
    client = SchemaRegistryClient(_registry_url(args.registry), ca_file=args.registry_ca_file)
    try:
        verdict = check_rollout(client, args.subject, candidate, **_sink_args(args))
    except (RegistryError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    _print(verdict)
    return EXIT_SAFE if verdict.safe else EXIT_UNSAFE


def run_evolve(args: argparse.Namespace) -> int:
    candidate = _load(args.schema)
    client = SchemaRegistryClient(_registry_url(args.registry), ca_file=args.registry_ca_file)
    try:
        verdict = evolve_sinks(client, args.subject, candidate, **_sink_args(args))
    except RolloutRefusedError as exc:
        _print(exc.verdict)
        print("refused: no table was changed")
        return EXIT_UNSAFE
    except (RegistryError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    _print(verdict)
    changed = [s for s in verdict.sinks if s.exists and s.add]
    print("evolved: " + (", ".join(f"{s.sink} {s.table}" for s in changed) if changed else "nothing to add"))
    return EXIT_SAFE


def run_register(args: argparse.Namespace) -> int:
    candidate = _load(args.schema)
    client = SchemaRegistryClient(_registry_url(args.registry), ca_file=args.registry_ca_file)
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

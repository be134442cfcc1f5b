"""``beamflow generate``: synthetic click or ride traffic into Kafka, with a printed account of what was produced.

``--kind rides`` also writes the driver and zone dimension tables into PostgreSQL (idempotent upserts), so the rides
job's lookups find every known key and none of the unknown ones the traffic carries.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from typing import Any

from beamflow.generate import (
    RideTrafficSpec,
    TrafficSpec,
    avro_click_encoder,
    avro_ride_encoder,
    generate_traffic,
    produce_traffic,
    ride_dimensions,
    seed_ride_dimensions,
)

KINDS = {"clicks": TrafficSpec, "rides": RideTrafficSpec}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="produce synthetic click or ride traffic into Kafka")
    parser.add_argument("--kind", choices=sorted(KINDS), default="clicks", help="which traffic (default %(default)s)")
    parser.add_argument("--bootstrap", default="auto", help="Kafka bootstrap (default: the local service)")
    parser.add_argument("--registry", default="auto", help="schema registry URL (default: the local service)")
    parser.add_argument(
        "--registry-ca-file", default=None, help="PEM CA file an https:// registry is verified with (default: system's)"
    )
    parser.add_argument("--topic", default=None, help="default: the kind's name (clicks, rides)")
    parser.add_argument("--subject", default=None, help="default: <topic>-value")
    parser.add_argument("--rate", type=float, default=None, help="records/s to send at (default: as fast as possible)")
    parser.add_argument(
        "--postgres-dsn", default="auto", help="rides: where the dimension tables go (default: the local service)"
    )
    parser.add_argument("--drivers-table", default="drivers", help="rides: the driver dimension table")
    parser.add_argument("--zones-table", default="zones", help="rides: the zone dimension table")
    clicks = {f.name for f in fields(TrafficSpec)}
    for f in fields(RideTrafficSpec):  # every spec field is a flag; the rides-only ones say so
        flag = "--" + f.name.replace("_", "-")
        only = "" if f.name in clicks else "rides only; "
        kind = _parser_for(f.type)
        parser.add_argument(flag, dest=f.name, default=None, type=kind, help=f"{only}default {f.default}")
    parser.set_defaults(func=run)


def _parser_for(type_text: Any) -> Any:
    text = str(type_text)
    if "float" in text:
        return float
    if "int" in text:
        return int
    return str


def spec_from_args(args: argparse.Namespace) -> TrafficSpec:
    """The kind's spec from the flags given; a flag the kind does not have is refused (SystemExit)."""
    cls = KINDS[getattr(args, "kind", "clicks")]
    names = {f.name for f in fields(cls)}
    chosen = {f.name: getattr(args, f.name) for f in fields(RideTrafficSpec) if getattr(args, f.name, None) is not None}
    foreign = sorted(set(chosen) - names)
    if foreign:
        flags = ", ".join("--" + n.replace("_", "-") for n in foreign)
        raise SystemExit(f"beamflow generate: {flags} not for --kind {args.kind}")
    return cls(**chosen)


def run(args: argparse.Namespace) -> int:
    from beamflow.kafka.admin import create_topic
    from beamflow.services import ServiceSet

    services = ServiceSet()
    bootstrap = services.get("kafka").up().info["bootstrap"] if args.bootstrap == "auto" else args.bootstrap
    registry = services.get("registry").up().info["url"] if args.registry == "auto" else args.registry
    spec = spec_from_args(args)
    topic = args.topic or args.kind
    subject = args.subject or f"{topic}-value"
    account: dict[str, Any] = {"topic": topic}
    if isinstance(spec, RideTrafficSpec):
        dsn = services.get("postgres").up().info["dsn"] if args.postgres_dsn == "auto" else args.postgres_dsn
        dimensions = ride_dimensions(spec)
        seed_ride_dimensions(dsn, dimensions, args.drivers_table, args.zones_table)
        account |= {args.drivers_table: len(dimensions.drivers), args.zones_table: len(dimensions.zones)}
        encoder = avro_ride_encoder(registry, subject, args.registry_ca_file)
    else:
        encoder = avro_click_encoder(registry, subject, args.registry_ca_file)
    create_topic(bootstrap, topic, spec.partitions)
    traffic = generate_traffic(spec, encoder)
    acked = produce_traffic(bootstrap, topic, traffic, rate=args.rate)
    print(json.dumps({**account, "acked": acked, **traffic.summary()}, indent=2))
    return 0

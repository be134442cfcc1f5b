"""``beamflow generate``: synthetic click traffic into Kafka, with a printed account of what was produced."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from typing import Any

from beamflow.generate import TrafficSpec, avro_click_encoder, generate_traffic, produce_traffic


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="produce synthetic click traffic into Kafka")
    parser.add_argument("--bootstrap", default="auto", help="Kafka bootstrap (default: the local service)")
    parser.add_argument("--registry", default="auto", help="schema registry URL (default: the local service)")
    parser.add_argument("--topic", default="clicks")
    parser.add_argument("--subject", default="clicks-value")
    parser.add_argument("--rate", type=float, default=None, help="records/s to send at (default: as fast as possible)")
    for f in fields(TrafficSpec):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, dest=f.name, default=None, type=_parser_for(f.type), help=f"default {f.default}")
    parser.set_defaults(func=run)


def _parser_for(type_text: Any) -> Any:
    text = str(type_text)
    if "float" in text:
        return float
    if "int" in text:
        return int
    return str


def spec_from_args(args: argparse.Namespace) -> TrafficSpec:
    chosen = {f.name: getattr(args, f.name) for f in fields(TrafficSpec) if getattr(args, f.name, None) is not None}
    return TrafficSpec(**chosen)


def run(args: argparse.Namespace) -> int:
    from beamflow.kafka.admin import create_topic
    from beamflow.services import ServiceSet

    services = ServiceSet()
    bootstrap = services.get("kafka").up().info["bootstrap"] if args.bootstrap == "auto" else args.bootstrap
    registry = services.get("registry").up().info["url"] if args.registry == "auto" else args.registry
    spec = spec_from_args(args)
    create_topic(bootstrap, args.topic, spec.partitions)
    traffic = generate_traffic(spec, avro_click_encoder(registry, args.subject))
    acked = produce_traffic(bootstrap, args.topic, traffic, rate=args.rate)
    print(json.dumps({"topic": args.topic, "acked": acked, **traffic.summary()}, indent=2))
    return 0

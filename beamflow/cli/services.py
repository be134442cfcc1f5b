"""``beamflow services up|down|status [NAME ...]``: the real local services."""

from __future__ import annotations

import argparse
import json

from beamflow.services import SERVICES, ServiceSet


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("services", help="start, stop or inspect the local services")
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("names", nargs="*", help=f"services (default: all of {', '.join(SERVICES)})")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    services = ServiceSet()
    names = list(args.names) or None
    if args.action == "up":
        for name, state in services.up(names).items():
            print(f"{name:10} up   ports={json.dumps(state.ports)}")
    elif args.action == "down":
        services.down(names)
        print("stopped")
    else:
        for row in services.status(names):
            print(json.dumps(row))
    return 0

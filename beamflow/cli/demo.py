"""``beamflow demo``: the README's first command after setup: services, traffic, the clicks job, an audited summary."""

from __future__ import annotations

import argparse

from beamflow.generate import TrafficSpec


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run the clicks job end to end on local services and audit it")
    parser.add_argument("--conf", default="conf/clicks.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--events", type=int, default=20_000, help="click events to generate (default %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from beamflow.demo import run_demo

    summary = run_demo(args.conf, tuple(args.set), TrafficSpec(events=args.events))
    print(summary.table())
    ok = summary.ok
    print(
        "demo: OK, every record accounted for exactly once, sessions exact across runs"
        if ok
        else "demo: FAILED, see the table above"
    )
    return 0 if ok else 1

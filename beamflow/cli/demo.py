"""``beamflow demo``: the README's first command after setup: services, traffic, the clicks job, an audited summary.

The demo belongs to its job (``pipelines/clicks_demo.py``): the engines name it here, and import it only when run.
"""

from __future__ import annotations

import argparse
import importlib

# demo name -> module with main(conf, overrides, events) -> exit code
DEMOS = {"clicks": "pipelines.clicks_demo"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run the clicks job end to end on local services and audit it")
    parser.add_argument("--conf", default="conf/clicks.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--events", type=int, default=20_000, help="click events to generate (default %(default)s)")
    parser.add_argument(
        "--demo", choices=sorted(DEMOS), default="clicks", help="which job's demo (default %(default)s)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    demo = importlib.import_module(DEMOS[args.demo])
    code: int = demo.main(args.conf, tuple(args.set), args.events)
    return code

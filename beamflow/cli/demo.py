"""``beamflow demo``: the README's first command after setup: services, traffic, a job, an audited summary.

Each demo belongs to its job (``pipelines/clicks_demo.py``, ``pipelines/rides_demo.py``): the engines name them here,
and import one only when it runs. ``--job`` picks it (``--demo`` is the older name of the same flag).
"""

from __future__ import annotations

import argparse
import importlib

# job name -> module with main(conf, overrides, events) -> exit code; its conf is conf/<job>.yaml
DEMOS = {"clicks": "pipelines.clicks_demo", "rides": "pipelines.rides_demo"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run a job end to end on local services and audit it")
    parser.add_argument(
        "--job", "--demo", dest="job", choices=sorted(DEMOS), default="clicks", help="which job (default %(default)s)"
    )
    parser.add_argument("--conf", default=None, help="the job's configuration (default conf/<job>.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--events", type=int, default=20_000, help="events to generate (default %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    demo = importlib.import_module(DEMOS[args.job])
    code: int = demo.main(args.conf or f"conf/{args.job}.yaml", tuple(args.set), args.events)
    return code

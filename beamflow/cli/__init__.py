"""The ``beamflow`` command. Each command group lives in its own module with a ``register(subparsers)`` function."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

__all__ = ["main"]

# Command groups, each a module in this package exposing register(subparsers) -> None.
COMMAND_MODULES = ["services", "generate", "schema", "iceberg", "flink", "doctor", "status", "demo"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="beamflow", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"beamflow.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"beamflow.cli.{name}":
                continue  # that command group is not part of this build
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    # Beam logs every type-hint conversion and optional-module probe at INFO; keep its warnings only.
    logging.getLogger("apache_beam").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())

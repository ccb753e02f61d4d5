"""Entry point of the `hisparse` command: builds the parser from the subcommand modules."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Each module defines `register(subparsers) -> None`, which adds its parser and sets
# `handler=<callable(args) -> int>` as a default. Imported lazily to keep `hisparse --help` fast.
SUBCOMMAND_MODULES = ("probe", "plan", "simulate", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hisparse",
        description="Hierarchical sparse KV cache for sparse-MLA decode.",
        epilog="Start with `hisparse probe` to see what this machine supports.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(f"hisparse.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"hisparse.cli.{name}":
                raise
            continue  # subcommand not built yet
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 2
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())

"""Entry point of the `hisparse` command: builds the parser from the subcommand modules."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence

from hisparse.cli._output import CommandParser

# Each module defines `register(subparsers) -> None`, which adds its parser and sets
# `handler=<callable(args) -> int>` and `parser=<its parser>` as defaults. Imported lazily to
# keep `hisparse --help` fast.
SUBCOMMAND_MODULES = ("probe", "plan", "simulate", "bench")
# What a shell reports for a process that SIGPIPE ended: `hisparse plan | head -2` exits as
# `yes | head -2` does.
BROKEN_PIPE_EXIT = 128 + signal.SIGPIPE


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="hisparse",
        description="Hierarchical sparse KV cache for sparse-MLA decode.",
        epilog="Start with `hisparse probe` to see what this machine supports.",
    )
    from hisparse import __version__

    parser.add_argument("--version", action="version", version=f"hisparse {__version__}")
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


def parse_arguments(parser: argparse.ArgumentParser,
                    argv: Sequence[str] | None) -> argparse.Namespace:
    """`parser.parse_args`, except that an unknown option after a subcommand is reported by
    that subcommand's parser (`hisparse plan --frobnicate` names plan, not the top level)."""
    args, unknown = parser.parse_known_args(list(argv) if argv is not None else None)
    if unknown:
        owner = getattr(args, "parser", None) or parser
        owner.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_arguments(parser, argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 2
    try:
        code = int(args.handler(args))
        sys.stdout.flush()  # inside the try: a closed pipe raises here, not at exit
    except BrokenPipeError:
        # The reader went away (`hisparse plan | head -2`): nothing is wrong with the run.
        # Point stdout at /dev/null so the interpreter's final flush cannot raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return BROKEN_PIPE_EXIT
    return code


if __name__ == "__main__":
    sys.exit(main())

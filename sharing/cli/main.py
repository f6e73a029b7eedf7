"""The `vgpu` command line. Each subcommand lives in its own module with `register(subparsers)`."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Sequence

from sharing import __version__, logsafe
from sharing.cli import demo, exporter, info, run, top
from sharing.cli.selftest import command as selftest
from sharing.plan import command as plan

# Subcommand modules: each has register(subparsers) which sets `func` on its parser.
_SUBCOMMANDS = (info, run, demo, exporter, top, plan, selftest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vgpu", description="Share one NVIDIA GPU between many workloads with hard limits."
    )
    parser.add_argument("--version", action="version", version=f"vgpu-sharing {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _SUBCOMMANDS:
        module.register(sub)
    return parser


def _value_options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string, of the parser and its subcommands, that takes one value."""
    out: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                out |= _value_options(p)
        elif action.option_strings and action.nargs is None:
            out.update(action.option_strings)
    return out


_NEGATIVE = re.compile(r"^-[0-9.]")


def attach_negative_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """`--memory -1Gi` as `--memory=-1Gi`: argparse takes a value that starts with '-' and is
    not a plain number for an option and answers with its usage; joined, the value reaches the
    option's own check and its one-line error. Nothing after `--` (the command) is touched."""
    takes_value = _value_options(parser)
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            out += args[i:]
            break
        if a in takes_value and i + 1 < len(args) and _NEGATIVE.match(args[i + 1]):
            out.append(f"{a}={args[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(attach_negative_values(parser, sys.argv[1:] if argv is None else argv))
    logsafe.configure(logging.DEBUG if args.verbose else logging.INFO)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

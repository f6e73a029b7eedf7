"""The `vgpu` command line. Each subcommand lives in its own module with `register(subparsers)`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from sharing import __version__, demo, exporter, info, run, top
from sharing.plan import command as plan

# Subcommand modules: each has register(subparsers) which sets `func` on its parser.
_SUBCOMMANDS = (info, run, demo, exporter, top, plan)


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

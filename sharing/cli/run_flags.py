"""The pieces every `vgpu run` flag group shares (sharing/cli/run.py, sharing/cli/compute_run.py): the
error type, the contributor protocol and the per-device flag pair (`--X` for every device,
`--X-<i>` for device i as the command sees it) that becomes `VAR` / `VAR_<i>`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Protocol

from sharing.region import MAX_DEVICES  # the devices the accounting file has room for


class RunConfigError(ValueError):
    """A bad `vgpu run` argument. str() is one line."""


class EnvContributor(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def env(self, args: argparse.Namespace) -> dict[str, str]: ...


def add_per_device(
    parser: argparse.ArgumentParser, flag: str, metavar: str, help_all: str, help_one: str
) -> None:
    """--FLAG (every device) and --FLAG-<i> (device i; only --FLAG-0 is listed in --help)."""
    parser.add_argument(f"--{flag}", dest=flag, metavar=metavar, help=help_all)
    for i in range(MAX_DEVICES):
        parser.add_argument(
            f"--{flag}-{i}",
            dest=f"{flag}_{i}",
            metavar=metavar,
            help=help_one if i == 0 else argparse.SUPPRESS,
        )


def per_device_env(
    args: argparse.Namespace, flag: str, var: str, value: Callable[[str, str], str]
) -> dict[str, str]:
    """VAR from --FLAG and VAR_<i> from --FLAG-<i>, each given flag's text turned into the
    variable's value by value(flag name, text), which raises RunConfigError for a bad one."""
    env: dict[str, str] = {}
    text = getattr(args, flag)
    if text is not None:
        env[var] = value(f"--{flag}", text)
    for i in range(MAX_DEVICES):
        text = getattr(args, f"{flag}_{i}")
        if text is not None:
            env[f"{var}_{i}"] = value(f"--{flag}-{i}", text)
    return env

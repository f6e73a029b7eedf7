"""The `vgpu` command as a user runs it: the CLI in a fresh interpreter, with the clean
environment of tests/support/shim_ops unless told otherwise."""

from __future__ import annotations

import subprocess
import sys

from tests.support.shim_ops import clean_env

VGPU = [sys.executable, "-m", "sharing.cli"]


def vgpu_run(
    args: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*VGPU, "run", *args],
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

"""The routes-around-the-hooks programs (tests/c/bypass_lib.c, a hostile library, loaded by
tests/c/bypass_main.c behind the preloaded shim), running them, and the quota they run under."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.cbuild import compile_shared_library
from tests.support.shim_ops import kv

GiB = 1 << 30
QUOTA = 1 * GiB
OVER = 2 * GiB  # twice the quota, well within the simulated GPU


@pytest.fixture
def hostile(cbin_dir: Path) -> Path:
    """tests/c/bypass_lib.c: the library that tries the routes."""
    return compile_shared_library("bypass_lib.c", cbin_dir, "libvgpu_bypass_test.so")


@pytest.fixture
def bypass_main(build_c: Callable[..., Path]) -> Path:
    """tests/c/bypass_main.c: loads the hostile library behind the shim and runs its routes."""
    return build_c("bypass_main.c", ["-ldl"])


def run(binary: Path, lib: str, env: dict[str, str], *ops: str) -> tuple[list[dict[str, str]], str]:
    r = subprocess.run(
        [str(binary), lib, *ops], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, f"rc={r.returncode} stdout={r.stdout!r} stderr={r.stderr!r}"
    lines = [kv(line) for line in r.stdout.splitlines()]
    return [d for d in lines if "op" in d], r.stdout + r.stderr


def quota_env(shim_env: dict[str, str]) -> dict[str, str]:
    return dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT=str(QUOTA))

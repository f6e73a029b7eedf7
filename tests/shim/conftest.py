"""Fixtures of the shim's tests: the harness linked with the shim's sources and a slice with a
quota (the helpers they use: tests/support/shim_ops.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.shim_ops import build_harness


@pytest.fixture(scope="session")
def shim_harness(cbin_dir: Path) -> Path:
    """tests/c/shim_harness.c linked with shim/src/*.c (no driver needed)."""
    return build_harness(cbin_dir, [])


@pytest.fixture
def slice_1gi(shim_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """shim_env with a 1 GiB quota on every device and its own accounting file."""
    return dict(
        shim_env,
        CUDA_DEVICE_MEMORY_LIMIT="1Gi",
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "slice"),
    )

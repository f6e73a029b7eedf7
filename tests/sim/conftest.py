"""Fixtures of the simulator tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def sim_tool(build_c: Callable[..., Path]) -> Path:
    """tests/c/sim_tool.c compiled against the simulated libcuda."""
    return build_c("sim_tool.c")

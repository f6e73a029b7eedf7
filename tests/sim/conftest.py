"""Fixtures of the simulator tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def sim_tool(build_c) -> Path:  # type: ignore[no-untyped-def]
    """tests/c/sim_tool.c compiled against the simulated libcuda."""
    return build_c("sim_tool.c")

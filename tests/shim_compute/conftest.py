"""Fixtures of the compute-cap tests: a workload runner on the simulated GPU under the shim."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.compute_workload import Workload


@pytest.fixture
def workload(build_c: Callable[..., Path], sim_env: dict[str, str], tmp_path: Path) -> Workload:
    return Workload(build_c("compute_workload.c"), sim_env, tmp_path)

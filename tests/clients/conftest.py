"""Real CUDA client libraries (numba-cuda, cuda.core; pinned in pyproject's test extras), NVIDIA's
CUDA runtime (libcudart 12 and 13 from the same extras) and the frameworks built on it (PyTorch,
CuPy: pyproject's `frameworks` list, installed by scripts/setup into .venv/frameworks) run as
unmodified programs on the simulated GPU, alone and under `vgpu run`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sharing.paths import sim_lib_dir
from tests.support.clients import Client
from tests.support.vllm_run import Run


@pytest.fixture
def client(tmp_path: Path) -> Client:
    state = tmp_path / "simgpu-state"
    state.mkdir()
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("CUDA_DEVICE_", "VGPU_")) or k == "LD_PRELOAD":
            del env[k]
    env.update(
        LD_LIBRARY_PATH=str(sim_lib_dir()),
        SIMGPU_STATE=str(state),
        VGPU_NODE_STATE_DIR=str(tmp_path / "node"),
        NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"),
        PYTHONWARNINGS="ignore",
        # the programs check each kernel's modelled duration by events: exact durations (the
        # compute-cap test drops these to run on the default spread and tail)
        SIMGPU_KERNEL_SPREAD_PCT="0",
        SIMGPU_KERNEL_TAIL_PPM="0",
    )
    return Client(env)


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    """Every vLLM Run a test starts is killed at its end, whatever happened."""
    started: list[Run] = []
    yield started
    for r in started:
        r.kill()

"""Real CUDA client libraries (numba-cuda, cuda.core; pinned in pyproject's test extras) run as
unmodified programs on the simulated GPU, alone and under `vgpu run`."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from sharing.paths import sim_lib_dir

PROGRAMS = Path(__file__).resolve().parent / "programs"


@dataclass
class Client:
    env: dict[str, str]

    def run(self, program: str, *args: str, vgpu: list[str] | None = None) -> str:
        """Run programs/<program> (on the simulator; under `vgpu run --sim VGPU... --` if given)."""
        cmd = [sys.executable, str(PROGRAMS / program), *args]
        if vgpu is not None:
            cmd = [sys.executable, "-m", "sharing.cli", "run", "--sim", *vgpu, "--", *cmd]
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr[-4000:]
        return r.stdout


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

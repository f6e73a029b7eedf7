"""What the framework benchmarks (bench_torch.py, bench_vllm.py) share: the environment of a run on
the simulated GPU, and running a program of the frameworks venv with or without `vgpu run`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from sharing.paths import sim_lib_dir

REPO = Path(__file__).resolve().parents[1]
FRAMEWORKS_PYTHON = REPO / ".venv" / "frameworks" / "bin" / "python"


def sim_env(tmp: Path, **extra: str) -> dict[str, str]:
    """This process's environment without any GPU, shim or simulator setting of its own, on a
    fresh simulator state under tmp; extra on top."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CUDA_DEVICE_", "VGPU_", "SIMGPU_")) and k != "LD_PRELOAD"
    }
    state = tmp / "simgpu-state"
    state.mkdir(exist_ok=True)
    env.update(
        LD_LIBRARY_PATH=str(sim_lib_dir()),
        SIMGPU_STATE=str(state),
        VGPU_NODE_STATE_DIR=str(tmp / "node"),
        PYTHONWARNINGS="ignore",
        **extra,
    )
    return env


def run_python(
    env: dict[str, str], vgpu: Sequence[str] | None, *args: str, wrap: Sequence[str] = ()
) -> str:
    """The frameworks venv's python with args (under `wrap`, e.g. valgrind), in a slice of
    `vgpu run --sim` with the flags vgpu unless None; its stdout. A failure ends the benchmark
    with the command and the end of its output."""
    cmd = [*wrap, str(FRAMEWORKS_PYTHON), *args]
    if vgpu is not None:
        cmd = [sys.executable, "-m", "sharing.cli", "run", "--sim", *vgpu, "--", *cmd]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise SystemExit(
            f"{' '.join(cmd)} exited {r.returncode}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
        )
    return r.stdout

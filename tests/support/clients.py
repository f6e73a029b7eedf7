"""Running the real CUDA clients (tests/clients/programs/) on the simulated GPU, alone or under
`vgpu run`, with this interpreter or the frameworks' one (.venv/frameworks)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROGRAMS = REPO / "tests" / "clients" / "programs"
# torch's CUDA 13 wheels and numba-cuda's CUDA 12 ones cannot share one environment
FRAMEWORKS_PYTHON = REPO / ".venv" / "frameworks" / "bin" / "python"


def frameworks_python(module: str) -> str:
    """The interpreter of .venv/frameworks, where `module` imports. Outside CI a missing
    framework skips the test saying how to install it; on CI it fails (the set-up installs it)."""
    why = ""
    if not FRAMEWORKS_PYTHON.exists():
        why = f"{FRAMEWORKS_PYTHON} does not exist"
    else:
        r = subprocess.run(
            [str(FRAMEWORKS_PYTHON), "-c", f"import {module}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if r.returncode != 0:
            why = f"{module} does not import in {FRAMEWORKS_PYTHON}: {r.stderr.strip()[-300:]}"
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"{why} (scripts/setup installs the frameworks)")
        pytest.skip(
            f"{why}: run scripts/setup (without VGPU_SETUP_FRAMEWORKS=0) to install PyTorch, CuPy and vLLM"
        )
    return str(FRAMEWORKS_PYTHON)


@dataclass
class Client:
    env: dict[str, str]

    def run(
        self, program: str, *args: str, vgpu: list[str] | None = None, python: str | None = None
    ) -> str:
        """Run programs/<program> (on the simulator; under `vgpu run --sim VGPU... --` if given)
        with `python` (default: this interpreter); a program without .py is an executable."""
        prog = str(PROGRAMS / program) if "/" not in program else program
        cmd = [python or sys.executable, prog, *args] if prog.endswith(".py") else [prog, *args]
        if vgpu is not None:
            cmd = [sys.executable, "-m", "sharing.cli", "run", "--sim", *vgpu, "--", *cmd]
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr[-4000:]
        return r.stdout

"""Fixtures of the shim's tests: the harness linked with the shim's sources, the preloaded shim
on the simulated GPU, and small helpers to run CUDA test programs under it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from sharing.paths import shim_library

REPO = Path(__file__).resolve().parents[2]
SHIM_SRC = REPO / "shim" / "src"
INCLUDE = REPO / "shim" / "include"


def _build_harness(out_dir: Path, extra: list[str]) -> Path:
    sources = sorted(SHIM_SRC.glob("*.c"))
    src = REPO / "tests" / "c" / "shim_harness.c"
    key = hashlib.sha256(
        b"".join(p.read_bytes() for p in [src, *sources, *sorted(SHIM_SRC.glob("*.[hd]*"))])
        + " ".join(extra).encode()
    ).hexdigest()[:12]
    out = out_dir / f"shim_harness-{key}"
    if not out.exists():
        cmd = [
            "gcc", "-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-pthread",
            "-Wno-unused-parameter", *extra, f"-I{INCLUDE}", f"-I{SHIM_SRC}", "-o", str(out),
            str(src), *map(str, sources), "-ldl", "-lm",
        ]  # fmt: skip
        subprocess.run(cmd, check=True)
    return out


@pytest.fixture(scope="session")
def shim_harness(cbin_dir: Path) -> Path:
    """tests/c/shim_harness.c linked with shim/src/*.c (no driver needed)."""
    return _build_harness(cbin_dir, [])


@pytest.fixture
def shim_env(sim_env: dict[str, str]) -> dict[str, str]:
    """sim_env with the shim preloaded and no limits or region set yet."""
    env = {k: v for k, v in sim_env.items() if not k.startswith(("CUDA_DEVICE_", "LIBCUDA_", "VGPU_"))}
    env.pop("CUDA_DISABLE_CONTROL", None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["LD_PRELOAD"] = str(shim_library())
    return env


def write_sim_config(tmp_path: Path, devices: list[dict[str, object]]) -> str:
    """A SIMGPU_CONFIG file with these devices; returns its path."""
    path = tmp_path / "simgpu.json"
    path.write_text(json.dumps({"devices": devices}))
    return str(path)


RunFn = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def run_prog() -> RunFn:
    """run_prog(binary, *args, env=..., timeout=...) -> CompletedProcess (text, captured)."""

    def _run(binary: Path, *args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(binary), *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
        )

    return _run


def kv(stdout: str) -> dict[str, str]:
    """Parse 'key=value' tokens of a test program's output (last occurrence wins)."""
    out: dict[str, str] = {}
    for tok in stdout.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            out[k] = v
    return out


def clean_env() -> dict[str, str]:
    env = dict(os.environ)
    for k in list(env):
        if k.startswith(("CUDA_DEVICE_", "LIBCUDA_", "VGPU_", "SIMGPU_")) or k == "LD_PRELOAD":
            del env[k]
    return env

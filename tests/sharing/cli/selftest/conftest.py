"""Fixtures of the selftest's tests: running `vgpu selftest`, and shims broken on purpose."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[4]


@dataclass
class Outcome:
    returncode: int
    report: dict[str, Any]
    stderr: str

    def status(self, name: str) -> str:
        (c,) = [c for c in self.report["checks"] if c["name"] == name]
        return str(c["status"])


def run_selftest(*args: str, env: dict[str, str] | None = None) -> Outcome:
    p = subprocess.run(
        [sys.executable, "-m", "sharing.cli", "selftest", "--sim", "--json", *args],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert p.stdout.strip(), p.stderr
    return Outcome(p.returncode, json.loads(p.stdout), p.stderr)


@pytest.fixture
def selftest_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIMGPU_", "CUDA_", "VGPU_"))}
    env.pop("LD_PRELOAD", None)
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    return env


def _groups(row: str) -> list[str]:
    """The top-level parenthesised groups of a hooks.def row after its symbol: params, args."""
    out: list[str] = []
    depth, start = 0, 0
    body = row[row.index("(") + 1 : row.rindex(")")]
    for i, ch in enumerate(body):
        if ch == "(":
            depth += 1
            if depth == 1:
                start = i
        elif ch == ")":
            depth -= 1
            if depth == 0:
                out.append(body[start : i + 1])
    return out


def _unhook(src: Path, name: str) -> None:
    """Make hook_<name> call the driver directly: its definition is renamed away and a new one
    forwards to real_<name> (the row of hooks.def stays, so every route still binds to it)."""
    (row,) = [ln for ln in (src / "hooks.def").read_text().splitlines() if f", {name}, (" in ln]
    params, args = _groups(row)
    (owner,) = [f for f in sorted(src.glob("*.c")) if f"CUresult hook_{name}(" in f.read_text()]
    text = owner.read_text().replace(f"CUresult hook_{name}(", f"CUresult hook_{name}_removed(")
    owner.write_text(text + f"\nCUresult hook_{name}{params} {{ return real_{name}{args}; }}\n")


@pytest.fixture(scope="session")
def broken_shim(tmp_path_factory: pytest.TempPathFactory) -> Callable[[tuple[str, ...]], Path]:
    """broken_shim(("cuMemAllocPitch_v2", ...)) -> a libvgpu.so built from a copy of shim/ in
    which those hooks pass the call straight to the driver, unchecked, as if the hook had been
    removed. The production sources are not touched; the copy builds with shim/build.py's own
    flags."""
    built: dict[tuple[str, ...], Path] = {}

    def _build(removed: tuple[str, ...]) -> Path:
        if removed in built:
            return built[removed]
        root = tmp_path_factory.mktemp("broken-shim")
        shutil.copytree(
            REPO / "shim", root / "shim", ignore=shutil.ignore_patterns("sim", "selftest")
        )
        for name in removed:
            _unhook(root / "shim" / "src", name)
        spec = importlib.util.spec_from_file_location("broken_build", root / "shim" / "build.py")
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        sys.modules["broken_build"] = mod  # dataclasses look the module up by name
        spec.loader.exec_module(mod)
        out = mod.build_with_gcc(root / "out", only=("libvgpu.so",))
        built[removed] = Path(out["libvgpu.so"])
        return built[removed]

    return _build

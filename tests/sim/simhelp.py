"""Helpers for the simulator tests: configs, CUDA client processes, pynvml in a subprocess.

pynvml runs in a child Python process so that every test has its own SIMGPU_STATE and
SIMGPU_CONFIG (the simulator maps the node state once per process) and loads the simulated
libnvidia-ml.so.1 by soname through LD_LIBRARY_PATH, as an unmodified program would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

# The device memory a context takes on the simulator by default (SIMGPU_CONTEXT_MEMORY, as on an
# H100: docs/simulator.md): every process holding a context shows it as used.
CONTEXT_MEMORY = 500 << 20
# Kernel durations exactly as modelled (no spread, no long tail): for tests that pin durations.
EXACT_DURATIONS = {"SIMGPU_KERNEL_SPREAD_PCT": "0", "SIMGPU_KERNEL_TAIL_PPM": "0"}

# Module marks (`pytestmark = ...`) that set simulator knobs in sim_env and shim_env
# (tests/conftest.py reads the `simgpu` mark).
# Contexts that take no device memory: for tests that pin allocations' charges against quotas of a
# few MiB, smaller than a context, or count a measuring process's bytes exactly (context memory
# itself: tests/sim/test_context_memory.py, tests/shim/test_context_memory.py).
NO_CONTEXT_MEMORY = pytest.mark.simgpu(SIMGPU_CONTEXT_MEMORY="0")
# Byte counts exact for a driver taking 512 B granules (the page model of the default, 2 MiB
# pages: tests/sim/test_pages.py) and contexts that take no memory.
EXACT_BYTES = pytest.mark.simgpu(SIMGPU_ALLOC_GRANULARITY="512", SIMGPU_CONTEXT_MEMORY="0")

PROBE_PRELUDE = """
import json, sys, time
import pynvml as nv
def text(v):
    return v.decode() if isinstance(v, bytes) else v
"""


def run_python(env: dict[str, str], code: str, timeout: float = 60) -> Any:
    """Run `code` (which must print one JSON document last) with pynvml importable; return it."""
    r = subprocess.run(
        [sys.executable, "-c", PROBE_PRELUDE + textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, f"probe failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def write_config(tmp: Path, doc: Any, name: str = "simgpu.json") -> Path:
    p = tmp / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


class Client:
    """A running `sim_tool` process (tests/c/sim_tool.c) that waits for stdin to close."""

    def __init__(self, tool: Path, env: dict[str, str], *args: str) -> None:
        self.proc = subprocess.Popen(
            [str(tool), *args],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline() if self.proc.stdout else ""
            if not line:
                break
            self.lines.append(line.strip())
            if line.startswith("READY"):
                return
        err = self.proc.stderr.read() if self.proc.stderr else ""
        raise AssertionError(f"sim_tool {args} did not get ready: {self.lines} {err}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def finish(self, timeout: float = 30) -> int:
        if self.proc.stdin:
            self.proc.stdin.close()
        return self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def tool_info(tool: Path, env: dict[str, str]) -> tuple[int, int]:
    r = subprocess.run(
        [str(tool), "info"], env=env, capture_output=True, text=True, timeout=30, check=True
    )
    fields = dict(kv.split("=") for kv in r.stdout.split())
    return int(fields["free"]), int(fields["total"])

"""Many threads of many processes on one simulated device at once."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from tests.sim.simhelp import CONTEXT_MEMORY, tool_info


def test_threads_of_several_processes(
    build_c: Callable[..., Path], sim_tool: Path, sim_env: dict[str, str]
) -> None:
    exe = build_c("sim_threads.c")
    procs = [
        subprocess.Popen(
            [str(exe)], env=sim_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip().endswith("OK"), out + err
    free, total = tool_info(sim_tool, sim_env)
    assert free == total - CONTEXT_MEMORY  # all returned but the measuring process's context


def test_threads_return_all_memory(build_c: Callable[..., Path], sim_env: dict[str, str]) -> None:
    exe = build_c("sim_threads.c")
    r = subprocess.run([str(exe)], env=sim_env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"free after={(80 << 30) - CONTEXT_MEMORY}" in r.stdout  # all but its own context

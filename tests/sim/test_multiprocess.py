"""Node-wide behaviour: one memory pool per device shared by processes, dead processes' memory
returning, fork, and what NVML sees of it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from tests.sim.simhelp import EXACT_BYTES, Client, run_python, tool_info

pytestmark = EXACT_BYTES


GB = 10**9

NVML_MEM_AND_PROCS = """
nv.nvmlInit()
h = nv.nvmlDeviceGetHandleByIndex(0)
m = nv.nvmlDeviceGetMemoryInfo(h)
procs = sorted((p.pid, p.usedGpuMemory) for p in nv.nvmlDeviceGetComputeRunningProcesses(h))
print(json.dumps({"used": m.used, "free": m.free, "total": m.total, "procs": procs}))
"""


def test_memory_is_one_pool_across_processes(sim_tool: Path, sim_env: dict[str, str]) -> None:
    free0, total = tool_info(sim_tool, sim_env)
    assert free0 == total == 80 << 30
    a = Client(sim_tool, sim_env, "hold", str(50 * GB))
    try:
        free1, _ = tool_info(sim_tool, sim_env)
        assert free1 == free0 - 50 * GB
        # another process cannot take what the first one holds ...
        assert (
            subprocess.run(
                [str(sim_tool), "alloc", str(40 * GB)], env=sim_env, timeout=60
            ).returncode
            == 2
        )
        # ... but can take the rest
        assert (
            subprocess.run(
                [str(sim_tool), "alloc", str(30 * GB)], env=sim_env, timeout=60
            ).returncode
            == 0
        )
        b = Client(sim_tool, sim_env, "hold", str(20 * GB))
        try:
            seen = run_python(sim_env, NVML_MEM_AND_PROCS)
            assert seen["used"] == 70 * GB
            assert seen["procs"] == sorted([[a.pid, 50 * GB], [b.pid, 20 * GB]])
        finally:
            assert b.finish() == 0
    finally:
        assert a.finish() == 0
    assert tool_info(sim_tool, sim_env)[0] == free0


def test_sigkilled_process_memory_comes_back(sim_tool: Path, sim_env: dict[str, str]) -> None:
    free0, _ = tool_info(sim_tool, sim_env)
    victims = [Client(sim_tool, sim_env, "hold", str(30 * GB)) for _ in range(2)]
    assert tool_info(sim_tool, sim_env)[0] == free0 - 60 * GB
    os.kill(victims[0].pid, signal.SIGKILL)
    victims[0].proc.wait(10)
    # the very next call of any process sees the memory back (CUDA ...)
    assert tool_info(sim_tool, sim_env)[0] == free0 - 30 * GB
    os.kill(victims[1].pid, signal.SIGKILL)
    victims[1].proc.wait(10)
    # (... and NVML), and the dead processes are no longer listed
    seen = run_python(sim_env, NVML_MEM_AND_PROCS)
    assert seen["used"] == 0 and seen["procs"] == []
    assert tool_info(sim_tool, sim_env)[0] == free0


def test_forked_child_gets_its_own_slot(sim_tool: Path, sim_env: dict[str, str]) -> None:
    parent = Client(sim_tool, sim_env, "fork", str(GB))
    try:
        child_line = next(line for line in parent.lines if line.startswith("child"))
        child_pid = int(child_line.split()[1].split("=")[1])
        assert int(child_line.split()[2].split("=")[1]) == (80 << 30) - 2 * GB
        seen = run_python(sim_env, NVML_MEM_AND_PROCS)
        assert seen["procs"] == sorted([[parent.pid, GB], [child_pid, GB]])
    finally:
        assert parent.finish() == 0
    assert tool_info(sim_tool, sim_env)[0] == 80 << 30


def test_idle_fork_child_does_not_keep_dead_parents_memory(
    sim_tool: Path, sim_env: dict[str, str]
) -> None:
    # The child inherits the parent's mapping of the node state (and with it the open file
    # description the mapping was made from) but never touches CUDA: it must not keep the
    # parent's slot alive once the parent is dead.
    free0, _ = tool_info(sim_tool, sim_env)
    parent = Client(sim_tool, sim_env, "forkidle", str(10 * GB))
    child_pid = int(next(line for line in parent.lines if line.startswith("child")).split("=")[1])
    try:
        assert tool_info(sim_tool, sim_env)[0] == free0 - 10 * GB
        os.kill(parent.pid, signal.SIGKILL)
        parent.proc.wait(10)
        os.kill(child_pid, 0)  # the child still lives
        assert tool_info(sim_tool, sim_env)[0] == free0
        seen = run_python(sim_env, NVML_MEM_AND_PROCS)
        assert seen["used"] == 0 and seen["procs"] == []
        os.kill(child_pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child_pid, signal.SIGKILL)


def test_context_memory_is_charged(sim_tool: Path, sim_env: dict[str, str]) -> None:
    """SIMGPU_CONTEXT_MEMORY: a context takes device memory while it exists, as a real one does."""
    env = {**sim_env, "SIMGPU_CONTEXT_MEMORY": "300Mi"}
    free, total = tool_info(sim_tool, env)
    assert free == total - (300 << 20)
    holder = Client(sim_tool, env, "hold", str(GB))
    try:
        seen = run_python(sim_env, NVML_MEM_AND_PROCS)
        assert seen["procs"] == [[holder.pid, GB + (300 << 20)]]
    finally:
        holder.finish()
    assert tool_info(sim_tool, sim_env)[0] == total

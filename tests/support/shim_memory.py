"""A memory slice of the shim seen from outside: its environment, the driver's per-process
figure (NVML read without the shim, as a node's tools read it) and the return codes of the
operations a harness ran in it."""

from __future__ import annotations

from pathlib import Path

from tests.sim.simhelp import run_python
from tests.support.shim_ops import Held

NVML_PROCS = """
nv.nvmlInit()
h = nv.nvmlDeviceGetHandleByIndex(0)
print(json.dumps({str(p.pid): p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(h)}))
"""


def slice_env(shim_env: dict[str, str], tmp_path: Path, limit: str) -> tuple[dict[str, str], Path]:
    """shim_env with a `limit` quota on every device and its own accounting file (returned too)."""
    reg = tmp_path / "slice.region"
    env = dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT=limit, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(reg))
    return env, reg


def nvml_procs(env: dict[str, str]) -> dict[int, int]:
    """Ground truth: NVML's used memory per process on device 0, read without the shim."""
    plain = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    return {int(pid): used for pid, used in run_python(plain, NVML_PROCS).items()}


def nvml_used(env: dict[str, str], pid: int) -> int:
    """NVML's used memory of one process on device 0 (0 when NVML does not list it)."""
    return nvml_procs(env).get(pid, 0)


def held_rcs(held: Held) -> list[str]:
    """The return code of every operation a held harness ran, in order."""
    return [r["rc"] for r in held.results]


def op_rcs(results: list[dict[str, str]], op: str) -> list[str]:
    """The return codes of the operations named `op`, in order."""
    return [r["rc"] for r in results if r["op"] == op]

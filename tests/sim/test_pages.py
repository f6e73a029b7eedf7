"""The simulated driver takes device memory as NVIDIA's does (SIMGPU_ALLOC_GRANULARITY, default
2 MiB pages): an allocation of at least half a page gets pages of its own; smaller ones are
sub-allocated from pages the process's small allocations share; cuMemGetInfo and NVML's
per-process used memory show the pages, and cuMemGetAllocationGranularity reports the page."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.sim.simhelp import run_python
from tests.support.shim_ops import Held

MiB = 1 << 20

NVML_PROC_USED = """
import json, os, pynvml as nv
nv.nvmlInit()
h = nv.nvmlDeviceGetHandleByIndex(0)
print(json.dumps({"used": {p.pid: p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(h)}}))
"""


@pytest.mark.parametrize("page", [None, 64 << 10, 512], ids=["default-2MiB", "64KiB", "512B"])
def test_pages_as_the_driver_takes_them(
    build_c: Callable[..., Path], sim_env: dict[str, str], page: int | None
) -> None:
    ops = build_c("shim_ops.c")
    env = dict(sim_env, SIMGPU_CONTEXT_MEMORY="0")  # the pages' bytes alone, not the context's
    if page is not None:
        env["SIMGPU_ALLOC_GRANULARITY"] = str(page)
    g = page or 2 * MiB
    small = g // 2 - 1 if g > 512 else 100
    held = Held(ops, env, "init", "ctx", "alloc:1", "info", "alloc:4096", "info",
                f"alloc:{small}", "info", f"alloc:{3 * g // 2}", "info", "free", "free", "info")  # fmt: skip
    try:
        used = [int(r["used"]) for r in held.results if r["op"] == "info"]
        if g > 512:
            # the small ones share one page (1 + 4096 + g/2 - 1 bytes); 1.5 pages of its own
            # take 2; freeing returns them (the shared page stays while small ones live in it)
            assert used == [g, g, g, 3 * g, g], used
        else:
            assert used == [512, 4608, 5120, 6144, 4608], used  # each in 512 B granules
        procs = run_python(env, NVML_PROC_USED)["used"]
        assert procs == {str(held.proc.pid): used[-1]}
    finally:
        held.release()


def test_granularity_knob_is_checked(build_c: Callable[..., Path], sim_env: dict[str, str]) -> None:
    ops = build_c("shim_ops.c")
    env = dict(sim_env, SIMGPU_ALLOC_GRANULARITY="3000", SIMGPU_CONTEXT_MEMORY="0")  # pages only
    held = Held(ops, env, "init", "ctx", "alloc:1", "info")
    assert int(held.results[-1]["used"]) == 2 * MiB  # not a power of two: the default
    held.release()
    assert "SIMGPU_ALLOC_GRANULARITY=3000: allowed: a power of two" in held.stderr

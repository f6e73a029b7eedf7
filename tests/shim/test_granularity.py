"""The quota holds whatever the driver's allocation granularity, by the driver's own count.

The simulated driver takes device memory in pages of SIMGPU_ALLOC_GRANULARITY (512 B, 64 KiB,
or NVIDIA's 2 MiB), sub-allocating small allocations from shared pages; the shim knows none of
these numbers and learns what it charges from the driver. The same mixed workload (many small
allocations, pitched allocations, arrays, pool allocations, VMM handles, some freed again) runs in
two processes of one slice, the second filling the slice until refused. Ground truth is NVML's
per-process used memory, read by a process without the shim: the slice's processes together
never pass the quota, the quota is usable (refusals come within a page of it, not far below),
and the shim charges exactly what the driver took. The row alignment of pitched allocations and
arrays varies too (SIMGPU_PITCH_ALIGNMENT): no attribute reports it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sharing import region
from tests.sim.simhelp import run_python
from tests.support.shim_ops import Held

KiB = 1 << 10
MiB = 1 << 20
QUOTA = 4 << 30  # room for two contexts of a realistic size besides the workload

NVML_PROC_USED = """
nv.nvmlInit()
h = nv.nvmlDeviceGetHandleByIndex(0)
print(json.dumps({str(p.pid): p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(h)}))
"""


def mixed_workload(seed: int) -> list[str]:
    """Every path that takes device memory, in sizes around every page boundary in question."""
    ops = [f"alloc:{1 + (seed * 7919 + 613 * i) % 6000}" for i in range(150)]  # small, unaligned
    ops += ["free"] * 20  # some small ones return (a shared page may empty)
    ops += [f"alloc:{(64 + i) * KiB + 1}" for i in range(4)]  # around 64 KiB pages
    ops += [f"alloc:{MiB + 17}", f"alloc:{2 * MiB + 1}", f"alloc:{3 * MiB - 1}"]  # around 2 MiB
    # the driver chooses the pitch
    ops += ["pitch:1000:1000", "pitch:3001:77", "pitch:100:3", "pitch:100:20000"]
    ops += ["array:1000:64", "array3d:100:100:10", "mipmap:300:512:3", "array:7:1"]
    ops += ["free"]  # the last array returns
    ops += [f"pool:{3000 + i}" for i in range(10)]  # default pool, small
    ops += [f"async:{8 * MiB + 123}", "freeasync", f"async:{5 * MiB}"]  # pool keeps a freed block
    ops += [f"newpool:{5 * MiB + 511}"]
    ops += [f"create:{4 * MiB}", f"create:{2 * MiB}"]  # VMM: multiples of every granularity here
    return ops


FILL = ["fill:16777216", "fill:1048576", "fill:65536", "fill:4096", "fill:100"]


def nvml_used(env: dict[str, str]) -> dict[str, int]:
    plain = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    used: dict[str, int] = run_python(plain, NVML_PROC_USED)
    return used


@pytest.mark.parametrize(
    ("page", "pitch"),
    [(512, 512), (64 * KiB, 512), (2 * MiB, 512), (64 * KiB, 128), (2 * MiB, 2048)],
    ids=["512B", "64KiB", "2MiB", "64KiB-pitch128", "2MiB-pitch2048"],
)
def test_quota_holds_at_every_granularity(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path, page: int, pitch: int
) -> None:
    """pitch: the row alignment of pitched allocations and arrays, which no attribute reports
    (512 B, the allocation alignment, by default; finer and coarser as another driver may)."""
    reg = tmp_path / "slice.region"
    env = dict(
        shim_env,
        CUDA_DEVICE_MEMORY_LIMIT=str(QUOTA),
        CUDA_DEVICE_MEMORY_SHARED_CACHE=str(reg),
        SIMGPU_ALLOC_GRANULARITY=str(page),
        SIMGPU_PITCH_ALIGNMENT=str(pitch),
    )
    first = Held(shim_ops, env, "init", "ctx", *mixed_workload(1))
    second = None
    try:
        assert all(r["rc"] == "0" for r in first.results), first.results
        second = Held(shim_ops, env, "init", "ctx", *mixed_workload(2), *FILL, "info")
        work = second.results[: -len(FILL) - 1]
        assert all(r["rc"] == "0" for r in work), work
        fills = second.results[-len(FILL) - 1 : -1]
        assert [r["rc"] for r in fills] == ["2"] * len(FILL)  # each ended refused, out of memory
        assert int(fills[0]["count"]) > 0  # the slice had room left to fill

        used = nvml_used(env)
        pids = [str(first.proc.pid), str(second.proc.pid)]
        taken = sum(used[p] for p in pids)
        charged = region.read(reg).devices[0].used
        # ground truth never passes the quota ...
        assert taken <= QUOTA, (taken, QUOTA)
        # ... the shim charges what the driver took: never less (the quota would not hold), and
        # not more either (the quota would not be usable) ...
        assert charged == taken, (charged, taken)
        # ... and the quota is usable: the last refusals came within a page (and one of the
        # smallest allocations) of it, not far below
        assert QUOTA - taken < page + 4096, (QUOTA - taken, page)
        assert int(second.results[-1]["free"]) == QUOTA - charged
    finally:
        if second is not None:
            second.release()
        first.release()
    assert region.read(reg).devices[0].used == 0

"""Calls reach the hooks by every route: direct binding, dlopen+dlsym, cuGetProcAddress(_v2).
Each route answers with the hook of exactly the symbol and ABI version asked for; what the
shim does not hook is the driver's own function."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.sim.simhelp import NO_CONTEXT_MEMORY
from tests.support.hooks_table import hooked_cuda_symbols
from tests.support.shim_ops import REPO, run_ops

pytestmark = NO_CONTEXT_MEMORY


MiB = 1 << 20


def procaddr_rows() -> list[tuple[str, int, str, str]]:
    text = (REPO / "shim" / "include" / "vgpu" / "cuda_procaddr.def").read_text()
    rows = re.findall(r"^CU_PROC\((\w+),\s*(\d+),\s*(\w+),\s*(\w*)\)", text, re.M)
    return [(b, int(v), s, p) for b, v, s, p in rows]


def test_the_hook_list_covers_every_versioned_memory_entry_point() -> None:
    hooked = hooked_cuda_symbols()
    for base in ("cuMemAlloc", "cuMemAllocPitch", "cuMemFree", "cuMemGetInfo", "cuDeviceTotalMem", "cuArrayCreate",
                 "cuArray3DCreate", "cuCtxCreate", "cuCtxDestroy", "cuDevicePrimaryCtxRelease",
                 "cuDevicePrimaryCtxReset", "cuMemAllocAsync", "cuMemFreeAsync", "cuMemAllocFromPoolAsync",
                 "cuGraphInstantiate", "cuGraphInstantiateWithFlags", "cuGraphInstantiateWithParams", "cuGraphLaunch",
                 "cuGraphExecDestroy", "cuDeviceGraphMemTrim", "cuModuleLoad", "cuModuleLoadData", "cuModuleLoadDataEx",
                 "cuModuleLoadFatBinary", "cuModuleUnload", "cuLibraryLoadData", "cuLibraryLoadFromFile",
                 "cuLibraryUnload"):  # fmt: skip
        symbols = {s for b, _, s, p in procaddr_rows() if b == base} | {
            p for b, _, _, p in procaddr_rows() if b == base and p
        }
        assert symbols and symbols <= hooked, (base, symbols - hooked)


def test_dlsym_returns_the_hook_of_exactly_that_symbol(
    shim_ops: Path, shim_env: dict[str, str]
) -> None:
    env = dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT="1Gi")
    hooked = sorted(hooked_cuda_symbols())
    unhooked = [
        "cuDeviceGet",
        "cuMemcpyHtoD_v2",
        "cuStreamCreate",
        "cuCtxGetDevice",
        "cuMemAllocHost_v2",
    ]
    res = run_ops(shim_ops, env, "init", *[f"dlsym_is:{s}" for s in hooked + unhooked])[1:]
    for sym, r in zip(hooked + unhooked, res, strict=True):
        want = ("1", "0") if sym in hooked else ("1", "1")
        assert (r["same"], r["real"]) == want, sym


def test_dlsym_without_shim_is_the_driver(shim_ops: Path, sim_env: dict[str, str]) -> None:
    res = run_ops(shim_ops, sim_env, "init", "dlsym_is:cuMemAlloc_v2")
    assert (res[1]["same"], res[1]["real"]) == ("1", "1")


def test_cugetprocaddress_answers_the_exact_version(
    shim_ops: Path, shim_env: dict[str, str]
) -> None:
    """Every row of the ABI table, with and without the per-thread flag: the answer is the
    exported symbol of that row (our hook if hooked, the driver's otherwise). The simulated
    driver answers with internal entry points, as NVIDIA's does: a hooked symbol is found by
    name (the shim's fallback), an unhooked one is the driver's internal entry point."""
    env = dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT="1Gi")
    hooked = hooked_cuda_symbols()
    cases: list[tuple[str, int, int, str]] = []
    for base, ver, sym, ptds in procaddr_rows():
        cases.append((base, ver, 0, sym))
        cases.append((base, ver, 2, ptds or sym))  # CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
    res = run_ops(shim_ops, env, "init", *[f"procaddr_is:{b}:{v}:{f}:{s}" for b, v, f, s in cases])[
        1:
    ]
    bad = []
    for (base, ver, flags, sym), r in zip(cases, res, strict=True):
        want = ("0", "1", "0", "0") if sym in hooked else ("0", "1", "1", "1")
        if (r["rc"], r["same"], r["real"], r["internal"]) != want:
            bad.append((base, ver, flags, sym, r))
    assert bad == []


# (dlsym name | procaddr request, the versioned symbol it must reach)
ENFORCED_ROUTES = [
    ("dlsym:cuMemAlloc_v2", "cuMemAlloc_v2"),
    ("dlsym:cuMemAlloc", "cuMemAlloc"),
    ("dlsym:cuMemAllocManaged", "cuMemAllocManaged"),
    ("dlsym:cuMemAllocPitch_v2", "cuMemAllocPitch_v2"),
    ("dlsym:cuMemAllocPitch", "cuMemAllocPitch"),
    ("dlsym:cuMemAllocAsync", "cuMemAllocAsync"),
    ("dlsym:cuMemAllocAsync_ptsz", "cuMemAllocAsync_ptsz"),
    ("procaddr:cuMemAlloc:12000:0", "cuMemAlloc_v2"),
    ("procaddr:cuMemAlloc:3020:2", "cuMemAlloc_v2"),
    ("procaddr:cuMemAlloc:2000:0", "cuMemAlloc"),
    ("procaddr:cuMemAllocManaged:12000:0", "cuMemAllocManaged"),
    ("procaddr:cuMemAllocPitch:12000:0", "cuMemAllocPitch_v2"),
    ("procaddr:cuMemAllocPitch:2000:0", "cuMemAllocPitch"),
    ("procaddr:cuMemAllocAsync:12000:0", "cuMemAllocAsync"),
    ("procaddr:cuMemAllocAsync:12000:2", "cuMemAllocAsync_ptsz"),
]


@pytest.mark.parametrize(("route", "symbol"), ENFORCED_ROUTES)
def test_every_route_is_enforced(
    route: str, symbol: str, shim_ops: Path, shim_env: dict[str, str]
) -> None:
    env = dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT="64Mi")
    size = 48 * MiB
    op = f"{route}:{size}" if route.startswith("dlsym:") else f"{route}:{size}:{symbol}"
    res = run_ops(shim_ops, env, "init", "ctx", op, op, "free", op)
    assert [r["rc"] for r in res[2:]] == ["0", "2", "0", "0"], (route, res)


def test_unhooked_calls_pass_through(shim_ops: Path, shim_env: dict[str, str]) -> None:
    env = dict(shim_env, CUDA_DEVICE_MEMORY_LIMIT="64Mi")
    res = run_ops(
        shim_ops, env, "init", "ctx", "procaddr_is:cuMemcpyHtoD:7000:2:cuMemcpyHtoD_v2_ptds"
    )
    # the driver's own internal entry point, passed through untouched
    assert (res[2]["same"], res[2]["real"], res[2]["internal"]) == ("1", "1", "1")

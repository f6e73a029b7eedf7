"""Every path that takes device memory is charged (what the driver takes) and released, and
refused exactly at the quota. Ground truth: the simulator's own usage, seen without the shim."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from sharing import region
from tests.sim.simhelp import NO_CONTEXT_MEMORY
from tests.support.shim_memory import slice_env
from tests.support.shim_ops import Held, device_used, run_ops

pytestmark = NO_CONTEXT_MEMORY


MiB = 1 << 20

# op builders: bytes -> shim_ops operation taking about that many bytes
PATHS: dict[str, Callable[[int], str]] = {
    "cuMemAlloc_v2": lambda n: f"alloc:{n}",
    "cuMemAlloc": lambda n: f"alloc1:{n}",
    "cuMemAllocPitch_v2": lambda n: f"pitch:1000:{n // 1024}",  # pitch 1024 > width 1000
    "cuMemAllocManaged": lambda n: f"managed:{n}",
    "cuMemCreate": lambda n: f"create:{n}",
    "cuMemAllocAsync": lambda n: f"async:{n}",
    "cuMemAllocFromPoolAsync(default pool)": lambda n: f"pool:{n}",
    "cuMemAllocFromPoolAsync(created pool)": lambda n: f"newpool:{n}",
    "cuArrayCreate_v2": lambda n: f"array:{n // 16 // 64}:64",  # float4: 16 B per element
    "cuArray3DCreate_v2": lambda n: f"array3d:{n // 16 // 64 // 4}:64:4",
    "cuMipmappedArrayCreate": lambda n: f"mipmap:{n // 16 // 512}:512:3",
}


@pytest.mark.parametrize("path", list(PATHS))
def test_charged_as_the_driver_takes_and_released(
    path: str, shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    env, reg = slice_env(shim_env, tmp_path, "256Mi")
    held = Held(shim_ops, env, "init", "ctx", PATHS[path](8 * MiB))
    assert held.results[-1]["rc"] == "0", held.results
    try:
        charged = region.read(reg).devices[0].used
        taken = device_used(shim_ops, env)
        assert taken > 0
        assert charged == taken  # exactly what the driver took (rounding included)
    finally:
        held.release()
    assert region.read(reg).devices[0].used == 0
    assert device_used(shim_ops, env) == 0


@pytest.mark.parametrize("path", list(PATHS))
def test_refused_at_the_quota(
    path: str, shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    quota = 64 * MiB
    size = 6 * MiB
    env, _ = slice_env(shim_env, tmp_path, str(quota))
    res = run_ops(shim_ops, env, "init", "ctx", *[PATHS[path](size)] * 14, "info")
    rcs = [r["rc"] for r in res[2:16]]
    ok = rcs.count("0")
    assert rcs == ["0"] * ok + ["2"] * (14 - ok)  # CUDA_ERROR_OUT_OF_MEMORY once full, never before
    per = (quota - int(res[16]["free"])) // ok
    assert ok * per <= quota < (ok + 1) * per  # the next one would have crossed the quota
    assert int(res[16]["total"]) == quota


def test_exact_boundary_linear(shim_ops: Path, shim_env: dict[str, str], tmp_path: Path) -> None:
    quota = 64 * MiB
    env, _ = slice_env(shim_env, tmp_path, "64Mi")
    env["SIMGPU_ALLOC_GRANULARITY"] = "512"  # a driver taking every allocation in 512 B granules
    res = run_ops(
        shim_ops, env, "init", "ctx", f"alloc:{quota - 512}", "alloc:513", "alloc:1", "alloc:1", "info",
        "freeall", "info",
    )  # fmt: skip
    # 513 B take two 512 B granules: one too many; 1 B takes one: exactly the quota
    assert [r["rc"] for r in res[2:6]] == ["0", "2", "0", "2"]
    assert res[6]["free"] == "0" and res[6]["total"] == str(quota)
    assert res[8]["free"] == str(quota)


@pytest.mark.parametrize("page", [64 << 10, 2 * MiB], ids=["64KiB", "2MiB"])
def test_exact_boundary_in_pages(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path, page: int
) -> None:
    """A driver that takes whole pages (NVIDIA's 2 MiB; 64 KiB) and sub-allocates small
    allocations from shared pages: the shim learns the page from the driver and charges what it
    takes, so the slice fills exactly to the quota, and the driver's own count (ground truth,
    as NVML shows it per process) never passes it."""
    quota = 64 * MiB
    env, reg = slice_env(shim_env, tmp_path, "64Mi")
    env["SIMGPU_ALLOC_GRANULARITY"] = str(page)
    held = Held(
        shim_ops, env, "init", "ctx", f"alloc:{quota - page - 1}",  # its own pages: quota - page
        f"alloc:{page + 1}",  # two pages of its own: one too many
        "alloc:1", "alloc:4096",  # small: one shared page (the last one) holds both
        f"alloc:{page // 2}",  # a page of its own (>= page/2): refused
        f"alloc:{page // 2 - 1}",  # small, and still fits the shared page: nothing more taken
        f"alloc:{page // 2 - 1}",  # small, but the shared page is full: a new page, refused
        "info",
    )  # fmt: skip
    try:
        rcs = [r["rc"] for r in held.results[2:9]]
        assert rcs == ["0", "2", "0", "0", "2", "0", "2"], held.results
        assert held.results[9]["free"] == "0"
        assert region.read(reg).devices[0].used == device_used(shim_ops, env) == quota
    finally:
        held.release()
    assert device_used(shim_ops, env) == 0


def test_denial_message_once_per_process(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    env, _ = slice_env(shim_env, tmp_path, "64Mi")
    r = subprocess.run(
        [str(shim_ops), "init", "ctx", f"alloc:{60 * MiB}", f"alloc:{64 * MiB}", f"alloc:{64 * MiB}"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    lines = [x for x in r.stderr.splitlines() if x.startswith("vgpu:")]
    assert lines == ["vgpu: device 0: 64.0 MiB denied, slice uses 60.0 MiB of 64.0 MiB"]


def test_pool_cache_does_not_cause_spurious_oom(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """A pool that once held most of the quota does not refuse later allocations."""
    env, _ = slice_env(shim_env, tmp_path, "64Mi")
    res = run_ops(
        shim_ops, env, "init", "ctx", f"pool:{48 * MiB}", "free", f"pool:{48 * MiB}", "free",
        f"alloc:{48 * MiB}", "free", "info",
    )  # fmt: skip
    assert all(r["rc"] == "0" for r in res), res
    assert res[-1]["free"] == str(64 * MiB)


def test_context_reserve(shim_ops: Path, shim_env: dict[str, str], tmp_path: Path) -> None:
    """VGPU_CONTEXT_RESERVE is charged per context (here matching the simulator's footprint)."""
    env, reg = slice_env(shim_env, tmp_path, "64Mi")
    env.update(VGPU_CONTEXT_RESERVE="8Mi", SIMGPU_CONTEXT_MEMORY=str(8 * MiB))
    held = Held(
        shim_ops, env, "init", "ctx", "ctxcreate", f"alloc:{40 * MiB}", f"alloc:{8 * MiB + 512}"
    )
    try:
        assert [r["rc"] for r in held.results] == ["0", "0", "0", "0", "2"]
        assert region.read(reg).devices[0].used == 56 * MiB
    finally:
        held.release()


def test_pool_cached_memory_is_charged_until_released(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """A block freed without synchronisation stays reserved in the pool (the driver still holds
    it): it stays charged, and a plain allocation that needs it makes the pool give it back."""
    env, reg = slice_env(shim_env, tmp_path, "64Mi")
    held = Held(shim_ops, env, "init", "ctx", f"pool:{40 * MiB}", "freeasync")
    try:
        assert region.read(reg).devices[0].used == device_used(shim_ops, env) == 40 * MiB
    finally:
        held.release()
    held = Held(shim_ops, env, "init", "ctx", f"pool:{40 * MiB}", "freeasync", f"alloc:{40 * MiB}")
    try:
        assert held.results[-1]["rc"] == "0"
        assert region.read(reg).devices[0].used == device_used(shim_ops, env) == 40 * MiB
    finally:
        held.release()


@pytest.mark.parametrize("threshold", ["max", "0"])
def test_pool_reuses_its_own_freed_block_in_a_full_slice(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path, threshold: str
) -> None:
    """The default pool (release threshold UINT64_MAX, as cuda.core sets it, or 0) fills a 1 GiB
    slice with 8 x 128 MiB; one is freed (no synchronisation: the pool keeps the block); a new
    128 MiB allocation is served from that block, as without the shim. A ninth is refused."""
    env, reg = slice_env(shim_env, tmp_path, "1Gi")
    ops = ["init", "ctx", f"threshold:{threshold}", *[f"async:{128 * MiB}"] * 8, "freeasync"]
    held = Held(shim_ops, env, *ops, f"async:{128 * MiB}", f"async:{128 * MiB}")
    try:
        rcs = [r["rc"] for r in held.results]
        assert rcs == ["0"] * 13 + ["2"], held.results
        assert region.read(reg).devices[0].used == device_used(shim_ops, env) == 1 << 30
    finally:
        held.release()


def test_null_output_pointers_go_to_the_driver(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    env, _ = slice_env(shim_env, tmp_path, "64Mi")
    res = run_ops(shim_ops, env, "init", "ctx", "nulls", "info")
    assert res[2]["accepted"] == "0"  # every call returned the driver's error
    assert res[3]["free"] == str(64 * MiB)  # and nothing was charged


def test_pool_destroyed_before_its_allocation(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """cuMemPoolDestroy with an allocation outstanding: the driver keeps that block until it is
    freed, and so does the charge."""
    env, reg = slice_env(shim_env, tmp_path, "64Mi")
    held = Held(shim_ops, env, "init", "ctx", f"newpool:{8 * MiB}", "swap", "free")
    try:
        assert [r["rc"] for r in held.results] == ["0", "0", "0", "0", "0"]
        assert region.read(reg).devices[0].used == device_used(shim_ops, env) == 8 * MiB
        res = run_ops(shim_ops, env, "init", "ctx", "info")
        assert res[2]["free"] == str(56 * MiB)
    finally:
        out = held.release()
    assert out[-1]["rc"] == "0"


def test_pool_destroyed_after_its_allocation_returns_everything(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    env, reg = slice_env(shim_env, tmp_path, "64Mi")
    held = Held(shim_ops, env, "init", "ctx", f"newpool:{8 * MiB}", "freeasync", "free")
    try:
        assert region.read(reg).devices[0].used == device_used(shim_ops, env) == 0
    finally:
        held.release()


def test_block_of_a_destroyed_pool_returns_when_freed(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    env, reg = slice_env(shim_env, tmp_path, "64Mi")
    held = Held(
        shim_ops,
        env,
        "init",
        "ctx",
        f"alloc:{4 * MiB}",
        f"newpool:{8 * MiB}",
        "swap",
        "free",
        "free",
    )
    try:
        assert [r["rc"] for r in held.results] == ["0"] * 7
        assert region.read(reg).devices[0].used == device_used(shim_ops, env) == 4 * MiB
    finally:
        held.release()


def test_cumemfree_of_a_stream_ordered_allocation(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    env, reg = slice_env(shim_env, tmp_path, "64Mi")
    held = Held(
        shim_ops, env, "init", "ctx", f"async:{40 * MiB}", "freesync", "sync", f"alloc:{40 * MiB}"
    )
    try:
        assert [r["rc"] for r in held.results] == ["0"] * 6
        assert region.read(reg).devices[0].used == device_used(shim_ops, env) == 40 * MiB
    finally:
        held.release()


def test_vmm_memory_is_returned_at_release_not_at_unmap(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    env, reg = slice_env(shim_env, tmp_path, "64Mi")
    held = Held(shim_ops, env, "init", "ctx", f"create:{8 * MiB}", f"mapunmap:{8 * MiB}")
    try:
        assert [r["rc"] for r in held.results] == ["0"] * 4
        assert region.read(reg).devices[0].used == device_used(shim_ops, env) == 8 * MiB
    finally:
        held.release()
    held = Held(shim_ops, env, "init", "ctx", f"create:{8 * MiB}", f"mapunmap:{8 * MiB}", "free")
    try:
        assert region.read(reg).devices[0].used == device_used(shim_ops, env) == 0
    finally:
        held.release()


def test_vmm_retained_handle_is_returned_at_its_last_release(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """cuMemRetainAllocationHandle adds a reference: the memory stays until the last release."""
    env, reg = slice_env(shim_env, tmp_path, "64Mi")
    ops = [
        "init",
        "ctx",
        f"create:{8 * MiB}",
        f"retainrelease:{8 * MiB}",
        f"retainrelease:{8 * MiB}",
    ]
    held = Held(shim_ops, env, *ops)
    try:
        assert [r["rc"] for r in held.results] == ["0"] * 5, held.results
        assert held.results[-1]["same"] == "1"
        # two retains, each released: the handle's own reference holds the memory, still charged
        assert region.read(reg).devices[0].used == device_used(shim_ops, env) == 8 * MiB
    finally:
        held.release()
    held = Held(shim_ops, env, *ops, "free")
    try:
        assert held.results[-1]["rc"] == "0"
        assert region.read(reg).devices[0].used == device_used(shim_ops, env) == 0
    finally:
        held.release()

"""Module globals under the shim: the __device__ / __constant__ variables of a loaded module are
device memory the driver allocates at load; the shim learns them from the image's names and the
driver's cuModuleGetGlobal sizes, charges them, refuses (and undoes) a load the quota cannot
hold with CUDA_ERROR_OUT_OF_MEMORY, and returns them at cuModuleUnload / cuLibraryUnload /
context destruction. Ground truth: NVML's per-process used memory never exceeds the quota."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cuda_modules import cubin, ptx
from tests.support.shim_memory import nvml_used, op_rcs
from tests.support.shim_ops import Held, run_ops

MiB = 1 << 20
QUOTA = 1 << 30  # slice_1gi's
OK, OUT_OF_MEMORY = "0", "2"
ROUTES = ["direct", "dlsym", "procaddr"]


def used(results: list[dict[str, str]]) -> list[int]:
    return [int(r["used"]) for r in results if r["op"] == "info"]


@pytest.mark.slow
@pytest.mark.parametrize("image", ["ptx", "cubin"])
def test_cubin_and_ptx_globals_charged_and_refused(
    graphmem_ops: Path, slice_1gi: dict[str, str], tmp_path: Path, image: str
) -> None:
    make = ptx if image == "ptx" else cubin
    fits, too_big = make(tmp_path / "fits", 300 * MiB), make(tmp_path / "big", 2 * QUOTA)
    plain = {k: v for k, v in slice_1gi.items() if k != "LD_PRELOAD"}
    res = run_ops(graphmem_ops, plain, "init", "info", f"modload:{fits}", "info", "global:big")
    driver_took = int(res[3]["used"]) - int(res[1]["used"])
    assert driver_took >= 300 * MiB and res[-1]["bytes"] == str(300 * MiB)
    held = Held(graphmem_ops, slice_1gi, "init", "info", f"modload:{fits}", "info", f"modload:{too_big}",
                "info")  # fmt: skip
    try:
        assert op_rcs(held.results, "modload") == [OK, OUT_OF_MEMORY]
        base, loaded, refused = used(held.results)
        assert loaded - base == driver_took
        assert refused == loaded
        assert nvml_used(slice_1gi, held.proc.pid) <= QUOTA
    finally:
        held.release()


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
def test_globals_are_charged_as_the_driver_takes_them(
    graphmem_ops: Path, slice_1gi: dict[str, str], tmp_path: Path, route: str
) -> None:
    mod = ptx(tmp_path / "m.ptx", 100_000_000)
    plain = {k: v for k, v in slice_1gi.items() if k != "LD_PRELOAD"}
    truth = Held(
        graphmem_ops, plain, "init", "info", f"modload:{mod}", "info"
    )  # the simulator alone
    try:
        driver_took = used(truth.results)[1] - used(truth.results)[0]
        truth_nvml = nvml_used(plain, truth.proc.pid)
    finally:
        truth.release()
    held = Held(
        graphmem_ops,
        slice_1gi,
        "init",
        f"route:{route}",
        "info",
        f"modload:{mod}",
        "info",
        "global:big",
    )
    try:
        assert op_rcs(held.results, "modload") == [OK]
        assert held.results[-1]["bytes"] == "100000000"
        before, after = used(held.results)
        assert driver_took >= 100_000_000
        assert after - before == driver_took  # the slice is charged what the device lost
        assert nvml_used(slice_1gi, held.proc.pid) == truth_nvml
    finally:
        held.release()


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
def test_loads_fill_the_quota_and_no_further(
    graphmem_ops: Path, slice_1gi: dict[str, str], tmp_path: Path, route: str
) -> None:
    mod = ptx(tmp_path / "m.ptx", 200 * MiB)
    held = Held(graphmem_ops, slice_1gi, "init", f"route:{route}", *[f"modload:{mod}"] * 8, "info")
    try:
        loads = op_rcs(held.results, "modload")
        assert OK in loads and loads[-1] == OUT_OF_MEMORY, loads
        assert nvml_used(slice_1gi, held.proc.pid) <= QUOTA
    finally:
        held.release()


@pytest.mark.slow
def test_a_module_larger_than_the_quota_is_refused_and_unloaded(
    graphmem_ops: Path, slice_1gi: dict[str, str], tmp_path: Path
) -> None:
    mod = ptx(tmp_path / "m.ptx", 2 * QUOTA)
    loads = ["modload", "modfile", "fatload", "libload", "libfile"]
    held = Held(graphmem_ops, slice_1gi, "init", "info", *[f"{op}:{mod}" for op in loads], "info")
    try:
        for op in loads:
            assert op_rcs(held.results, op) == [OUT_OF_MEMORY], op
        before, after = used(held.results)
        assert after == before
        assert nvml_used(slice_1gi, held.proc.pid) <= QUOTA  # the driver's allocation was undone
    finally:
        held.release()


@pytest.mark.slow
@pytest.mark.parametrize(
    "load,release",
    [
        ("modload", "modunload"),
        ("modfile", "modunload"),
        ("fatload", "modunload"),
        ("libload", "libunload"),
        ("libfile", "libunload"),
        ("modload", "preset"),
    ],
)
def test_returned_at_unload_and_with_the_context(
    graphmem_ops: Path, slice_1gi: dict[str, str], tmp_path: Path, load: str, release: str
) -> None:
    mod = ptx(tmp_path / "m.ptx", 300 * MiB)
    res = run_ops(graphmem_ops, slice_1gi, "init", "info", f"{load}:{mod}", "info", release, "info")
    assert all(r["rc"] == OK for r in res), res
    base, loaded, released = used(res)
    assert loaded >= base + 300 * MiB
    assert released == base


def test_returned_when_a_created_context_is_destroyed(
    graphmem_ops: Path, slice_1gi: dict[str, str], tmp_path: Path
) -> None:
    mod = ptx(tmp_path / "m.ptx", 100 * MiB)  # the primary and the created context: 2 x 500 MiB
    res = run_ops(graphmem_ops, dict(slice_1gi, CUDA_DEVICE_MEMORY_LIMIT="2Gi"), "init", "info", "ctxnew",
                  f"modload:{mod}", "info", "ctxdestroy", "info")  # fmt: skip
    assert all(r["rc"] == OK for r in res), res
    base, in_ctx, ctx_gone = used(res)
    assert in_ctx >= base + 100 * MiB  # (and the created context's own memory)
    assert ctx_gone == base

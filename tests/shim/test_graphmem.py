"""Graph memory under the shim: allocation nodes (cuGraphAddMemAllocNode, and cuMemAllocAsync
captured from a stream) are charged when the driver takes their memory, at launch; a launch the
quota cannot hold is refused with CUDA_ERROR_OUT_OF_MEMORY and takes nothing; the charge follows
the device's graph memory pool down at cuDeviceGraphMemTrim (and the refusal path trims it).
Ground truth: NVML's per-process used memory never exceeds the quota. Every route: the linked
symbol, dlsym, cuGetProcAddress (with and without the per-thread default stream)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.shim_memory import nvml_used, op_rcs
from tests.support.shim_ops import Held, run_ops

MiB = 1 << 20
GiB = 1 << 30
QUOTA = 1 * GiB
OK, OUT_OF_MEMORY = "0", "2"
ROUTES = ["direct", "dlsym", "procaddr", "procaddr_ptds"]


def graphs(n: int, size: int) -> list[str]:
    """n graphs of one unfreed allocation node each, launched one after the other."""
    return [op for _ in range(n) for op in ("gnew", f"gnode:{size}", "inst", "launch")]


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
def test_graph_launches_fill_the_quota_and_no_further(
    graphmem_ops: Path, slice_1gi: dict[str, str], route: str
) -> None:
    held = Held(graphmem_ops, slice_1gi, "init", f"route:{route}", *graphs(12, 128 * MiB), "info")
    try:
        launches = op_rcs(held.results, "launch")
        assert OK in launches and launches[-1] == OUT_OF_MEMORY, launches
        assert launches == sorted(launches)  # once refused, refused: nothing was taken
        assert all(r == OK for r in op_rcs(held.results, "gnode") + op_rcs(held.results, "inst"))
        assert nvml_used(slice_1gi, held.proc.pid) <= QUOTA
    finally:
        held.release()


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
def test_captured_allocation_is_charged_at_launch_not_at_capture(
    graphmem_ops: Path, slice_1gi: dict[str, str], route: str
) -> None:
    """A full slice can still capture (the driver takes nothing then); the launch is refused."""
    fill = [f"alloc:{64 * MiB}"] * 20
    held = Held(graphmem_ops, slice_1gi, "init", f"route:{route}", *fill, "capbegin", f"capalloc:{64 * MiB}", "capend", "inst",
                "launch", "info")  # fmt: skip
    try:
        assert OUT_OF_MEMORY in op_rcs(held.results, "alloc")  # the slice is full
        assert op_rcs(held.results, "capalloc") == [OK]
        assert op_rcs(held.results, "inst") == [OK]
        assert op_rcs(held.results, "launch") == [OUT_OF_MEMORY]
        assert nvml_used(slice_1gi, held.proc.pid) <= QUOTA
    finally:
        held.release()
    # with room, the captured allocation runs and is charged: the slice view shows it
    res = run_ops(graphmem_ops, slice_1gi, "init", "info", "capbegin", f"capalloc:{256 * MiB}", "capend", "info", "inst",
                  "launch", "info", "touch")  # fmt: skip
    assert all(r["rc"] == OK for r in res), res
    base, captured, launched = (int(r["used"]) for r in res if r["op"] == "info")
    assert captured == base
    assert launched == base + 256 * MiB


def test_graph_larger_than_the_quota_is_refused(
    graphmem_ops: Path, slice_1gi: dict[str, str]
) -> None:
    res = run_ops(
        graphmem_ops, slice_1gi, "init", "gnew", f"gnode:{2 * QUOTA}", "inst", "launch", "gattr"
    )
    assert op_rcs(res, "launch") == [OUT_OF_MEMORY]
    assert res[-1]["greserved"] == "0"  # the driver was never asked


def test_the_charge_follows_the_graph_pool_down(
    graphmem_ops: Path, slice_1gi: dict[str, str]
) -> None:
    """Freed graph memory stays charged while the graph pool keeps it (as on the device), and
    comes back at cuDeviceGraphMemTrim."""
    res = run_ops(graphmem_ops, slice_1gi, "init", "info", *graphs(1, 256 * MiB), "info", "memfree", "execdestroy",
                  "gdestroy", "info", "trim", "info")  # fmt: skip
    assert all(r["rc"] == OK for r in res), res
    base, launched, freed, trimmed = (int(r["used"]) for r in res if r["op"] == "info")
    assert launched == base + 256 * MiB
    assert freed == launched
    assert trimmed == base


def test_graph_pool_cache_never_causes_an_oom(
    graphmem_ops: Path, slice_1gi: dict[str, str]
) -> None:
    """Fill the slice with graph memory, free it (the pool keeps it), then cuMemAlloc: the
    refusal path trims the graph pool instead of refusing."""
    ops = ["init", "info", *graphs(12, 128 * MiB)]
    res = run_ops(graphmem_ops, slice_1gi, *ops, *(["memfree"] * 12), f"alloc:{512 * MiB}", "info")
    launched = op_rcs(res, "launch").count(OK)
    assert launched >= 4
    assert op_rcs(res, "memfree").count(OK) == launched  # (those never launched are not allocated)
    assert op_rcs(res, "alloc") == [OK]


def test_relaunch_reuses_what_the_pool_holds(graphmem_ops: Path, slice_1gi: dict[str, str]) -> None:
    """A graph that frees its allocation within the launch needs nothing more on relaunch."""
    res = run_ops(graphmem_ops, slice_1gi, "init", f"alloc:{256 * MiB}", "gnew", f"gnode:{128 * MiB}", "gfreenode", "inst",
                  *(["launch", "info"] * 3))  # fmt: skip
    assert op_rcs(res, "launch") == [OK] * 3
    used = [int(r["used"]) for r in res if r["op"] == "info"]
    assert used[0] == used[1] == used[2]


def test_auto_free_relaunch_in_a_full_slice(graphmem_ops: Path, slice_1gi: dict[str, str]) -> None:
    """An exec instantiated with CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH (as PyTorch
    does) frees its previous allocation before relaunching: the device needs nothing more, so a
    full slice relaunches it; one without the flag is refused by the driver itself."""
    fill = [f"alloc:{64 * MiB}"] * 20
    held = Held(graphmem_ops, slice_1gi, "init", "gnew", f"gnode:{256 * MiB}", "inst:1", "launch", *fill, "info",
                "launch", "launch", "info")  # fmt: skip
    try:
        assert OUT_OF_MEMORY in op_rcs(held.results, "alloc")  # the slice is full
        assert op_rcs(held.results, "launch") == [OK, OK, OK]
        before, after = (int(r["used"]) for r in held.results if r["op"] == "info")
        assert after == before
        assert nvml_used(slice_1gi, held.proc.pid) <= QUOTA
    finally:
        held.release()

"""Graph memory nodes on the simulated GPU, as NVIDIA's driver behaves: the address is fixed at
node creation, physical memory is taken from the device's graph pool when the graph is
launched and kept there (cuMemGetInfo and NVML's per-process used memory count it) until
cuDeviceGraphMemTrim; captured cuMemAllocAsync / cuMemFreeAsync become alloc / free nodes
(tests/c/graphmem_ops.c)."""

from __future__ import annotations

from pathlib import Path

from tests.sim.simhelp import run_python
from tests.support.shim_ops import Held, run_ops

MiB = 1 << 20
GiB = 1 << 30

NVML_PROC_USED = """
import json, pynvml as nv
nv.nvmlInit()
h = nv.nvmlDeviceGetHandleByIndex(0)
print(json.dumps({"used": {p.pid: p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(h)}}))
"""

OK, INVALID_VALUE, OUT_OF_MEMORY = "0", "1", "2"


def used(results: list[dict[str, str]]) -> list[int]:
    return [int(r["used"]) for r in results if r["op"] == "info"]


def rcs(results: list[dict[str, str]], op: str) -> list[str]:
    return [r["rc"] for r in results if r["op"] == op]


def test_alloc_node_takes_memory_at_launch_and_the_pool_keeps_it_until_trim(
    graphmem_ops: Path, sim_env: dict[str, str]
) -> None:
    res = run_ops(graphmem_ops, sim_env, "init", "info", "gnew", "gnode:100000000", "info", "inst", "info",
                  "launch", "info", "gattr", "touch", "memfree", "info", "gattr", "execdestroy",
                  "gdestroy", "info", "trim", "info", "gattr")  # fmt: skip
    assert all(r["rc"] == OK for r in res), res
    base, node, inst, launched, freed, destroyed, trimmed = used(res)
    page = 2 * MiB  # the default allocation granularity: 100 MB take 48 pages
    taken = -(-100_000_000 // page) * page
    assert (node, inst) == (base, base)  # an address only
    assert launched == base + taken
    assert freed == launched and destroyed == launched  # kept by the device's graph pool
    assert trimmed == base
    attrs = [(int(r["gused"]), int(r["greserved"])) for r in res if r["op"] == "gattr"]
    assert attrs == [(taken, taken), (0, taken), (0, 0)]


def test_nvml_counts_graph_memory_per_process(graphmem_ops: Path, sim_env: dict[str, str]) -> None:
    held = Held(
        graphmem_ops, sim_env, "init", "gnew", "gnode:" + str(64 * MiB), "inst", "launch", "info"
    )
    try:
        procs = run_python(sim_env, NVML_PROC_USED)["used"]
        assert procs == {str(held.proc.pid): used(held.results)[-1]}
        assert used(held.results)[-1] >= 64 * MiB
    finally:
        held.release()


def test_relaunch_over_an_unfreed_allocation_and_auto_free(
    graphmem_ops: Path, sim_env: dict[str, str]
) -> None:
    res = run_ops(
        graphmem_ops, sim_env, "init", "gnew", "gnode:" + str(8 * MiB), "inst", "launch", "launch"
    )
    assert rcs(res, "launch") == [OK, INVALID_VALUE]  # its allocation is still held
    res = run_ops(graphmem_ops, sim_env, "init", "gnew", "gnode:" + str(8 * MiB), "inst:1", "launch", "info",
                  "launch", "info", "gattr")  # fmt: skip
    assert rcs(res, "launch") == [OK, OK]  # CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH
    first, second = used(res)
    assert first == second  # the auto-freed pages are reused
    assert res[-1]["gused"] == str(8 * MiB)


def test_free_node_returns_pages_to_the_pool_within_the_launch(
    graphmem_ops: Path, sim_env: dict[str, str]
) -> None:
    res = run_ops(graphmem_ops, sim_env, "init", "info", "gnew", "gnode:" + str(32 * MiB), "gfreenode",
                  "gnode:" + str(32 * MiB), "gfreenode", "inst", "launch", "info", "gattr", "launch",
                  "info")  # fmt: skip
    assert all(r["rc"] == OK for r in res), res
    base, once, twice = used(res)
    assert once == base + 32 * MiB  # the second allocation reuses the first's pages
    assert twice == once
    assert res[-3]["gused"] == "0"


def test_one_instantiation_at_a_time_and_bad_free_nodes(
    graphmem_ops: Path, sim_env: dict[str, str]
) -> None:
    res = run_ops(graphmem_ops, sim_env, "init", "gnew", "gnode:4096", "gfreenode", "gfreenode", "inst", "inst",
                  "execdestroy", "inst")  # fmt: skip
    assert rcs(res, "gfreenode") == [OK, INVALID_VALUE]  # freed once per graph
    assert rcs(res, "inst") == [OK, INVALID_VALUE, OK]


def test_launch_the_device_cannot_hold_is_refused_and_runs_nothing(
    graphmem_ops: Path, sim_env: dict[str, str]
) -> None:
    res = run_ops(graphmem_ops, sim_env, "init", "info", "gnew", "gnode:" + str(60 * GiB), "gnode:" + str(30 * GiB),
                  "inst", "launch", "info", "gattr")  # fmt: skip
    assert rcs(res, "launch") == [OUT_OF_MEMORY]
    before, after = used(res)
    assert after == before
    assert res[-1]["greserved"] == "0"


def test_captured_stream_ordered_allocations_become_memory_nodes(
    graphmem_ops: Path, sim_env: dict[str, str]
) -> None:
    res = run_ops(graphmem_ops, sim_env, "init", "info", "capbegin", "capalloc:" + str(64 * MiB), "capend", "info",
                  "inst", "launch", "info", "touch", "freeasync", "info", "trim", "info")  # fmt: skip
    assert all(r["rc"] == OK for r in res), res
    base, captured, launched, freed, trimmed = used(res)
    assert captured == base  # capture takes nothing
    assert launched == base + 64 * MiB
    assert freed == launched and trimmed == base
    # allocated and freed inside the capture: the launch borrows pages, the pool keeps them
    res = run_ops(graphmem_ops, sim_env, "init", "info", "capbegin", "capalloc:" + str(64 * MiB), "capfree", "capend",
                  "inst", "launch", "info", "gattr")  # fmt: skip
    assert all(r["rc"] == OK for r in res), res
    assert used(res)[1] == used(res)[0] + 64 * MiB
    assert (res[-1]["gused"], res[-1]["greserved"]) == ("0", str(64 * MiB))


def test_a_captured_free_no_free_node_can_record_invalidates_the_capture(
    graphmem_ops: Path, sim_env: dict[str, str]
) -> None:
    res = run_ops(
        graphmem_ops,
        sim_env,
        "init",
        "gnew",
        "gnode:4096",
        "inst",
        "launch",
        "capbegin",
        "capfree",
        "capend",
    )
    assert rcs(res, "capfree") == [OK]  # a graph allocation: freed by a free node
    res = run_ops(graphmem_ops, sim_env, "init", "capbegin", "capalloc:4096", "capend", "capbegin", "capfree", "capfree",
                  "capend")  # fmt: skip
    assert rcs(res, "capfree") == [OK, INVALID_VALUE]  # the second free of one allocation
    assert rcs(res, "capend") == [OK, "901"]  # CUDA_ERROR_STREAM_CAPTURE_INVALIDATED

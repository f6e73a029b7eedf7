"""Module globals on the simulated GPU: a PTX image's module-scope .global / .const variables are
device memory allocated at load, whether the image is given as data (cuModuleLoadData), as a file
(cuModuleLoad) or to a library (cuLibraryLoadData, in the context current at load), and freed
at unload (tests/c/graphmem_ops.c)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cuda_modules import cubin, ptx
from tests.support.shim_ops import run_ops


@pytest.mark.parametrize(
    "load,unload", [("modload", "modunload"), ("modfile", "modunload"), ("libload", "libunload")]
)
def test_globals_allocated_at_load_freed_at_unload(
    graphmem_ops: Path, sim_env: dict[str, str], tmp_path: Path, load: str, unload: str
) -> None:
    mod = ptx(tmp_path / "m.ptx", 64 << 20)
    env = dict(sim_env, SIMGPU_ALLOC_GRANULARITY="512")  # exact byte counts
    ops = ["init", "info", f"{load}:{mod}", "info"]
    if load != "libload":
        ops += ["global:big", "global:table", "global:elsewhere"]
    res = run_ops(graphmem_ops, env, *ops, unload, "info")
    base, loaded, unloaded = (int(r["used"]) for r in res if r["op"] == "info")
    assert loaded - base == (64 << 20) + 512 + 4096  # big, counter (one granule), table
    assert unloaded == base
    if load != "libload":
        assert [r["bytes"] for r in res if r["op"] == "global"] == [str(64 << 20), "4096", "0"]
        # the .extern one is defined elsewhere: CUDA_ERROR_NOT_FOUND
        assert [r["rc"] for r in res if r["op"] == "global"] == ["0", "0", "500"]


def test_cubin_globals_from_its_symbol_table(
    graphmem_ops: Path, sim_env: dict[str, str], tmp_path: Path
) -> None:
    """An ELF cubin's .nv.global and .nv.constant<N> data objects, sized by its symbol table."""
    mod = cubin(tmp_path / "m.cubin", 64 << 20)
    env = dict(sim_env, SIMGPU_ALLOC_GRANULARITY="512")  # exact byte counts
    res = run_ops(graphmem_ops, env, "init", "info", f"modload:{mod}", "info", "global:big",
                  "global:table", "global:counter", "modunload", "info")  # fmt: skip
    assert all(r["rc"] == "0" for r in res), res
    base, loaded, unloaded = (int(r["used"]) for r in res if r["op"] == "info")
    assert loaded - base == (64 << 20) + 4096 + 512
    assert [r["bytes"] for r in res if r["op"] == "global"] == [str(64 << 20), "4096", "4"]
    assert unloaded == base

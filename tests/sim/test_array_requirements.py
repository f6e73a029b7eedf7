"""CUDA arrays created with CUDA_ARRAY3D_DEFERRED_MAPPING take no memory, and the driver reports
what the array needs (cuArrayGetMemoryRequirements / cuMipmappedArrayGetMemoryRequirements, CUDA
11.6): the size an ordinary array of that descriptor takes. For an ordinary array the query is
CUDA_ERROR_INVALID_VALUE, as NVIDIA documents. The shim sizes arrays this way."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.shim_ops import Held, run_ops

MiB = 1 << 20


@pytest.mark.parametrize(("shape", "levels"), [((1000, 64), 0), ((4096, 1024), 0), ((300, 512), 3)])
def test_requirements_are_what_the_array_takes(
    build_c: Callable[..., Path], sim_env: dict[str, str], shape: tuple[int, int], levels: int
) -> None:
    ops = build_c("shim_ops.c")
    w, h = shape
    res = run_ops(ops, sim_env, "init", "ctx", "info", f"deferred:{w}:{h}:{levels}", "info")
    assert [r["rc"] for r in res] == ["0"] * 5
    assert res[2]["used"] == res[4]["used"]  # the deferred array took nothing
    assert res[3]["plainrc"] == "1"  # CUDA_ERROR_INVALID_VALUE for an ordinary array
    size, alignment = int(res[3]["size"]), int(res[3]["alignment"])
    assert alignment > 0 and size % alignment == 0
    create = f"array:{w}:{h}" if levels == 0 else f"mipmap:{w}:{h}:{levels}"
    held = Held(ops, sim_env, "init", "ctx", "info", create, "info")
    try:
        before, after = int(held.results[2]["used"]), int(held.results[4]["used"])
        assert after - before == size  # what an ordinary array of the descriptor takes
    finally:
        held.release()

"""NVIDIA's CUDA runtime retains the primary context through slot 2 of a private table
(cuGetExportTable, "runtime interface" 6bd5fb6c-...), not cuDevicePrimaryCtxRetain, inside the
driver. The table is handed out unchanged (its address is part of the runtime's integrity
check); in a process that got it, the shim charges such a context at first sight, before the
process's first cuMemGetInfo or allocation on the device (shim/src/exporttab.c, context.c):
what the driver took for it, once per device whichever route retained it, given back at the last
release. Ground truth: the simulator's NVML, read without the shim (tests/c/shim_ops.c's rtctx
calls the table as the runtime does)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sharing import region
from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support.shim_memory import held_rcs, nvml_procs, slice_env
from tests.support.shim_ops import Held

MiB = 1 << 20


@pytest.mark.parametrize("knob", [None, "300Mi"])
def test_the_runtime_route_is_charged_what_the_driver_took(
    knob: str | None, shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    env, reg = slice_env(shim_env, tmp_path, "2Gi")
    if knob is not None:
        env["SIMGPU_CONTEXT_MEMORY"] = knob
    size = CONTEXT_MEMORY if knob is None else 300 * MiB
    held = Held(shim_ops, env, "init", "rtctx", "info", f"alloc:{64 * MiB}")
    try:
        assert held_rcs(held) == ["0"] * 4, held.results
        assert held.results[1]["slots"] == "13"
        info = held.results[2]
        assert (int(info["free"]), int(info["total"])) == ((2 << 30) - size, 2 << 30)
        assert region.read(reg).devices[0].used == size + 64 * MiB
        assert nvml_procs(env) == {held.proc.pid: size + 64 * MiB}
    finally:
        held.release()
    assert region.read(reg).devices[0].used == 0


def test_both_routes_share_one_charge_and_the_last_release_returns_it(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    env, reg = slice_env(shim_env, tmp_path, "2Gi")
    held = Held(shim_ops, env, "init", "rtctx", "ctx", "rtctx", "release", "release", "info")
    try:
        assert all(r["rc"] == "0" for r in held.results), held.results
        # three retains of one context, two released: it exists, charged once
        assert int(held.results[-1]["used"]) == CONTEXT_MEMORY
        assert nvml_procs(env) == {held.proc.pid: CONTEXT_MEMORY}
    finally:
        held.release()
    held = Held(shim_ops, env, "init", "rtctx", "ctx", "release", "release")
    try:
        assert held_rcs(held) == ["0"] * 5, held.results
        assert region.read(reg).devices[0].used == 0
        assert nvml_procs(env).get(held.proc.pid, 0) == 0
    finally:
        held.release()


def test_a_runtime_context_past_the_quota_is_charged_and_nothing_more_fits(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """Created out of sight, it cannot be refused: it is charged as it is, and the slice then
    refuses allocations until it is back under its quota."""
    env, reg = slice_env(shim_env, tmp_path, "400Mi")  # less than one context
    held = Held(shim_ops, env, "init", "rtctx", f"alloc:{1 * MiB}", "info")
    try:
        assert held_rcs(held) == ["0", "0", "2", "0"], held.results  # CUDA_ERROR_OUT_OF_MEMORY
        assert int(held.results[-1]["free"]) == 0
        assert region.read(reg).devices[0].used == CONTEXT_MEMORY
        assert nvml_procs(env) == {held.proc.pid: CONTEXT_MEMORY}
    finally:
        held.release()
    assert "retained out of the shim's sight" in held.stderr


def test_without_control_the_table_is_the_drivers(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    env, _ = slice_env(shim_env, tmp_path, "400Mi")
    env["CUDA_DISABLE_CONTROL"] = "true"
    held = Held(shim_ops, env, "init", "rtctx", "info")
    try:
        assert held_rcs(held) == ["0", "0", "0"], held.results  # nothing refused: passthrough
        assert nvml_procs(env) == {held.proc.pid: CONTEXT_MEMORY}
    finally:
        held.release()

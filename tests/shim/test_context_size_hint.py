"""A context size handed over (VGPU_CONTEXT_SIZE, the plugin's limits-file key; the environment
under `vgpu run`): a slice's first process charges it before creating its context, and a thread
of its own verifies it against the driver (NVML's entry of the process) while the program goes
on. The slice's other processes wait for that verification, so a wrong size is charged for one
context at most, and the driver's figure never passes the quota (shim/src/ctxmem.c)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from sharing import region
from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support.context_storm import Sampler, Storm
from tests.support.shim_memory import held_rcs, nvml_procs, slice_env
from tests.support.shim_ops import Held

MiB = 1 << 20
QUOTA = 1 << 30


@pytest.fixture
def ctx_storm(build_c: Callable[..., Path]) -> Path:
    return build_c("ctx_storm.c")


def learned(reg: Path) -> tuple[int, int]:
    from sharing._region_cffi import ffi

    with reg.open("rb") as f:
        buf = f.read()
    r = ffi.from_buffer("struct vgpu_region *", buf)
    return int(r.devices[0].context_bytes), int(r.devices[0].context_source)


def test_a_right_size_is_charged_and_verified(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """The first process charges the handed-over size and its thread verifies it; the next one
    (which waited for the verification) charges what the slice then knows."""
    from sharing._region_cffi import lib

    env, reg = slice_env(shim_env, tmp_path, "4Gi")
    env.update(SIMGPU_CONTEXT_MEMORY="300Mi", VGPU_CONTEXT_SIZE="300Mi", LIBCUDA_LOG_LEVEL="4")
    first = Held(shim_ops, env, "init", "ctx", "info")
    second = None
    try:
        assert held_rcs(first) == ["0", "0", "0"]
        assert int(first.results[-1]["used"]) == 300 * MiB
        second = Held(shim_ops, env, "init", "ctx")  # creates only once the size is verified
        assert held_rcs(second) == ["0", "0"]
        assert learned(reg) == (300 * MiB, lib.VGPU_CONTEXT_EXACT)
        assert region.read(reg).devices[0].used == 600 * MiB
        assert nvml_procs(env) == {first.proc.pid: 300 * MiB, second.proc.pid: 300 * MiB}
    finally:
        first.release()
        if second is not None:
            second.release()
    assert second is not None
    assert (
        "charged 300.0 MiB (VGPU_CONTEXT_SIZE); 300.0 MiB measured from this process's NVML entry"
        in first.stderr
    ), first.stderr
    assert "the size the slice learned (NVML not asked)" in second.stderr, second.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["mixed", "primary"])
def test_a_size_too_small_never_lets_the_slice_exceed_its_quota(
    mode: str, ctx_storm: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """A handed-over 100 MiB where contexts take 500 MiB: the first context is made up to what
    the driver took as soon as it is verified, the others wait for that and are admitted on the
    driver's size, and the device's used memory never passes the 1 GiB quota."""
    env, reg = slice_env(shim_env, tmp_path, str(QUOTA))
    env.update(SIMGPU_CONTEXT_CREATE_MS="300", VGPU_CONTEXT_SIZE="100Mi")
    sampler = Sampler(env, QUOTA)
    try:
        storm = Storm(ctx_storm, env, 4, 8, mode)
        try:
            storm.wait()
            used = region.read(reg).devices[0].used
            sampler.mark()
        finally:
            storm.release()
    finally:
        seen = sampler.stop()
    assert seen["peak"] <= QUOTA and seen["over"] == 0, seen
    assert seen["at_mark"] == used == 2 * CONTEXT_MEMORY, (seen, used, storm.codes)
    assert learned(reg)[0] == CONTEXT_MEMORY
    errs = "".join(storm.errs)
    assert "the driver took 500.0 MiB, more than VGPU_CONTEXT_SIZE (100.0 MiB)" in errs, errs


def test_a_size_is_bounded_like_a_learned_one(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """Not below VGPU_CONTEXT_RESERVE (the floor is charged, and stays: the verification settles
    on the driver's figure, never below the floor); one not below the device's memory is ignored
    (measured as without)."""
    env, reg = slice_env(shim_env, tmp_path, "4Gi")
    env.update(VGPU_CONTEXT_SIZE="100Mi", VGPU_CONTEXT_RESERVE="800Mi", LIBCUDA_LOG_LEVEL="4")
    held = Held(shim_ops, env, "init", "ctx")
    try:
        assert held_rcs(held) == ["0", "0"]
        assert region.read(reg).devices[0].used == 800 * MiB
    finally:
        held.release()
    assert "charged 800.0 MiB (VGPU_CONTEXT_SIZE); 500.0 MiB measured" in held.stderr, held.stderr
    env, reg = slice_env(shim_env, tmp_path / "big", "4Gi")
    (tmp_path / "big").mkdir()
    env.update(VGPU_CONTEXT_SIZE="100Gi", LIBCUDA_LOG_LEVEL="4")  # the H100 has 80 GiB
    held = Held(shim_ops, env, "init", "ctx")
    try:
        assert held_rcs(held) == ["0", "0"]
        assert region.read(reg).devices[0].used == CONTEXT_MEMORY
    finally:
        held.release()
    assert "500.0 MiB measured from this process's NVML entry; charged 500.0 MiB" in held.stderr


def test_a_malformed_size_fails_closed(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    env, _ = slice_env(shim_env, tmp_path, "4Gi")
    r = subprocess.run(
        [str(shim_ops), "init"], env=dict(env, VGPU_CONTEXT_SIZE_0="lots"),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert "op=init rc=0" not in r.stdout, r.stdout
    assert "VGPU_CONTEXT_SIZE_0" in r.stderr and "lots" in r.stderr, r.stderr

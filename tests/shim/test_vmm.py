"""cuMem VMM: a handle's memory lives until it is released AND its last mapping is unmapped (the
driver's rule, cuMemRelease: "freed when all outstanding mappings to the memory are unmapped"), so
its charge does too, whatever the order. Ground truth: the simulator's own usage and NVML's
per-process used memory, both read from outside the process without the shim."""

from __future__ import annotations

from pathlib import Path

from sharing import region
from tests.sim.simhelp import NO_CONTEXT_MEMORY
from tests.support.shim_memory import held_rcs, nvml_used, slice_env
from tests.support.shim_ops import Held, device_used, run_ops

pytestmark = NO_CONTEXT_MEMORY

MiB = 1 << 20


def views(shim_ops: Path, env: dict[str, str], reg: Path, held: Held) -> tuple[int, int, int]:
    """(the accounting file, the device, NVML for the held process) on device 0."""
    return (
        region.read(reg).devices[0].used,
        device_used(shim_ops, env),
        nvml_used(env, held.proc.pid),
    )


def held_views(
    shim_ops: Path, env: dict[str, str], reg: Path, *ops: str
) -> tuple[list[str], tuple[int, int, int]]:
    """Run ops in a process that holds what they left; the three views while it lives."""
    held = Held(shim_ops, env, *ops)
    try:
        return held_rcs(held), views(shim_ops, env, reg, held)
    finally:
        held.release()


def test_released_before_unmapped_stays_charged_until_the_unmap(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    env, reg = slice_env(shim_env, tmp_path, "64Mi")
    mapped_then_released = ["init", "ctx", f"create:{8 * MiB}", f"map:{8 * MiB}", "relh"]
    rcs, seen = held_views(shim_ops, env, reg, *mapped_then_released)
    assert rcs == ["0"] * 5
    assert seen == (8 * MiB, 8 * MiB, 8 * MiB)  # released, still mapped: still on the device
    rcs, seen = held_views(shim_ops, env, reg, *mapped_then_released, "free")  # the unmap
    assert rcs == ["0"] * 6
    assert seen == (0, 0, 0)
    assert region.read(reg).devices[0].used == 0


def test_one_handle_mapped_twice_is_returned_after_both_unmaps(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    env, reg = slice_env(shim_env, tmp_path, "64Mi")
    twice = ["init", "ctx", f"create:{8 * MiB}", f"map:{8 * MiB}", f"map:{8 * MiB}", "relh"]
    rcs, seen = held_views(shim_ops, env, reg, *twice)
    assert rcs == ["0"] * 6
    assert seen == (8 * MiB, 8 * MiB, 8 * MiB)  # charged once, not per mapping
    rcs, seen = held_views(shim_ops, env, reg, *twice, "free")
    assert rcs == ["0"] * 7
    assert seen == (8 * MiB, 8 * MiB, 8 * MiB)  # one mapping left holds it
    rcs, seen = held_views(shim_ops, env, reg, *twice, "free", "free")
    assert rcs == ["0"] * 8
    assert seen == (0, 0, 0)


def test_one_unmap_of_a_range_holding_two_mappings(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """cuMemUnmap takes a range: two released handles mapped side by side in one range go with
    one unmap of the whole range."""
    env, reg = slice_env(shim_env, tmp_path, "64Mi")
    rcs, seen = held_views(shim_ops, env, reg, "init", "ctx", f"twomaps:{4 * MiB}")
    assert rcs == ["0"] * 3
    assert seen == (8 * MiB, 8 * MiB, 8 * MiB)
    rcs, seen = held_views(shim_ops, env, reg, "init", "ctx", f"twomaps:{4 * MiB}", "free")
    assert rcs == ["0"] * 4
    assert seen == (0, 0, 0)


def test_a_create_map_release_loop_cannot_pass_the_quota(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """Before the shim followed mappings, each release gave the charge back while the mapping
    kept the memory: this loop took 256 MiB of the device in a 64 MiB slice."""
    env, reg = slice_env(shim_env, tmp_path, "64Mi")
    held = Held(shim_ops, env, "init", "ctx", f"leak:{8 * MiB}:32")
    try:
        leak = held.results[-1]
        assert (leak["ok"], leak["rc"]) == ("8", "2")  # 8 x 8 MiB, then CUDA_ERROR_OUT_OF_MEMORY
        assert views(shim_ops, env, reg, held) == (64 * MiB, 64 * MiB, 64 * MiB)
    finally:
        held.release()
    assert device_used(shim_ops, env) == 0  # the process's end frees it all


def test_a_retained_handle_of_a_released_mapping_is_not_returned_twice(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """cuMemRetainAllocationHandle of a mapped address gives the released handle a reference
    again; releasing it neither returns the charge while mapped nor a second time at the unmap."""
    env, reg = slice_env(shim_env, tmp_path, "64Mi")
    ops = ["init", "ctx", f"create:{8 * MiB}", f"map:{8 * MiB}", "relh", "retain", "free"]
    held = Held(shim_ops, env, *ops)
    try:
        assert held_rcs(held) == ["0"] * 7
        assert held.results[5]["same"] == "1"
        assert views(shim_ops, env, reg, held) == (8 * MiB, 8 * MiB, 8 * MiB)
    finally:
        held.release()
    # and a second handle of 8 MiB charged while the first is unmapped and gone: exactly 8 MiB
    rcs, seen = held_views(shim_ops, env, reg, *ops, "free", f"create:{8 * MiB}")
    assert rcs == ["0"] * 9
    assert seen == (8 * MiB, 8 * MiB, 8 * MiB)


def test_odd_vmm_calls_get_the_drivers_errors(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """Unmapping a range never mapped, a second release, mapping a handle that is no handle, a
    retain of an address nothing maps, freeing a range never reserved: the shim answers what the
    driver answers, never crashes, and charges nothing for them."""
    env, reg = slice_env(shim_env, tmp_path, "64Mi")
    with_shim = run_ops(shim_ops, env, "init", "ctx", "vmmodd", "info")
    plain = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    without = run_ops(shim_ops, plain, "init", "ctx", "vmmodd")
    assert with_shim[2]["rc"] == without[2]["rc"] == "0", (with_shim, without)
    keys = ["unmap", "unmapnull", "map0", "retain0", "afree", "release1", "release2"]
    assert {k: with_shim[2][k] for k in keys} == {k: without[2][k] for k in keys}
    assert with_shim[2]["release1"] == "0"
    assert all(with_shim[2][k] != "0" for k in keys if k != "release1"), with_shim[2]
    assert region.read(reg).devices[0].used == 0
    assert int(with_shim[3]["used"]) == 0

"""cuMem VMM: a handle's memory lives until it is released AND its last mapping is unmapped (the
driver's rule, cuMemRelease: "freed when all outstanding mappings to the memory are unmapped"), so
its charge does too, whatever the order. Ground truth: the simulator's own usage and NVML's
per-process used memory, both read from outside the process without the shim."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sharing import region
from tests.sim.simhelp import NO_CONTEXT_MEMORY
from tests.support.shim_memory import held_rcs, nvml_procs, nvml_used, slice_env
from tests.support.shim_ops import Held, Stepped, device_used, run_ops

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


# ---- shareable handles across processes: A creates and exports, B imports (fd over a unix socket)


@pytest.fixture
def sock() -> Iterator[str]:
    """A unix socket path short enough for sun_path (a test's tmp_path may not be)."""
    with tempfile.TemporaryDirectory(prefix="vmm") as d:
        yield f"{d}/s"


def rcs(results: list[dict[str, str]]) -> list[str]:
    """The return codes of a stretch's ops (not of the "step" it resumed from)."""
    return [r["rc"] for r in results if r["op"] != "step"]


def creator(shim_ops: Path, env: dict[str, str], sock: str) -> Stepped:
    """A: creates a shareable 8 MiB handle, maps it, sends it; then releases it and unmaps."""
    return Stepped(
        shim_ops, env, "init", "ctx", f"screate:{8 * MiB}", f"map:{8 * MiB}", f"sendh:{sock}",
        "step", "relh", "free",
    )  # fmt: skip


def importer(shim_ops: Path, env: dict[str, str], sock: str) -> Stepped:
    """B: imports it and maps it; then unmaps it, then releases its handle."""
    return Stepped(
        shim_ops, env, "init", "ctx", f"recvh:{sock}", f"map:{8 * MiB}",
        "step", "free", "step", "relh",
    )  # fmt: skip


def sim_views(shim_ops: Path, env: dict[str, str], a: Stepped, b: Stepped) -> tuple[int, int, int]:
    """(the device's used, NVML's used for A, for B), read without the shim."""
    procs = nvml_procs(env)
    return device_used(shim_ops, env), procs.get(a.proc.pid, 0), procs.get(b.proc.pid, 0)


def test_the_simulator_frees_a_shared_allocation_with_its_last_holder(
    shim_ops: Path, sim_env: dict[str, str], sock: str
) -> None:
    """The simulator as the driver: the physical allocation stays on the device while any process
    holds a handle to it or maps it. NVML shows it once, in one holder's line: the creator's
    while it holds it, then the importer's."""
    a, b = creator(shim_ops, sim_env, sock), importer(shim_ops, sim_env, sock)
    try:
        assert rcs(a.next()) == ["0"] * 5 and rcs(b.next()) == ["0"] * 4
        assert sim_views(shim_ops, sim_env, a, b) == (8 * MiB, 8 * MiB, 0)
        assert rcs(a.next()) == ["0"] * 2  # A released and unmapped: B still maps it
        assert sim_views(shim_ops, sim_env, a, b) == (8 * MiB, 0, 8 * MiB)
        assert rcs(b.next()) == ["0"]  # B unmapped: its handle still holds it
        assert sim_views(shim_ops, sim_env, a, b) == (8 * MiB, 0, 8 * MiB)
        assert rcs(b.next()) == ["0"]  # B released: the last holder is gone
        assert sim_views(shim_ops, sim_env, a, b) == (0, 0, 0)
    finally:
        a.end()
        b.end()


def test_a_shared_allocation_outlives_its_killed_creator_and_goes_with_the_importer(
    shim_ops: Path, sim_env: dict[str, str], sock: str
) -> None:
    a, b = creator(shim_ops, sim_env, sock), importer(shim_ops, sim_env, sock)
    try:
        assert rcs(a.next()) == ["0"] * 5 and rcs(b.next()) == ["0"] * 4
    finally:
        a.kill()  # the creator dies holding its handle and mapping
    try:
        assert sim_views(shim_ops, sim_env, a, b) == (8 * MiB, 0, 8 * MiB)
    finally:
        b.kill()
    assert device_used(shim_ops, sim_env) == 0


def test_an_importers_mappings_are_charged_to_its_slice(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path, sock: str
) -> None:
    """Both in one 64 MiB slice: the importer's mapping is charged to it, the exporter keeps its own
    charge while it holds the handle (the shim sees no other process's handles: twice, the safe
    side), and the importer's stays while it holds its handle, mapped or not."""
    env, reg = slice_env(shim_env, tmp_path, "64Mi")
    a, b = creator(shim_ops, env, sock), importer(shim_ops, env, sock)

    def seen() -> tuple[int, tuple[int, int, int]]:
        return region.read(reg).devices[0].used, sim_views(shim_ops, env, a, b)

    try:
        assert rcs(a.next()) == ["0"] * 5 and rcs(b.next()) == ["0"] * 4
        assert seen() == (16 * MiB, (8 * MiB, 8 * MiB, 0))
        assert rcs(a.next()) == ["0"] * 2
        assert seen() == (8 * MiB, (8 * MiB, 0, 8 * MiB))
        assert rcs(b.next()) == ["0"]
        assert seen() == (8 * MiB, (8 * MiB, 0, 8 * MiB))
        assert rcs(b.next()) == ["0"]
        assert seen() == (0, (0, 0, 0))
    finally:
        a.end()
        b.end()
    assert region.read(reg).devices[0].used == 0


def test_a_create_export_import_release_loop_stops_at_the_quota(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path, sock: str
) -> None:
    """A creates 8 MiB, B (same slice) imports and maps it, A releases and unmaps, 32 times. Before
    the shim charged an importer's mappings, A's release gave the charge back while B held the
    memory: the loop took 256 MiB of the device in a 64 MiB slice (ok=32, region 0). Now the
    8th import's map is refused: 7 x 8 MiB held by B, all of it charged."""
    env, reg = slice_env(shim_env, tmp_path, "64Mi")
    b = Stepped(shim_ops, env, "init", "ctx", f"take:{8 * MiB}:{sock}")
    try:
        a = run_ops(shim_ops, env, "init", "ctx", f"share:{8 * MiB}:32:{sock}")
        took = b.next()[-1]
        assert (a[-1]["ok"], a[-1]["rc"]) == ("7", "2"), a  # then B's CUDA_ERROR_OUT_OF_MEMORY
        assert (took["ok"], took["rc"]) == ("7", "2"), took
        assert region.read(reg).devices[0].used == 56 * MiB
        assert device_used(shim_ops, env) == 56 * MiB
        assert nvml_used(env, b.proc.pid) == 56 * MiB
    finally:
        b.end()
    assert device_used(shim_ops, env) == 0
    assert region.read(reg).devices[0].used == 0

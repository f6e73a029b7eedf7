"""A context's own device memory is charged to the slice from what the driver reports when the
context is created (shim/src/context.c, ctxmem.c), never from a constant: the simulator's contexts
take 500 MiB by default (SIMGPU_CONTEXT_MEMORY), and NVML's per-process used memory, the ground
truth, never exceeds the quota summed over a slice's processes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from sharing import region
from sharing.paths import sim_lib_dir
from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support.shim_memory import held_rcs, nvml_procs, slice_env
from tests.support.shim_ops import Held

MiB = 1 << 20


def start_at_once(
    shim_ops: Path, env: dict[str, str], n: int, *ops: str
) -> list[subprocess.Popen[str]]:
    """n shim_ops processes running ops, then holding what they made until their stdin closes."""
    return [
        subprocess.Popen(
            [str(shim_ops), *ops, "ready", "freeall"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("knob", [None, "300Mi", "64Mi"])
def test_charged_what_the_driver_took(
    knob: str | None, shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """Whatever a context takes on this driver is what the slice is charged, without any
    VGPU_CONTEXT_RESERVE; cuMemGetInfo under the shim shows it as used."""
    env, reg = slice_env(shim_env, tmp_path, "2Gi")
    if knob is not None:
        env["SIMGPU_CONTEXT_MEMORY"] = knob
    size = {None: CONTEXT_MEMORY, "300Mi": 300 * MiB, "64Mi": 64 * MiB}[knob]
    held = Held(shim_ops, env, "init", "ctx", "info")
    try:
        assert held_rcs(held) == ["0", "0", "0"]
        assert int(held.results[-1]["used"]) == size
        assert region.read(reg).devices[0].used == size
        assert nvml_procs(env) == {held.proc.pid: size}
    finally:
        held.release()


def test_each_context_charged_while_it_exists(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """Primary (first retain to last release, or reset) and created contexts (to destroy)."""
    env, reg = slice_env(shim_env, tmp_path, "4Gi")
    c = CONTEXT_MEMORY
    ops = [
        "init",
        "ctx",
        "ctxcreate",
        "ctxcreate",
        "info",
        "free",
        "info",
        "ctx",
        "release",
        "info",
    ]
    held = Held(shim_ops, env, *ops)
    try:
        assert all(r["rc"] == "0" for r in held.results), held.results
        used = [int(r["used"]) for r in held.results if r["op"] == "info"]
        # 3 contexts; one destroyed; the primary retained twice and released once
        assert used == [3 * c, 2 * c, 2 * c], used
        assert region.read(reg).devices[0].used == 2 * c
        assert nvml_procs(env) == {held.proc.pid: 2 * c}
    finally:
        held.release()
    assert region.read(reg).devices[0].used == 0
    for ops in (
        ["ctx", "ctx", "release", "release"],
        ["ctx", "ctx", "reset"],
        ["ctx", "ctxcreate", "reset"],
    ):
        held = Held(shim_ops, env, "init", *ops)
        try:
            assert all(r["rc"] == "0" for r in held.results), (ops, held.results)
            left = c if "ctxcreate" in ops else 0  # the primary is inactive again
            assert region.read(reg).devices[0].used == left, ops
            assert nvml_procs(env).get(held.proc.pid, 0) == left, ops
        finally:
            held.release()


def test_a_context_over_the_quota_is_out_of_memory_and_leaves_nothing(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    env, reg = slice_env(shim_env, tmp_path, "800Mi")
    held = Held(shim_ops, env, "init", "ctx", "ctxcreate", f"alloc:{200 * MiB}", "ctxcreate")
    try:
        # the second context does not fit (500 + 500 > 800), nor after 200 MiB a third
        assert held_rcs(held) == ["0", "0", "2", "0", "2"], held.results
        assert region.read(reg).devices[0].used == CONTEXT_MEMORY + 200 * MiB
        # the refused contexts were destroyed: the driver holds no more than the slice is charged
        assert nvml_procs(env) == {held.proc.pid: CONTEXT_MEMORY + 200 * MiB}
    finally:
        held.release()
    assert "vgpu: device 0: 500.0 MiB denied, slice uses 500.0 MiB of 800.0 MiB" in held.stderr
    # a primary context that does not fit is released again
    env, reg = slice_env(shim_env, tmp_path / "small", "400Mi")
    (tmp_path / "small").mkdir()
    held = Held(shim_ops, env, "init", "ctx")
    try:
        assert held_rcs(held) == ["0", "2"]
        assert region.read(reg).devices[0].used == 0
        assert nvml_procs(env).get(held.proc.pid, 0) == 0
    finally:
        held.release()


def test_n_processes_never_exceed_the_quota_by_their_contexts(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """Six processes of a 2 GiB slice each create a primary and an explicit context at once:
    NVML's per-process used memory, summed over them, stays within the quota."""
    env, reg = slice_env(shim_env, tmp_path, "2Gi")
    procs = start_at_once(shim_ops, env, 6, "init", "ctx", "ctxcreate")
    try:
        ok = 0
        for p in procs:
            assert p.stdout is not None
            for line in p.stdout:
                if line.strip() == "ready":
                    break
                if line.startswith("op=ctx") and " rc=0" in line:
                    ok += 1
        used = nvml_procs(env)
        mine = sum(used.get(p.pid, 0) for p in procs)
        assert mine <= 2 << 30, used
        assert ok == 4 and mine == 4 * CONTEXT_MEMORY  # 2 GiB holds four 500 MiB contexts
        assert region.read(reg).devices[0].used == mine
    finally:
        for p in procs:
            p.communicate(timeout=60)
    assert region.read(reg).devices[0].used == 0


def test_context_reserve_is_a_floor(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """VGPU_CONTEXT_RESERVE (the admin's): a context is charged at least that much, and what the
    driver took where that is more."""
    for reserve, charged in (("800Mi", 800 * MiB), ("100Mi", CONTEXT_MEMORY)):
        env, reg = slice_env(shim_env, tmp_path, "4Gi")
        held = Held(shim_ops, dict(env, VGPU_CONTEXT_RESERVE=reserve), "init", "ctx", "ctxcreate")
        try:
            assert held_rcs(held) == ["0", "0", "0"]
            assert region.read(reg).devices[0].used == 2 * charged
        finally:
            held.release()


def test_a_dead_process_context_comes_back(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    env, reg = slice_env(shim_env, tmp_path, "1Gi")
    victim = Held(shim_ops, env, "init", "ctx")
    assert region.read(reg).devices[0].used == CONTEXT_MEMORY
    victim.kill()
    # the dead process's context is returned to the quota: two contexts fit again
    held = Held(shim_ops, env, "init", "ctx", "ctxcreate")
    try:
        assert held_rcs(held) == ["0", "0", "0"], held.results
        assert region.read(reg).devices[0].used == 2 * CONTEXT_MEMORY
    finally:
        held.release()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for a PID namespace")
def test_measured_in_a_pid_namespace(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """In a container NVML lists host PIDs, not getpid(): the shim finds its own entry as the
    one that appeared with its first context; the second context is charged what the slice
    learned from that exact measurement, without asking NVML again."""
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a PID namespace here: {probe.stderr.decode().strip()}")
    env, _ = slice_env(shim_env, tmp_path, "4Gi")
    env["LIBCUDA_LOG_LEVEL"] = "4"
    r = subprocess.run(
        ["unshare", "--pid", "--fork", str(shim_ops), "init", "ctx", "ctxcreate", "info"],
        env=dict(env, SIMGPU_CONTEXT_MEMORY="300Mi"), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "used=629145600" in r.stdout  # two 300 MiB contexts
    lines = [x for x in r.stderr.splitlines() if "vgpu: context on device 0" in x]
    assert len(lines) == 2, r.stderr
    assert "300.0 MiB measured from this process's NVML entry" in lines[0], r.stderr
    assert "charged 300.0 MiB, the size the slice learned (NVML not asked)" in lines[1], r.stderr


def test_without_nvml_the_floor_is_charged(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """A driver whose NVML cannot be loaded: nothing is measured, the context is charged
    VGPU_CONTEXT_RESERVE (one info line saying so)."""
    only_cuda = tmp_path / "lib"
    only_cuda.mkdir()
    shutil.copy(sim_lib_dir() / "libcuda.so.1", only_cuda / "libcuda.so.1")
    env, reg = slice_env(shim_env, tmp_path, "4Gi")
    env.update(LD_LIBRARY_PATH=str(only_cuda), VGPU_CONTEXT_RESERVE="300Mi", LIBCUDA_LOG_LEVEL="3")
    held = Held(shim_ops, env, "init", "ctx")
    try:
        assert held_rcs(held) == ["0", "0"]
        assert region.read(reg).devices[0].used == 300 * MiB
    finally:
        held.release()
    assert (
        "could not be measured" in held.stderr and "VGPU_CONTEXT_RESERVE (300.0 MiB)" in held.stderr
    )


def nvml_mapped(pid: int) -> bool:
    """Whether libnvidia-ml is loaded into the process."""
    return "libnvidia-ml" in Path(f"/proc/{pid}/maps").read_text()


def set_learned(reg: Path, *, size: int | None = None, source: int | None = None,
                measurer: int | None = None) -> None:  # fmt: skip
    """Write device 0's learned context size fields as a tenant could (region.h)."""
    from sharing._region_cffi import ffi, lib

    base = ffi.offsetof("struct vgpu_region", "devices")
    with reg.open("r+b") as f:
        for field, value, width in (
            ("context_bytes", size, 8),
            ("context_source", source, 4),
            ("context_measurer", measurer, 4),
        ):
            if value is not None:
                f.seek(base + ffi.offsetof("struct vgpu_device_account", field))
                f.write(value.to_bytes(width, "little"))
    assert lib.VGPU_CONTEXT_EXACT == 2


def test_a_later_process_charges_the_learned_size_without_nvml(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """The slice's first process measures its context (loading NVML) and publishes the size; the
    next one charges that size for its context and never loads NVML."""
    env, reg = slice_env(shim_env, tmp_path, "4Gi")
    env.update(SIMGPU_CONTEXT_MEMORY="300Mi", LIBCUDA_LOG_LEVEL="4")
    first = Held(shim_ops, env, "init", "ctx")
    second = None
    try:
        assert held_rcs(first) == ["0", "0"]
        assert nvml_mapped(first.proc.pid)  # it measured: the check below can fail
        assert region.read(reg).devices[0].context_bytes == 300 * MiB
        second = Held(shim_ops, env, "init", "ctx", "ctxcreate", "info")
        assert held_rcs(second) == ["0", "0", "0", "0"]
        assert not nvml_mapped(second.proc.pid)
        assert region.read(reg).devices[0].used == 3 * 300 * MiB
        # the charge is what the driver took (NVML's ground truth, read from outside)
        assert nvml_procs(env) == {first.proc.pid: 300 * MiB, second.proc.pid: 600 * MiB}
    finally:
        first.release()
        if second is not None:
            second.release()
    assert second is not None
    assert "measured from this process's NVML entry" in first.stderr
    assert "measured from" not in second.stderr
    assert second.stderr.count("the size the slice learned (NVML not asked)") == 2


def test_many_at_once_in_a_fresh_slice_one_measures_and_the_quota_holds(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """Sixteen processes start at once in a slice whose file does not exist yet: one measures a
    context (the others wait for its publication; a 2 s timeout under extreme load may let one
    more measure), and NVML's per-process used memory, summed, stays within the quota."""
    env, reg = slice_env(shim_env, tmp_path, "4Gi")
    env["LIBCUDA_LOG_LEVEL"] = "4"
    procs = start_at_once(shim_ops, env, 16, "init", "ctx")
    errs = []
    created = []
    try:
        for p in procs:
            assert p.stdout is not None
            for line in p.stdout:
                if line.strip() == "ready":
                    break
                if line.startswith("op=ctx "):
                    created.append(" rc=0" in line)
        ok = sum(created)
        used = nvml_procs(env)
        mine = sum(used.get(p.pid, 0) for p in procs)
        assert ok == 8 and mine == 8 * CONTEXT_MEMORY <= 4 << 30, used  # 4 GiB: eight contexts
        assert region.read(reg).devices[0].used == mine
    finally:
        for p in procs:
            errs.append(p.communicate(timeout=60)[1])
    measured = sum("measured from" in e for e in errs)
    assert 1 <= measured <= 2, errs
    for made, e in zip(created, errs, strict=True):
        # a context made was charged the learned size, unless this process measured it; one
        # refused was refused on the learned size (or, the measurer, on its measurement)
        assert made == (
            "the size the slice learned" in e or ("measured from" in e and "denied" not in e)
        ), e
        assert made != ("denied" in e), e
    assert region.read(reg).devices[0].context_bytes == CONTEXT_MEMORY


def test_a_tampered_learned_size_is_bounded(
    shim_ops: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """The accounting file is the tenant's: a learned size lowered below VGPU_CONTEXT_RESERVE is
    charged the floor; one at or above the device's memory is measured again (and replaced); a
    claim of a measurer that is not alive does not make anyone wait."""
    from sharing._region_cffi import lib

    env, reg = slice_env(shim_env, tmp_path, "8Gi")
    env.update(LIBCUDA_LOG_LEVEL="4", VGPU_CONTEXT_RESERVE="100Mi")
    region.create(reg)
    set_learned(reg, size=1 * MiB, source=lib.VGPU_CONTEXT_EXACT)
    held = Held(shim_ops, env, "init", "ctx")
    try:
        assert held_rcs(held) == ["0", "0"]
        assert region.read(reg).devices[0].used == 100 * MiB
        assert not nvml_mapped(held.proc.pid)
    finally:
        held.release()
    # at least the device's memory (80 GiB here: the simulated H100): not credible, measured again
    for measurer in (0, 3, 0xFFFFFFFF):  # no one; slot 2, whose process is not alive; garbage
        set_learned(reg, size=1 << 50, source=lib.VGPU_CONTEXT_EXACT, measurer=measurer)
        held = Held(shim_ops, env, "init", "ctx")
        try:
            assert held_rcs(held) == ["0", "0"]
            assert region.read(reg).devices[0].used == CONTEXT_MEMORY
        finally:
            held.release()
        assert "measured from this process's NVML entry" in held.stderr
        assert "measuring here" not in held.stderr  # nobody waited for a dead claim
        assert region.read(reg).devices[0].context_bytes == CONTEXT_MEMORY

"""Routes around the hooks, tried as a hostile library would: a library loaded after the
shim looks the driver's functions up by every dlsym handle it can think of (RTLD_NEXT behind the
shim above all), or opens the driver in a new link-map namespace. Each must get the shim's hooks
(an allocation past the quota is refused, the slice is what it reports) or be refused."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from sharing.paths import shim_library, sim_lib_dir
from tests.support.bypass_routes import OVER, QUOTA, bypass_main, hostile, quota_env, run
from tests.support.cbuild import C_PROGRAMS, CFLAGS
from tests.support.hooks_table import hooked_cuda_symbols

__all__ = ["bypass_main", "hostile"]  # fixtures used by name

HANDLE_ROUTES = [
    "next",
    "default",
    "global",
    "self",
    "cuda:lazy+local",
    "cuda:now+global",
    "cuda:lazy+nodelete",
    "cuda:now+noload",
    "cuda:lazy+deepbind",
    "dlmopen_base",
    "dlmopen_new",
]
NVML_HOOKS = ["nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2"]


def test_without_the_shim_every_route_allocates_past_the_quota(
    bypass_main: Path, hostile: Path, sim_env: dict[str, str]
) -> None:
    """The attack's baseline: without the shim each route really allocates twice the quota, so a
    refusal below is the shim's doing."""
    res, out = run(
        bypass_main, str(hostile), sim_env, *[f"alloc:{OVER}:{r}" for r in HANDLE_ROUTES]
    )
    assert [r["rc"] for r in res] == ["0"] * len(HANDLE_ROUTES), out


@pytest.mark.parametrize("loading", ["dlopen", "preload-after-the-shim"])
def test_rtld_next_behind_the_shim_gets_the_hooks(
    loading: str, bypass_main: Path, hostile: Path, shim_env: dict[str, str]
) -> None:
    """The reported attack: dlsym(RTLD_NEXT, "cuMemAlloc_v2") from a library loaded after the
    shim returned the driver's function (2 GiB allocated under a 1 GiB quota while
    cuMemGetInfo reported 1 GiB). Every hooked name now answers with the hook."""
    env = quota_env(shim_env)
    lib = str(hostile)
    if loading != "dlopen":
        env["LD_PRELOAD"] = f"{shim_library()}:{hostile}"
        lib = "preloaded"
    hooked = sorted(hooked_cuda_symbols()) + NVML_HOOKS
    res, out = run(
        bypass_main, lib, env, f"alloc:{OVER}:next", "info:next", "nvml:next",
        *[f"hook:next:{name}" for name in hooked],
    )  # fmt: skip
    assert res[0]["rc"] == "2", out  # CUDA_ERROR_OUT_OF_MEMORY
    assert (res[1]["rc"], res[1]["total"]) == ("0", str(QUOTA)), out
    assert (res[2]["rc"], res[2]["total"]) == ("0", str(QUOTA)), out
    unhooked = [r["name"] for r in res[3:] if (r["found"], r["shim"]) != ("1", "1")]
    assert unhooked == [], out
    assert "2.00 GiB denied" in out


@pytest.mark.parametrize("route", HANDLE_ROUTES)
def test_every_handle_answers_with_the_hooks(
    route: str, bypass_main: Path, hostile: Path, shim_env: dict[str, str]
) -> None:
    """RTLD_DEFAULT, the global handle, a handle of a library that needs the driver, the driver
    opened with any flags, dlmopen into the base or a new namespace: the hook, enforced."""
    res, out = run(
        bypass_main, str(hostile), quota_env(shim_env), f"alloc:{OVER}:{route}",
        f"hook:{route}:cuMemAlloc_v2", f"hook:{route}:nvmlDeviceGetMemoryInfo_v2",
    )  # fmt: skip
    assert res[0]["rc"] == "2", out
    assert [(r["found"], r["shim"]) for r in res[1:]] == [("1", "1")] * 2, out


def test_rtld_next_before_the_shim_is_answered_exactly(
    bypass_main: Path, hostile: Path, shim_env: dict[str, str]
) -> None:
    """A library preloaded before the shim (an interposer chaining to the next definition) gets
    exactly what the C library answers: the shim's hook for hooked names, the driver's own
    function for the others."""
    env = dict(quota_env(shim_env), LD_PRELOAD=f"{hostile}:{shim_library()}")
    res, out = run(
        bypass_main, "preloaded", env, f"alloc:{OVER}:next", "hook:next:cuMemAlloc_v2",
        "hook:next:cuDeviceGet", "hook:next:cuCtxSetCurrent",
    )  # fmt: skip
    assert res[0]["rc"] == "2", out
    assert [(r["found"], r["shim"]) for r in res[1:]] == [("1", "1")] * 3, out


def test_control_off_hands_out_the_driver(
    bypass_main: Path, hostile: Path, shim_env: dict[str, str]
) -> None:
    """CUDA_DISABLE_CONTROL=true is pure passthrough on this route too."""
    env = dict(quota_env(shim_env), CUDA_DISABLE_CONTROL="1")
    res, out = run(bypass_main, str(hostile), env, f"alloc:{OVER}:next", "hook:next:cuMemAlloc_v2")
    assert res[0]["rc"] == "0", out
    assert (res[1]["found"], res[1]["shim"]) == ("1", "0"), out


def test_dlmopen_of_a_driver_copy_gets_the_process_driver(
    bypass_main: Path, hostile: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """dlmopen(LM_ID_NEWLM) of the driver by another path (a copy of libcuda.so.1) loads no second
    driver: the handle is the process's driver, whose functions are the hooks."""
    copy = tmp_path / "copy" / "libcuda.so.1"
    copy.parent.mkdir()
    shutil.copy(sim_lib_dir() / "libcuda.so.1", copy)
    route = f"dlmopen_dep:{copy}"
    res, out = run(
        bypass_main, str(hostile), quota_env(shim_env), f"alloc:{OVER}:{route}",
        f"hook:{route}:cuMemAlloc_v2",
    )  # fmt: skip
    assert res[0]["rc"] == "2", out
    assert (res[1]["found"], res[1]["shim"]) == ("1", "1"), out


def test_dlmopen_of_another_library_into_a_new_namespace_is_refused(
    bypass_main: Path, hostile: Path, shim_env: dict[str, str], sim_env: dict[str, str]
) -> None:
    """A library dlmopen'ed into a new namespace brings its own driver copy there (as a
    dependency, or later through its own dlopen), out of the shim's reach: refused, with the
    reason in dlerror() and one log line. Without the shim the same call loads and allocates."""
    route = f"dlmopen_dep:{hostile}"
    res, out = run(bypass_main, str(hostile), sim_env, f"alloc:{OVER}:{route}")
    assert res[0]["rc"] == "0", out
    res, out = run(
        bypass_main, str(hostile), quota_env(shim_env), f"alloc:{OVER}:{route}",
        f"hook:{route}:cuMemAlloc_v2",
    )  # fmt: skip
    assert res[0]["rc"] == "-1" and res[1]["found"] == "0", out
    assert "handle=NULL" in out and "into a new namespace refused (GPU quota)" in out, out
    assert f"vgpu: dlmopen({hostile}) into a new link-map namespace refused" in out, out


def test_dlmopen_passes_through_with_control_off(
    bypass_main: Path, hostile: Path, shim_env: dict[str, str]
) -> None:
    env = dict(quota_env(shim_env), CUDA_DISABLE_CONTROL="1")
    route = f"dlmopen_dep:{hostile}"
    res, out = run(bypass_main, str(hostile), env, f"alloc:{OVER}:{route}")
    assert res[0]["rc"] == "0", out
    assert "refused" not in out


@pytest.mark.parametrize("version", ["libcuda.so.1", "GLIBC_2.2.5", "CUDA_12"])
def test_dlvsym_finds_no_unversioned_driver_function(
    version: str, bypass_main: Path, hostile: Path, shim_env: dict[str, str]
) -> None:
    """The driver's entry points carry no symbol version, and the C library's dlvsym does not
    return such a symbol for any version asked: not a route to the driver (docs/shim.md, threat
    model). The shim's dlvsym leaves that answer alone; a driver with versioned symbols is
    answered with the hooks (test_dlvsym.py)."""
    res, out = run(bypass_main, str(hostile), quota_env(shim_env), f"alloc:{OVER}:vsym:{version}")
    assert res[0]["rc"] == "-1", out


def test_a_driver_constructor_looking_up_its_names_does_not_deadlock(
    shim_env: dict[str, str], tmp_path: Path
) -> None:
    """The shim loads the driver inside its one-time resolution; a driver whose constructor
    looks its own names up (RTLD_NEXT, RTLD_DEFAULT) reaches the shim's dlsym from inside that
    resolution, on the same thread: answered at once (hung forever on 5375d13)."""
    src = C_PROGRAMS / "driver_ctor_lookup.c"
    drv = tmp_path / "libcuda.so.1"
    main = tmp_path / "main"
    base = ["gcc", *CFLAGS, "-o"]
    subprocess.run(
        [*base, str(drv), "-fPIC", "-shared", "-Wl,-soname,libcuda.so.1", str(src), "-ldl"],
        check=True,
    )
    subprocess.run([*base, str(main), "-DMAIN", str(src), "-ldl"], check=True)
    env = dict(quota_env(shim_env), LD_LIBRARY_PATH=str(tmp_path))
    r = subprocess.run(
        [str(main)], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    # nothing follows the driver for RTLD_NEXT; RTLD_DEFAULT finds the shim's wrapper
    assert (r.returncode, r.stdout.strip()) == (0, "rc=0 next=0 default=1"), r.stdout + r.stderr

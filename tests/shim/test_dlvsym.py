"""dlvsym routes to the hooks as dlsym does. NVIDIA's driver carries no symbol versions (the C
library's dlvsym answers NULL for its entry points: test_bypass.py), so these tests load a
simulated driver whose every symbol has a version, the case where dlvsym would hand out the
driver's own functions: on the driver's handle, RTLD_DEFAULT and RTLD_NEXT, from a library
loaded after the shim or preloaded before it, the answer is the hook and the quota holds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from sharing.paths import shim_library
from shim.build import build_with_gcc
from tests.support.bypass_routes import OVER, bypass_main, hostile, quota_env, run

pytestmark = pytest.mark.slow

__all__ = ["bypass_main", "hostile"]  # fixtures used by name

VERSION = "SIMCUDA_TEST"
ROUTES = [f"{r}:{VERSION}" for r in ("vsym", "vdefault", "vnext")]


@pytest.fixture(scope="module")
def versioned_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of a simulated libcuda.so.1 whose every symbol is at version SIMCUDA_TEST."""
    work = tmp_path_factory.mktemp("versioned-driver")
    script = work / "versions.map"
    script.write_text(f"{VERSION} {{ global: *; }};\n")
    built = build_with_gcc(
        work, only=["libcuda.so.1"], extra_ldflags=[f"-Wl,--version-script={script}"]
    )
    return built["libcuda.so.1"].parent


@dataclass(frozen=True)
class Programs:
    main: Path  # tests/c/bypass_main.c
    hostile: Path  # tests/c/bypass_lib.c, which tries the routes
    driver_dir: Path  # the versioned driver

    def env(self, env: dict[str, str]) -> dict[str, str]:
        return dict(env, LD_LIBRARY_PATH=f"{self.driver_dir}:{env['LD_LIBRARY_PATH']}")


@pytest.fixture
def progs(bypass_main: Path, hostile: Path, versioned_driver: Path) -> Programs:
    return Programs(bypass_main, hostile, versioned_driver)


def test_without_the_shim_dlvsym_reaches_the_versioned_driver(
    progs: Programs, sim_env: dict[str, str]
) -> None:
    """The baseline: each dlvsym route really allocates twice the quota without the shim, so
    the refusals below are the shim's doing (and the driver's symbols are versioned)."""
    env = progs.env(sim_env)
    res, out = run(progs.main, str(progs.hostile), env, *[f"alloc:{OVER}:{r}" for r in ROUTES])
    assert [r["rc"] for r in res] == ["0"] * len(ROUTES), out


@pytest.mark.parametrize("loading", ["dlopen", "preload-after-the-shim", "preload-before-the-shim"])
def test_dlvsym_answers_with_the_hooks(
    loading: str, progs: Programs, shim_env: dict[str, str]
) -> None:
    env = progs.env(quota_env(shim_env))
    lib = str(progs.hostile)
    if loading == "preload-after-the-shim":
        env["LD_PRELOAD"] = f"{shim_library()}:{progs.hostile}"
        lib = "preloaded"
    elif loading == "preload-before-the-shim":
        env["LD_PRELOAD"] = f"{progs.hostile}:{shim_library()}"
        lib = "preloaded"
    ops = []
    for r in ROUTES:
        ops += [f"alloc:{OVER}:{r}", f"hook:{r}:cuMemAlloc_v2", f"hook:{r}:cuDeviceGet"]
    res, out = run(progs.main, lib, env, *ops)
    for i, route in enumerate(ROUTES):
        alloc, hooked, unhooked = res[3 * i : 3 * i + 3]
        assert alloc["rc"] == "2", f"{route}: {out}"  # CUDA_ERROR_OUT_OF_MEMORY
        assert (hooked["found"], hooked["shim"]) == ("1", "1"), f"{route}: {out}"
        # a name the shim does not hook: the driver's own, the function the program binds
        assert (unhooked["found"], unhooked["shim"]) == ("1", "1"), f"{route}: {out}"
    assert f"{OVER / (1 << 30):.2f} GiB denied" in out


def test_dlvsym_passes_through_with_control_off(progs: Programs, shim_env: dict[str, str]) -> None:
    env = progs.env(dict(quota_env(shim_env), CUDA_DISABLE_CONTROL="1"))
    route = ROUTES[0]
    res, out = run(
        progs.main, str(progs.hostile), env, f"alloc:{OVER}:{route}", f"hook:{route}:cuMemAlloc_v2"
    )
    assert res[0]["rc"] == "0", out
    assert (res[1]["found"], res[1]["shim"]) == ("1", "0"), out

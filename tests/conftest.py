"""Shared fixtures. Helpers append fixtures here; keep each small and documented."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sharing.paths import shim_library, sim_lib_dir
from shim.build import SANITIZER_FLAGS, build_with_gcc
from tests.support.cbuild import compile_program
from tests.support.host_nvml import HostNvml


@pytest.fixture(autouse=True)
def _private_user_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`vgpu run` keeps a per-user cache (sharing/cli/context_cache.py): each test gets its own, so
    that no test teaches another (nor the machine's user) a context size."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))


@pytest.fixture(scope="session")
def cbin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where compiled C test programs are cached for the session."""
    return tmp_path_factory.mktemp("cbin")


@pytest.fixture(scope="session")
def asan_libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The shim and the simulator built with ASan and UBSan, once per run (a build is minutes
    of CPU): the shim's, the simulator's and the compute gate's sanitizer tests share it.
    {file name: path}; the simulator's are in the `sim` directory beside the shim."""
    return build_with_gcc(tmp_path_factory.mktemp("asan") / "lib", SANITIZER_FLAGS)


@pytest.fixture
def build_c(cbin_dir: Path) -> Callable[..., Path]:
    """build_c("prog.c") -> path of the compiled test program (tests/c/prog.c)."""

    def _build(source: str | Path, extra: list[str] | None = None) -> Path:
        return compile_program(source, cbin_dir, extra)

    return _build


@pytest.fixture
def sim_env(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """Environment for a process on the simulated GPU, with its own node state directory.

    Tests add SIMGPU_CONFIG (a JSON file) when they need other devices than the default H100. A
    `simgpu` mark (`pytest.mark.simgpu(SIMGPU_...="...")`, on the module or the test; the closer
    one wins) sets simulator knobs here, and so in shim_env too.
    """
    state = tmp_path / "simgpu-state"
    state.mkdir()
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["LD_LIBRARY_PATH"] = str(sim_lib_dir())
    env["SIMGPU_STATE"] = str(state)
    for mark in reversed(list(request.node.iter_markers("simgpu"))):
        env.update(mark.kwargs)
    yield env


@pytest.fixture
def host_nvml(sim_env: dict[str, str]) -> Iterator[HostNvml]:
    """The simulated node's NVML as the plugin and the watchdog read it (read_nvml), from a helper
    process on sim_env's simulator state (tests/support/host_nvml.py)."""
    nvml = HostNvml(sim_env)
    yield nvml
    nvml.close()


@pytest.fixture
def graphmem_ops(build_c: Callable[..., Path]) -> Path:
    """tests/c/graphmem_ops.c: graph memory nodes, captured allocations and module loads, by op."""
    return build_c("graphmem_ops.c", ["-ldl"])


@pytest.fixture
def shim_env(sim_env: dict[str, str]) -> dict[str, str]:
    """sim_env with the shim preloaded and no limits or region set yet."""
    env = {
        k: v for k, v in sim_env.items() if not k.startswith(("CUDA_DEVICE_", "LIBCUDA_", "VGPU_"))
    }
    env.pop("CUDA_DISABLE_CONTROL", None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["LD_PRELOAD"] = str(shim_library())
    return env


@pytest.fixture
def shim_ops(build_c: Callable[..., Path]) -> Path:
    """tests/c/shim_ops.c: CUDA calls by op, one "op=... rc=..." line each."""
    return build_c("shim_ops.c")

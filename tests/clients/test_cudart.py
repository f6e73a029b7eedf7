"""NVIDIA's CUDA runtime (libcudart 12 and 13, from the pinned nvidia-cuda-runtime wheels) on the
simulated GPU: a C program built as nvcc builds one, but host-only with gcc
(programs/cudart_client.c registers its kernel as nvcc's generated code does), under
`vgpu run --sim --memory`: the runtime sees the slice as the device's memory, refuses an
allocation past it with cudaErrorMemoryAllocation, and its launches are held to a compute cap."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support import nvidia_headers
from tests.support.clients import PROGRAMS, Client

pytestmark = pytest.mark.slow

CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation


def _nvidia(sub: str, name: str) -> Path:
    for root in nvidia_headers.cuda_includes():
        d = root.parent.parent / sub
        if (d / name).exists():
            return d
    raise FileNotFoundError(f"{sub}/{name} not found beside {nvidia_headers.cuda_includes()}")


def build(version: str, tmp: Path) -> Path:
    """programs/cudart_client.c built against libcudart.so.<version> and that version's headers
    (crt/ from the nvcc wheel: the runtime wheels ship none)."""
    pkg = "cuda_runtime" if version == "12" else "cu13"
    include, lib = (
        _nvidia(f"{pkg}/include", "cuda_runtime_api.h"),
        _nvidia(f"{pkg}/lib", f"libcudart.so.{version}"),
    )
    crt = _nvidia("cuda_nvcc/include", "crt/host_defines.h")
    out = tmp / f"cudart_client{version}"
    subprocess.run(
        [
            "gcc",
            "-Wall",
            "-Wextra",
            "-Werror",
            f"-I{include}",
            f"-I{crt}",
            str(PROGRAMS / "cudart_client.c"),
            "-o",
            str(out),
            f"-L{lib}",
            f"-l:libcudart.so.{version}",
            f"-Wl,-rpath,{lib}",
        ],
        check=True,
    )
    return out


@pytest.mark.parametrize("version", ["12", "13"])
def test_runtime_sees_the_slice_and_is_refused_past_it(
    client: Client, version: str, tmp_path: Path
) -> None:
    quota = 2 << 30
    out = client.run(str(build(version, tmp_path)), "memory", vgpu=["--memory", str(quota)])
    m = re.search(r"total=(\d+) free=(\d+) prop_total=(\d+)", out)
    assert m, out
    total, free, prop_total = (int(x) for x in m.groups())
    assert total == quota and prop_total == quota, out
    assert free == quota - CONTEXT_MEMORY, out  # the runtime's primary context is charged
    fit = int(re.search(r"fit=(\d+)", out).group(1))  # type: ignore[union-attr]
    assert fit == free // (64 << 20), out  # every 64 MiB buffer that fits, and not one more
    assert f"oom_error={CUDA_ERROR_MEMORY_ALLOCATION}" in out, out


@pytest.mark.parametrize("version", ["12", "13"])
def test_runtime_launches_are_capped(client: Client, version: str, tmp_path: Path) -> None:
    # 12.9 launches through cuLibraryGetModule + cuModuleGetFunction, 13 through cuLibraryGetKernel
    env = {k: v for k, v in client.env.items() if not k.startswith("SIMGPU_KERNEL_")}
    exe = str(build(version, tmp_path))
    out = Client(env).run(exe, "compute", "3", vgpu=["--compute", "30"])
    m = re.search(r"share=([\d.]+)", out)
    assert m, out
    assert 22 < float(m.group(1)) < 38, out

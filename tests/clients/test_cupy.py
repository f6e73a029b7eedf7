"""CuPy (cupy-cuda12x 14.2: NVIDIA's CUDA 12 runtime, NVRTC; installed by scripts/setup into
.venv/frameworks) on the simulated GPU under `vgpu run --sim`: memGetInfo is the slice, an array
past the quota raises cupy's OutOfMemoryError, and an NVRTC kernel runs under the compute cap
(programs/cupy_client.py)."""

from __future__ import annotations

import re

import pytest

from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support.clients import Client, frameworks_python

pytestmark = pytest.mark.slow

QUOTA = 2 << 30


@pytest.fixture
def cupy_python() -> str:
    return frameworks_python("cupy")


def test_mem_get_info_is_the_slice_and_arrays_stop_at_it(client: Client, cupy_python: str) -> None:
    out = client.run("cupy_client.py", "memory", vgpu=["--memory", str(QUOTA)], python=cupy_python)
    m = re.search(r"free=(\d+) total=(\d+)", out)
    # the primary context the runtime created through its private table is charged
    assert m and (int(m.group(1)), int(m.group(2))) == (QUOTA - CONTEXT_MEMORY, QUOTA), out
    m2 = re.search(r"oom after (\d+) arrays", out)
    assert m2 and int(m2.group(1)) == int(m.group(1)) // (64 << 20), out
    assert "again ok" in out, out


def test_nvrtc_kernel_is_capped(client: Client, cupy_python: str) -> None:
    env = {k: v for k, v in client.env.items() if not k.startswith("SIMGPU_KERNEL_")}
    out = Client(env).run(
        "cupy_client.py", "compute", "3", vgpu=["--compute", "30"], python=cupy_python
    )
    m = re.search(r"share=([\d.]+)", out)
    assert m, out
    assert 22 < float(m.group(1)) < 38, out

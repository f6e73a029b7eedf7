"""The simulated libcuda's API surface, exercised by C programs as an unmodified CUDA program would."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.sim.simhelp import EXACT_DURATIONS


@pytest.mark.slow
def test_api_surface(build_c: Callable[..., Path], sim_env: dict[str, str]) -> None:
    """Devices, contexts, memory accounting, copies, pools, VMM, arrays, modules, launches,
    streams, events, graphs, every cuGetProcAddress row, errors (tests/c/sim_api.c)."""
    exe = build_c("sim_api.c", ["-ldl"])
    # its accounting checks are exact with a driver taking 512 B granules (pages: sim_pages.c)
    # and contexts taking no memory (context memory: test_context_memory.py)
    # and its timing checks (events, graphs, pacing) pin the modelled durations exactly
    env = dict(
        sim_env, SIMGPU_ALLOC_GRANULARITY="512", SIMGPU_CONTEXT_MEMORY="0", **EXACT_DURATIONS
    )
    r = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("OK")
    assert "procaddr rows checked" in r.stdout


def test_smoke_timeline(build_c: Callable[..., Path], sim_env: dict[str, str]) -> None:
    """Init, the default device, a context, memory charged by granule, a copy round trip, and 100
    launches of a 1 ms kernel that take their 100 ms of device time (tests/c/sim_smoke.c)."""
    exe = build_c("sim_smoke.c")
    # exact byte counts; 100 x 1 ms launches must take at least 100 ms: exact durations
    env = dict(sim_env, SIMGPU_ALLOC_GRANULARITY="512", **EXACT_DURATIONS)
    r = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    device = re.search(r"^device (.+) total=(\d+) sms=(\d+)$", r.stdout, re.M)
    assert device, r.stdout
    assert device.groups() == ("NVIDIA H100 80GB HBM3", str(80 << 30), "132"), r.stdout
    assert "(delta 1024)" in r.stdout, r.stdout  # 1000 B take two 512 B granules
    assert "roundtrip 1000 bytes" in r.stdout, r.stdout
    total = re.search(r"total ([\d.]+) ms", r.stdout)
    assert total, r.stdout
    # the synchronisation waited for the device: 100 kernels of exactly 1 ms (a slow host only
    # adds to this, so there is no upper bound)
    assert float(total.group(1)) >= 99.9, r.stdout


def test_whole_80gib_device_on_a_small_machine(sim_tool: Path, sim_env: dict[str, str]) -> None:
    """The default device has 80 GiB; all of it can be allocated in one piece (committed lazily)
    by a process whose context takes none of it."""
    env = dict(sim_env, SIMGPU_CONTEXT_MEMORY="0")
    r = subprocess.run(
        [str(sim_tool), "alloc", str(80 << 30)], env=env, capture_output=True, text=True, timeout=60
    )
    assert (r.returncode, r.stdout) == (0, f"free=0 total={80 << 30}\n"), r.stdout + r.stderr
    r = subprocess.run(
        [str(sim_tool), "alloc", str((80 << 30) + 1)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (r.returncode, r.stdout) == (2, ""), r.stdout + r.stderr  # out of memory, nothing taken


def test_client_api_surface(build_c: Callable[..., Path], sim_env: dict[str, str]) -> None:
    """What numba-cuda, cuda.core and CuPy-style clients call: kernel/function attributes,
    occupancy, pinned/mapped/registered host memory, stream priorities and host callbacks, module
    globals from PTX, 2D/3D copies, the linker, context limits, sim_<N>us in every C++ mangling;
    and the list of what is not modelled with its error (tests/c/sim_client_api.c)."""
    exe = build_c("sim_client_api.c")
    # exact byte counts (no context memory: test_context_memory.py); it checks each mangling's modelled duration exactly
    env = dict(
        sim_env, SIMGPU_ALLOC_GRANULARITY="512", SIMGPU_CONTEXT_MEMORY="0", **EXACT_DURATIONS
    )
    r = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("OK")

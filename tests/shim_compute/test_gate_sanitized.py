"""The launch gate under AddressSanitizer + UndefinedBehaviorSanitizer, where its common case runs
without the process mutex (per-thread cache of the estimate, compute.c gate_fast): several
threads launching short kernels of one key under a cap that does not bind (every launch is still
counted once, and most go unmeasured), and the edge cases of compute_edge.c (NULL arguments,
capture, a fork child launching after its parent did, contexts created and destroyed between
launches)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.compute_workload import Workload, compute_state, parse

pytestmark = pytest.mark.slow

ASAN_ENV = {
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:exitcode=99",
    "UBSAN_OPTIONS": "print_stacktrace=1",
}


@pytest.fixture(scope="module")
def sanitized_shim(asan_libs: dict[str, Path]) -> str:
    shim = asan_libs["libvgpu.so"]
    libasan = subprocess.run(
        ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return f"{libasan}:{shim}"


def _clean(stderr: str) -> None:
    assert "Sanitizer" not in stderr and "runtime error" not in stderr, stderr[-3000:]


def test_threads_on_the_gates_fast_path(sanitized_shim: str, workload: Workload) -> None:
    env = dict(workload.env(CUDA_DEVICE_SM_LIMIT="50"), **ASAN_ENV, LD_PRELOAD=sanitized_shim)
    args = ["--kernel", "sim_1us", "--threads", "4", "--warmup", "0.2", "--seconds", "1"]
    p = subprocess.run(
        [str(workload.exe), *args], env=env, capture_output=True, text=True, timeout=300
    )
    _clean(p.stderr)
    r = parse(p.stdout, p.stderr, p.returncode)
    assert r.returncode == 0, r.stderr[-3000:]
    st = compute_state(Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]))
    # every launch of every thread admitted and counted once, whichever path it took
    assert st.launches == r.launches_run, (st.launches, r.stdout)
    assert r.launches_run > 1000, r.stdout
    # learned (a key's first 32 launches are all measured), then sampled: one launch in 4 or
    # fewer is measured, so most launches took the path without events
    assert 32 <= st.measured_launches < r.launches_run // 3, (st.measured_launches, r.stdout)
    assert st.charged_ns > 0


def test_edges_sanitized(
    sanitized_shim: str, build_c: Callable[..., Path], workload: Workload
) -> None:
    exe = build_c("compute_edge.c")
    env = dict(workload.env(CUDA_DEVICE_SM_LIMIT="10"), **ASAN_ENV, LD_PRELOAD=sanitized_shim)
    p = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=300)
    _clean(p.stderr)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert p.stdout.strip() == "ok"
    st = compute_state(Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]))
    assert 60 <= st.launches <= 61, st.launches  # as in test_edges.py
    assert "no capture was seen to begin" not in p.stderr, p.stderr[-3000:]
    # and a capture begun out of the hooks' sight, found at a measured launch
    env = dict(
        workload.env("unseen", CUDA_DEVICE_SM_LIMIT="10"), **ASAN_ENV, LD_PRELOAD=sanitized_shim
    )
    p = subprocess.run([str(exe), "unseen"], env=env, capture_output=True, text=True, timeout=300)
    _clean(p.stderr)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert "no capture was seen to begin" in p.stderr, p.stderr[-3000:]

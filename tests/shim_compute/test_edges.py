"""Edge cases of the launch hooks under a cap: NULL arguments, bad streams, capture, fork."""

from __future__ import annotations

import subprocess
import time

from tests.shim_compute.conftest import Workload


def test_edges_under_a_cap(build_c, workload: Workload) -> None:  # type: ignore[no-untyped-def]
    exe = build_c("compute_edge.c")
    env = workload.env(CUDA_DEVICE_SM_LIMIT="10")
    t0 = time.monotonic()
    r = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "ok"
    # 40 ms of kernels at 10% take ~0.4 s (minus the burst); charging the 200 captured
    # launches would have cost another ~2 s.
    assert elapsed < 1.5, elapsed

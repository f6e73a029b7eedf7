"""Edge cases of the launch hooks under a cap: NULL arguments, bad streams, capture, fork."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.compute_workload import Workload, compute_state

pytestmark = pytest.mark.slow


def test_edges_under_a_cap(build_c: Callable[..., Path], workload: Workload) -> None:
    exe = build_c("compute_edge.c")
    env = workload.env(CUDA_DEVICE_SM_LIMIT="10")
    r = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "ok"
    # The slice paid for the 40 launches that ran (1 ms each, the fork child's one at most on
    # top), not for the 200 captured ones (another 200 ms of budget, 2 s of waiting at 10%).
    st = compute_state(Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]))
    assert 40 <= st.launches <= 41, st.launches
    assert st.charged_ns < 60_000_000, st.charged_ns

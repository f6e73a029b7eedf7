"""Edge cases of the launch hooks under a cap: NULL arguments, bad streams, capture, fork,
contexts destroyed and created between launches."""

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
    # The slice paid for the 55 launches that ran (1 ms each: 40 in the primary context, 15 in
    # three contexts created one after the other; the fork child's one at most on top), not for
    # the 200 captured ones (another 200 ms of budget, 2 s of waiting at 10%) nor for those in
    # a destroyed context.
    st = compute_state(Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]))
    assert 55 <= st.launches <= 56, st.launches
    assert st.charged_ns < 80_000_000, st.charged_ns

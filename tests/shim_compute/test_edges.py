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
    # The slice paid for the 60 launches that ran (1 ms each: 45 in the primary context, 15 in
    # three contexts created one after the other; the fork child's one at most on top), not for
    # the 600 captured ones (200 in each of three captures: another 200 ms of budget, 2 s of
    # waiting at 10%, each) nor for those in a destroyed context.
    st = compute_state(Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]))
    assert 60 <= st.launches <= 61, st.launches
    assert st.charged_ns < 90_000_000, st.charged_ns
    # Every capture was seen begin and end: the shim never had to find one out.
    assert "no capture was seen to begin" not in r.stderr, r.stderr


def test_a_capture_begun_out_of_sight_is_found_and_not_charged(
    build_c: Callable[..., Path], workload: Workload
) -> None:
    """A capture begun through an entry point the shim does not hook (here the driver's own
    cuStreamBeginCapture_v2, found in its symbol table): while the shim counts no capture it
    charges launches without asking about capture, until a measured launch (one in 4 of these
    1 ms kernels, at random) finds the stream capturing; from then on every launch asks, and the
    captured launches are not charged."""
    exe = build_c("compute_edge.c")
    env = workload.env(CUDA_DEVICE_SM_LIMIT="10")
    r = subprocess.run([str(exe), "unseen"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no capture was seen to begin" in r.stderr, r.stderr
    st = compute_state(Path(env["CUDA_DEVICE_MEMORY_SHARED_CACHE"]))
    # 40 launches ran; of the 200 captured, those before the first measured one were charged:
    # more than 40 of them would be 40 unmeasured draws in a row (0.75^40, about 1e-5).
    assert 41 <= st.launches <= 80, st.launches

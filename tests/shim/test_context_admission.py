"""A context is admitted against the slice's quota before the driver creates it: with many
processes (and threads in each) starting at once in a fresh slice, the driver's own figure of the
device's used memory, sampled continuously from outside the slice (the simulator's NVML, read by
a process without the shim), never exceeds the quota, not even for a moment.

The simulator takes a context's memory at the start of its creation and, with
SIMGPU_CONTEXT_CREATE_MS, returns only that much later (docs/simulator.md): the window in which
a context exists before the shim can measure it is as wide as on a real GPU, so a context
created before it was admitted is seen by the sampler every time, not by luck."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from sharing import region
from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support.context_storm import Sampler, Storm
from tests.support.shim_memory import slice_env

pytestmark = pytest.mark.slow

MiB = 1 << 20
QUOTA = 1 << 30  # 1 GiB: two 500 MiB contexts fit, a third does not


@pytest.fixture
def ctx_storm(build_c: Callable[..., Path]) -> Path:
    return build_c("ctx_storm.c")


@pytest.mark.parametrize(
    ("create_ms", "mode"),
    [
        # creation slower than any bounded wait for the measuring process: on a real GPU the
        # first context after the driver brings the GPU up takes seconds
        ("2500", "mixed"),
        ("300", "primary"),  # tens to hundreds of ms: a context's creation on a real GPU
        ("0", "create"),  # instantaneous creation: only the shim's own ordering is in play
    ],
)
def test_many_processes_and_threads_at_once_never_exceed_the_quota(
    create_ms: str, mode: str, ctx_storm: Path, shim_env: dict[str, str], tmp_path: Path
) -> None:
    """4 processes x 8 threads create 500 MiB contexts at once in a fresh 1 GiB slice (whose
    accounting file does not exist yet): two contexts are made, every other creation is refused
    before the driver is asked, and the device's used memory never passes the quota."""
    env, reg = slice_env(shim_env, tmp_path, str(QUOTA))
    env["SIMGPU_CONTEXT_CREATE_MS"] = create_ms
    sampler = Sampler(env, QUOTA)
    try:
        storm = Storm(ctx_storm, env, 4, 8, mode)
        try:
            storm.wait()
            used = region.read(reg).devices[0].used
            sampler.mark()  # read once more while they hold their contexts
        finally:
            storm.release()
    finally:
        seen = sampler.stop()
    codes = storm.codes
    assert seen["samples"] > 100, seen  # it did look, many times
    assert seen["peak"] <= QUOTA and seen["over"] == 0, seen
    # a primary context is one per process: its later retains share it
    made = 2 * CONTEXT_MEMORY
    assert used == made, (used, codes)
    assert set(codes) <= {0, 2}, codes  # success or CUDA_ERROR_OUT_OF_MEMORY, nothing else
    assert seen["at_mark"] == made, seen  # the two contexts, seen by the sampler too

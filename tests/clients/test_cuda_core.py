"""cuda.core (with NVRTC from the nvidia-cuda-nvrtc-cu12 wheel) on the simulated GPU: programs
compiled to PTX and to cubin load as modules and launch, streams and events time them, memory
resources allocate; under `vgpu run` the quota holds and the default pool reuses its freed blocks
(programs/cuda_core_client.py)."""

from __future__ import annotations

import json
import re

import pytest

from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support.clients import Client

pytestmark = pytest.mark.slow

# A slice of 1 GiB for allocations beside the client's context (charged to the slice).
SLICE = str((1 << 30) + CONTEXT_MEMORY)
MiB = 1 << 20


def test_nvrtc_programs_streams_and_memory_resources(client: Client) -> None:
    """NVRTC programs compiled to PTX and to a cubin (a template instance by its mangled name)
    run for their kernels' durations on the device timeline; pinned memory and a priority
    stream work under the shim."""
    seen = json.loads(client.run("cuda_core_client.py", "basic").splitlines()[-1])
    for target in ("ptx", "cubin"):
        t = seen[target]
        assert 0.95 < t["kernel_ms"] < 1.3 and 0.28 < t["template_ms"] < 0.45, (target, t)
        assert t["max_threads_per_block"] == 1024
    assert seen["pinned_bytes"] == 4 * MiB


def test_default_pool_reuses_freed_block_in_a_full_slice(client: Client) -> None:
    # 8 x 128 MiB fill the slice's 1 GiB; one is freed into the pool (release threshold
    # UINT64_MAX, as cuda.core sets it) and the next 128 MiB allocation is served from it.
    out = client.run("cuda_core_client.py", "pool", "8", vgpu=["--memory", SLICE])
    got = json.loads(out.splitlines()[-1])
    assert got["buffers"] == 8 and got["next"] == got["freed"], got


def test_buffers_up_to_and_past_the_quota(client: Client) -> None:
    out = client.run("cuda_core_client.py", "quota", SLICE, vgpu=["--memory", SLICE])
    assert "oom after 8 buffers" in out, out


def test_graph_memory_resource_is_taken_at_launch_and_kept_until_trim(client: Client) -> None:
    steps = json.loads(client.run("cuda_core_client.py", "graphmem").splitlines()[-1])
    assert steps == [
        ["built", 0, 0],  # captured: an allocation node, no memory yet
        ["launched", 128 * MiB, 128 * MiB],
        ["freed", 128 * MiB, 0],  # the graph pool keeps it
        ["trimmed", 0, 0],
    ]


def test_graphs_allocating_memory_up_to_and_past_the_quota(client: Client) -> None:
    """Each graph allocates 128 MiB when launched; under a 1 GiB slice a launch is refused with
    CUDA_ERROR_OUT_OF_MEMORY once the graph pool would pass the quota."""
    out = client.run("cuda_core_client.py", "graphquota", str(1 << 30), vgpu=["--memory", "1Gi"])
    m = re.search(r"graph oom after (\d+) graphs reserved=(\d+)", out)
    assert m, out
    assert 1 <= int(m.group(1)) <= 8 and int(m.group(2)) <= 1 << 30, out

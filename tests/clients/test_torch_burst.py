"""PyTorch under a bursting slice (`vgpu run --sim --memory Q --memory-limit 2Q`; docs/policy.md,
"What the slice sees"): the caching allocator grows to the limit (borrowing above the request),
meets torch.cuda.OutOfMemoryError there and recovers after empty_cache(); mem_get_info() and NVML
inside show the request by default, so a vLLM-style pool sized from them stays within the request,
and the limit with --show-memory-limit, where the same pool takes borrowed memory.

The same in a bursting ResourceClaim: a claim prepared by the plugin (in this process) with a
VgpuConfig memoryLimit, PyTorch run with the claim's CDI mounts and environment
(tests/support/cdi_exec.py): the limits file and the pool file are the plugin's, the grant the
plugin's (the claim alone on the GPU: its whole limit − request)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from sharing.policy import BUILTIN, Burst
from tests.sim.simhelp import CONTEXT_MEMORY
from tests.support import cdi_exec
from tests.support.burst_world import claim, granted, prepare, spec_path
from tests.support.clients import PROGRAMS, Client, frameworks_python
from tests.support.prepare_world import World, close_world, make_world

pytestmark = pytest.mark.slow

MiB = 1 << 20
REQUEST = 2 << 30
LIMIT = 4 << 30
BURST = ["--memory", str(REQUEST), "--memory-limit", str(LIMIT)]


@pytest.fixture
def torch_python() -> str:
    return frameworks_python("torch")


def _free_total(out: str) -> tuple[int, int]:
    m = re.search(r"free=(\d+) total=(\d+)", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


@pytest.mark.parametrize("show", [False, True])
def test_the_caching_allocator_grows_to_the_limit_and_recovers(
    client: Client, torch_python: str, show: bool
) -> None:
    vgpu = [*BURST, *(["--show-memory-limit"] if show else [])]
    out = client.run("torch_client.py", "memory", vgpu=vgpu, python=torch_python)
    free, total = _free_total(out)
    if show:
        assert (free, total) == (LIMIT - CONTEXT_MEMORY, LIMIT), out
    else:  # the request: what cannot be taken back
        assert (free, total) == (REQUEST - CONTEXT_MEMORY, REQUEST), out
    m = re.search(r"oom after (\d+) tensors: (.*)", out)
    assert m and "CUDA out of memory" in m.group(2), out
    n = int(m.group(1))
    # 64 MiB tensors up to the limit, not the request: the allocator borrowed
    room = LIMIT - CONTEXT_MEMORY
    assert (room - 128 * MiB) // (64 * MiB) <= n <= room // (64 * MiB), out
    m2 = re.search(r"again=(\d+)", out)
    assert m2 and int(m2.group(1)) == n, out  # empty_cache() gave everything back


@pytest.mark.parametrize("show", [False, True])
def test_a_vllm_style_pool_is_sized_from_what_the_slice_sees(
    client: Client, torch_python: str, show: bool
) -> None:
    vgpu = [*BURST, *(["--show-memory-limit"] if show else [])]
    out = client.run("torch_client.py", "pool", "0.9", vgpu=vgpu, python=torch_python)
    assert "pool ok" in out, out
    m = re.search(r"pool=(\d+) of total=(\d+)", out)
    assert m, out
    size, total = int(m.group(1)), int(m.group(2))
    if show:  # sized from the limit: part of the KV cache is borrowed, and could be taken back
        assert total == LIMIT and CONTEXT_MEMORY + size > REQUEST, out
    else:  # sized from the request: nothing it holds can be taken back
        assert total == REQUEST and CONTEXT_MEMORY + size <= REQUEST, out


@pytest.mark.parametrize("show", [False, True])
def test_nvml_inside_shows_the_request_or_the_limit(
    client: Client, torch_python: str, show: bool
) -> None:
    vgpu = [*BURST, *(["--show-memory-limit"] if show else [])]
    out = client.run("torch_client.py", "nvml", vgpu=vgpu, python=torch_python)
    m = re.search(r"nvml_total=(\d+) nvml_used=(\d+)", out)
    assert m, out
    free, total = _free_total(out)
    assert int(m.group(1)) == total == (LIMIT if show else REQUEST), out
    assert int(m.group(2)) == total - free, out


# ------------------------------------------------------------------ in a bursting ResourceClaim


@pytest.fixture
def burst_world() -> Iterator[World]:
    cdi_exec.skip_unless_possible()
    rules = replace(BUILTIN, burst=Burst(max_ratio=8, from_claim=True, show_limit=True))
    w: World = make_world(rules_for=lambda _gpu: rules)
    yield w
    close_world(w)


def _in_claim(w: World, sim_env: dict[str, str], python: str, show: bool, *args: str) -> str:
    config: dict[str, Any] = {"showMemoryLimit": True} if show else {}
    c = claim(w, "torch", f"{REQUEST}", f"{LIMIT}", **config)
    prepare(w, c)
    assert granted(w, c) == LIMIT - REQUEST  # alone on the GPU
    env = dict(sim_env, PYTHONWARNINGS="ignore")
    p = cdi_exec.popen(spec_path(w, c), env, [python, str(PROGRAMS / "torch_client.py"), *args])
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, out + err[-4000:]
    return out


@pytest.mark.parametrize("show", [False, True])
def test_in_a_bursting_claim_the_caching_allocator_grows_to_request_plus_grant(
    burst_world: World, sim_env: dict[str, str], torch_python: str, show: bool
) -> None:
    """By default torch sees the request as the total, yet its caching allocator grows above
    it, borrowing, up to request + grant; with showMemoryLimit it sees the limit."""
    out = _in_claim(burst_world, sim_env, torch_python, show, "memory")
    free, total = _free_total(out)
    if show:
        assert (free, total) == (LIMIT - CONTEXT_MEMORY, LIMIT), out
    else:
        assert (free, total) == (REQUEST - CONTEXT_MEMORY, REQUEST), out
    m = re.search(r"oom after (\d+) tensors: (.*)", out)
    assert m and "CUDA out of memory" in m.group(2), out
    n = int(m.group(1))
    room = LIMIT - CONTEXT_MEMORY  # request + grant, less the context
    assert (room - 128 * MiB) // (64 * MiB) <= n <= room // (64 * MiB), out
    assert n * 64 * MiB > REQUEST, out  # above the request: borrowed
    m2 = re.search(r"again=(\d+)", out)
    assert m2 and int(m2.group(1)) == n, out

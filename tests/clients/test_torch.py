"""PyTorch (torch 2.14.0, the default PyPI build on NVIDIA's CUDA 13.0 runtime; installed by
scripts/setup into .venv/frameworks) on the simulated GPU under `vgpu run --sim --memory`: the
slice is the device torch sees, its caching allocator (and the expandable-segments path on the
virtual memory API) meets torch.cuda.OutOfMemoryError at the quota and recovers after
empty_cache(), GEMMs of four types run through cuBLAS and cuBLASLt on a simulated H100 and on an
A100 (compute capability 8.0) without a cuBLASLt error, two processes share one quota, NVML
inside shows the slice, and a vLLM-style pool sized from mem_get_info() fits
(programs/torch_client.py). The context the CUDA runtime creates through its private table is
charged: mem_get_info() shows the quota less it, and the driver, read from outside the slice,
never holds more than the quota for the slice's process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sim.simhelp import CONTEXT_MEMORY, run_python
from tests.support.clients import PROGRAMS, Client, frameworks_python

pytestmark = pytest.mark.slow

MiB = 1 << 20
QUOTA = 2 << 30


@pytest.fixture
def torch_python() -> str:
    return frameworks_python("torch")


def _free_total(out: str) -> tuple[int, int]:
    m = re.search(r"free=(\d+) total=(\d+)", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_caching_allocator_meets_the_quota_and_recovers(
    client: Client, torch_python: str, alloc_conf: str
) -> None:
    env = dict(client.env, PYTORCH_CUDA_ALLOC_CONF=alloc_conf)
    out = Client(env).run(
        "torch_client.py", "memory", vgpu=["--memory", str(QUOTA)], python=torch_python
    )
    assert "available=True" in out, out
    free, total = _free_total(out)
    # the runtime's primary context is charged before torch sees the slice
    assert (free, total) == (QUOTA - CONTEXT_MEMORY, QUOTA), out
    m = re.search(r"oom after (\d+) tensors: (.*)", out)
    assert m and "CUDA out of memory" in m.group(2), out
    n = int(m.group(1))
    # whatever fits of the quota in 64 MiB tensors (the allocator rounds to its own block sizes)
    assert (free - 128 * MiB) // (64 * MiB) <= n <= free // (64 * MiB), out
    m2 = re.search(r"again=(\d+)", out)
    assert m2 and int(m2.group(1)) == n, out  # empty_cache() gave it all back


# an A100 (compute capability 8.0): cuBLASLt picks its sm_80 CUTLASS kernels there, whose cubins
# it loads itself (cuLibraryLoadData with CU_LIBRARY_BINARY_IS_PRESERVED and no value array)
A100 = {
    "name": "NVIDIA A100-SXM4-80GB",
    "memory": "80Gi",
    "sm_count": 108,
    "compute_capability": "8.0",
}
NVML_CC = """
nv.nvmlInit()
print(json.dumps(nv.nvmlDeviceGetCudaComputeCapability(nv.nvmlDeviceGetHandleByIndex(0))))
"""


@pytest.mark.parametrize("device", ["H100", "A100"])
def test_matmul_launches(client: Client, torch_python: str, tmp_path: Path, device: str) -> None:
    # cuBLASLt logs its errors to stdout: a candidate kernel it could not load is one, even when
    # the GEMM then runs another
    env = dict(client.env, CUBLASLT_LOG_LEVEL="1")
    if device == "A100":
        config = tmp_path / "a100.json"
        config.write_text(json.dumps({"devices": [A100]}))
        env["SIMGPU_CONFIG"] = str(config)
        cc = run_python(env, NVML_CC)
        assert cc == [8, 0], cc  # the device torch runs on
    out = Client(env).run(
        "torch_client.py", "matmul", vgpu=["--memory", str(QUOTA)], python=torch_python
    )
    for dtype in ("float32", "float16", "bfloat16", "float64"):
        assert f"matmul ok {dtype} (256, 256)" in out, out
    assert "bmm ok (8, 128, 128) linear ok (16, 32)" in out, out
    assert "[Error]" not in out, out


def test_cuda_graph_capture_and_replay(client: Client, torch_python: str) -> None:
    out = client.run("torch_client.py", "graph", vgpu=["--memory", str(QUOTA)], python=torch_python)
    assert "graph ok replays=3" in out, out


def test_cuda_graph_capture_under_a_cap_is_seen(client: Client, torch_python: str) -> None:
    """Under a compute cap the shim asks the driver whether a launch's stream is capturing only
    while its capture hooks count a capture in progress. torch.cuda.graph begins and ends its
    capture through the CUDA runtime (cudaStreamBeginCapture, reached through cuGetProcAddress):
    the hooks must see it. Had they missed it, the capture's launches (its kernels are new, so
    measured) would find the stream capturing and the shim would say so."""
    cmd = [sys.executable, "-m", "sharing.cli", "run", "--sim", "--memory", str(QUOTA),
           "--compute", "30", "--", torch_python, str(PROGRAMS / "torch_client.py"), "graph"]  # fmt: skip
    r = subprocess.run(cmd, env=client.env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "graph ok replays=3" in r.stdout, r.stdout
    assert "no capture was seen to begin" not in r.stderr, r.stderr[-4000:]


def test_two_processes_share_one_quota(client: Client, torch_python: str) -> None:
    out = client.run(
        "torch_client.py", "shared", vgpu=["--memory", str(QUOTA)], python=torch_python
    )
    # the child sees the slice less the parent's tensor, and cannot allocate past it
    held = int(re.search(r"parent holds (\d+)", out).group(1))  # type: ignore[union-attr]
    m = re.search(r"child oom free=(\d+) total=(\d+)", out)
    assert m and int(m.group(2)) == QUOTA, out
    assert int(m.group(1)) <= QUOTA - held, out


def test_nvml_inside_shows_the_slice(client: Client, torch_python: str) -> None:
    out = client.run("torch_client.py", "nvml", vgpu=["--memory", str(QUOTA)], python=torch_python)
    m = re.search(r"nvml_total=(\d+) nvml_used=(\d+)", out)
    assert m, out
    free, total = _free_total(out)
    assert int(m.group(1)) == QUOTA == total, out
    assert int(m.group(2)) == QUOTA - free, out


def test_vllm_style_pool_fits_the_slice(client: Client, torch_python: str) -> None:
    out = client.run(
        "torch_client.py", "pool", "0.9", vgpu=["--memory", str(QUOTA)], python=torch_python
    )
    assert "pool ok" in out, out
    m = re.search(r"pool=(\d+) of total=(\d+)", out)
    assert m and int(m.group(2)) == QUOTA, out


NVML_USED = """
nv.nvmlInit()
h = nv.nvmlDeviceGetHandleByIndex(0)
print(json.dumps({"used": nv.nvmlDeviceGetMemoryInfo(h).used,
                  "procs": [p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]}))
"""


def test_the_driver_never_holds_more_than_the_quota(client: Client, torch_python: str) -> None:
    """torch fills the slice to OOM and holds it: the simulator's NVML, read from this process
    (no shim), shows the slice's process at most at the quota, context included."""
    cmd = [sys.executable, "-m", "sharing.cli", "run", "--sim", "--memory", str(QUOTA), "--"]
    cmd += [torch_python, str(PROGRAMS / "torch_client.py"), "hold"]
    p = subprocess.Popen(
        cmd, env=client.env, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert p.stdout is not None and p.stdin is not None
        lines = []
        for line in p.stdout:
            lines.append(line)
            if line.startswith("holding"):
                break
        out = "".join(lines)
        assert "holding" in out, out + (p.stderr.read() if p.stderr else "")
        free, _ = _free_total(out)
        assert free == QUOTA - CONTEXT_MEMORY, out
        seen = run_python(client.env, NVML_USED)  # client.env has no LD_PRELOAD: the driver's view
        assert len(seen["procs"]) == 1, seen
        # filled: within one 64 MiB tensor (and torch's rounding) of the quota, never above it
        assert QUOTA - 128 * MiB < seen["procs"][0] <= QUOTA, (seen, out)
        assert seen["used"] <= QUOTA, seen
        p.stdin.write("done\n")
        p.stdin.flush()
        assert p.wait(timeout=120) == 0, p.stderr.read() if p.stderr else ""
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()

"""PyTorch (the default PyPI build, CUDA 13.0) on the simulated GPU; run by tests/clients/test_torch.py
with .venv/frameworks' interpreter, usually under `vgpu run --sim --memory Q`. Kernels compute
nothing on the simulator: these programs check memory, errors and timing, never values.

torch_client.py memory        mem_get_info, then 64 MiB tensors through the caching allocator up to
                              torch.cuda.OutOfMemoryError; empty_cache(); the memory is usable again
torch_client.py matmul        a @ a (cuBLAS, cuBLASLt) in four types, bmm, a linear layer
torch_client.py graph         CUDA graph capture and replay (its memory pool charged)
torch_client.py shared        a second process (torch.multiprocessing) shares the slice's quota
torch_client.py nvml          what NVML shows inside the slice
torch_client.py pool F        the vLLM pattern: a pool of F x total minus what is used, filled
torch_client.py hold          mem_get_info, 64 MiB tensors up to torch.cuda.OutOfMemoryError, then
                              "holding" and the tensors kept until a line arrives on stdin
torch_client.py elementwise W S N
                              in-place elementwise ops on a tensor of N floats back to back for W
                              seconds of warm-up then S seconds; prints the share of the device the
                              driver served this process over the S seconds (simgpuProcessBusyNs)
torch_client.py matmul-heavy W S N
                              the same with one N x N float GEMM (cuBLAS) per step
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# the repository's own measure of a process's wait for a CPU (this interpreter is .venv/frameworks')
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from sharing.observe.cpuwait import cpu_wait_ns

MiB = 1 << 20


def info() -> tuple[int, int]:
    free, total = torch.cuda.mem_get_info()
    print(f"free={free} total={total}", flush=True)
    return free, total


def fill(chunk: int) -> list[torch.Tensor]:
    held: list[torch.Tensor] = []
    try:
        while True:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError as e:
        print(f"oom after {len(held)} tensors: {str(e).splitlines()[0][:120]}", flush=True)
    return held


def memory() -> None:
    assert torch.cuda.is_available() and torch.cuda.device_count() == 1
    print(f"available={torch.cuda.is_available()}")
    info()
    held = fill(64 * MiB)
    print(f"allocated={len(held) * 64 * MiB} reserved={torch.cuda.memory_reserved()}")
    del held
    torch.cuda.empty_cache()
    info()
    again = fill(64 * MiB)
    print(f"again={len(again)}")


def matmul() -> None:
    # cuBLAS and cuBLASLt pick a kernel per type: single, half, bfloat16 and double GEMMs, a
    # batched one and a linear layer (GEMM with bias, through cuBLASLt)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        a = torch.ones(256, 256, device="cuda", dtype=dtype)
        b = a @ a
        torch.cuda.synchronize()
        print(f"matmul ok {str(dtype).removeprefix('torch.')} {tuple(b.shape)}", flush=True)
    x = torch.ones(8, 128, 64, device="cuda")
    y = torch.bmm(x, x.transpose(1, 2))
    z = torch.nn.Linear(64, 32).cuda()(torch.ones(16, 64, device="cuda"))
    torch.cuda.synchronize()
    print(f"bmm ok {tuple(y.shape)} linear ok {tuple(z.shape)}")


def graph() -> None:
    x = torch.ones(1 << 20, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = x * 2  # warm-up on a side stream, as torch's docs ask
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x * 2 + 1
    before = torch.cuda.mem_get_info()[0]
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    print(
        f"graph ok replays=3 out={y.numel()} free_before={before} free_after={torch.cuda.mem_get_info()[0]}"
    )


def child(q: object) -> None:
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    chunk = free + 64 * MiB  # more than the slice has left beside the parent's tensor
    try:
        t = torch.empty(chunk, dtype=torch.uint8, device="cuda")
        del t
        q.put(f"child fit free={free} total={total}")  # type: ignore[attr-defined]
    except torch.cuda.OutOfMemoryError:
        q.put(f"child oom free={free} total={total}")  # type: ignore[attr-defined]


def shared() -> None:
    import torch.multiprocessing as mp

    free, _ = info()
    held = torch.empty(free // 2, dtype=torch.uint8, device="cuda")  # half of what is left
    print(f"parent holds {held.numel()}", flush=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print(q.get(timeout=120), flush=True)
    p.join(120)
    del held


def nvml() -> None:
    import pynvml

    torch.ones(1, device="cuda")
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    m = pynvml.nvmlDeviceGetMemoryInfo(h)
    print(f"nvml_total={m.total} nvml_used={m.used}")
    info()


def pool(fraction: float) -> None:
    free, total = info()
    used = total - free
    size = (
        int(total * fraction) - used
    )  # vLLM: gpu_memory_utilization x total, minus what is in use
    kv = torch.empty(size, dtype=torch.uint8, device="cuda")
    kv.fill_(0)
    torch.cuda.synchronize()
    print(f"pool={size} of total={total}", flush=True)
    for _ in range(20):  # work beside the pool
        a = torch.ones(1 << 20, device="cuda")
        (a * 2).sum()
    torch.cuda.synchronize()
    print("pool ok", flush=True)


def hold() -> None:
    info()
    held = fill(64 * MiB)
    print(f"holding {len(held)}", flush=True)
    sys.stdin.readline()
    del held


def served_share(t0: int, t1: int) -> float:
    """The percentage of [t0, t1] (CLOCK_MONOTONIC ns) the simulated driver served this process:
    its own accounting (simgpuProcessBusyNs, complete 50 ms buckets), not the host's clock."""
    fn = ctypes.CDLL("libcuda.so.1").simgpuProcessBusyNs
    fn.argtypes = [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong]
    fn.argtypes += [ctypes.POINTER(ctypes.c_ulonglong)] * 2
    busy, window = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    rc = fn(torch.cuda.current_device(), t0, t1, ctypes.byref(busy), ctypes.byref(window))
    if rc != 0 or window.value == 0:
        raise SystemExit(f"simgpuProcessBusyNs answered {rc}, window {window.value}")
    return 100.0 * busy.value / window.value


def served_loop(warmup: float, seconds: float, step: Callable[[], int]) -> None:
    """Run step() (it queues kernels, returns how many) back to back for `warmup` seconds, then
    for `seconds` more, and print the share of the device the driver served this process over the
    second stretch, bracketed by torch.cuda.synchronize()."""

    def run(s: float) -> int:
        n, end = 0, time.monotonic() + s
        while time.monotonic() < end:
            n += step()
        return n

    run(warmup)
    torch.cuda.synchronize()
    w0, t0 = cpu_wait_ns(), time.monotonic_ns()
    n = run(seconds)
    torch.cuda.synchronize()
    w1, t1 = cpu_wait_ns(), time.monotonic_ns()
    share = served_share(t0, t1)
    print(
        f"share={share:.3f} launches={n} window_s={(t1 - t0) / 1e9:.3f} "
        f"cpu_wait={(w1 - w0) / (t1 - t0):.3f}",
        flush=True,
    )


def elementwise(warmup: float, seconds: float, numel: int) -> None:
    x = torch.empty(numel, device="cuda")
    y = torch.empty(numel, device="cuda")

    def step() -> int:
        x.add_(y)
        x.mul_(0.5)
        torch.relu_(x)
        return 3

    served_loop(warmup, seconds, step)


def matmul_heavy(warmup: float, seconds: float, n: int) -> None:
    a = torch.empty(n, n, device="cuda")
    b = torch.empty(n, n, device="cuda")
    c = torch.empty(n, n, device="cuda")

    def step() -> int:
        torch.mm(a, b, out=c)  # one cuBLAS GEMM kernel
        return 1

    served_loop(warmup, seconds, step)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "pool":
        pool(float(sys.argv[2]))
    elif mode == "elementwise":
        elementwise(float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
    elif mode == "matmul-heavy":
        matmul_heavy(float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
    else:
        {
            "memory": memory,
            "matmul": matmul,
            "graph": graph,
            "shared": shared,
            "nvml": nvml,
            "hold": hold,
        }[mode]()

"""CuPy (cupy-cuda12x: NVIDIA's CUDA 12 runtime and NVRTC) on the simulated GPU; run by
tests/clients/test_cupy.py with .venv/frameworks' interpreter under `vgpu run --sim`. Kernels
compute nothing on the simulator: the program checks memory, errors and timing, never values.

cupy_client.py memory      memGetInfo; 64 MiB arrays up to cupy's OutOfMemoryError (the memory
                           pool released then reused)
cupy_client.py compute S   an NVRTC-compiled RawKernel (sim_2000us: 2 ms per launch) for S
                           seconds; prints the device share it got
"""

from __future__ import annotations

import sys
import time

import cupy as cp

MiB = 1 << 20


def memory() -> None:
    free, total = cp.cuda.runtime.memGetInfo()
    print(f"free={free} total={total}", flush=True)
    held = []
    try:
        while True:
            held.append(cp.empty(64 * MiB, dtype=cp.uint8))
    except cp.cuda.memory.OutOfMemoryError as e:
        print(f"oom after {len(held)} arrays: {str(e)[:100]}", flush=True)
    del held
    cp.get_default_memory_pool().free_all_blocks()
    again = cp.empty(64 * MiB, dtype=cp.uint8)
    print(f"again ok {again.nbytes}")


def compute(seconds: float) -> None:
    k = cp.RawKernel(
        r'extern "C" __global__ void sim_2000us(float *x) { x[threadIdx.x] = 1.0f; }', "sim_2000us"
    )
    x = cp.empty(32, dtype=cp.float32)
    k((1,), (32,), (x,))
    cp.cuda.Device().synchronize()
    n, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        for _ in range(10):
            k((1,), (32,), (x,))
            n += 1
    cp.cuda.Device().synchronize()
    wall = time.monotonic() - t0
    print(f"share={100.0 * n * 0.002 / wall:.1f} launches={n} wall={wall:.2f}")


if __name__ == "__main__":
    if sys.argv[1] == "memory":
        memory()
    else:
        compute(float(sys.argv[2]))

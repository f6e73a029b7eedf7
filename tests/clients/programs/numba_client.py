"""An ordinary numba-cuda program (run by tests/clients/test_numba.py on the simulated GPU).

numba_client.py basic       jit kernels, forall, pinned and mapped arrays, device arrays
numba_client.py quota N     device arrays of 64 MiB until out of memory; N = the quota
numba_client.py compute S   launch sim_2000us for S seconds; print the device share
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import CudaAPIError


@cuda.jit  # type: ignore[untyped-decorator]  # numba is not typed
def sim_2000us(a: Any) -> None:  # the simulator models 2000 us per wave from the name
    i = cuda.grid(1)
    if i < a.size:
        a[i] += 1


@cuda.jit  # type: ignore[untyped-decorator]  # numba is not typed
def scale(a: Any, f: Any) -> None:
    i = cuda.grid(1)
    if i < a.size:
        a[i] *= f


def basic() -> None:
    host = np.arange(1 << 16, dtype=np.float32)
    d = cuda.to_device(host)
    sim_2000us[132, 128](d)
    scale.forall(d.size)(d, 2.0)
    cuda.synchronize()
    # Data round-trips (the simulator runs no device code: the kernels leave it unchanged).
    roundtrip = bool(np.array_equal(d.copy_to_host(), host))
    pinned = cuda.pinned_array(1 << 16, dtype=np.float32)
    pinned[:] = 3.0
    d2 = cuda.to_device(pinned)
    out = cuda.pinned_array_like(pinned)
    d2.copy_to_host(out)
    pinned_value = float(out[123])
    mapped = cuda.mapped_array(1024, dtype=np.int32)
    mapped[:] = 5
    scale[8, 128](mapped, 2)
    cuda.synchronize()
    stream = cuda.stream()
    d3 = cuda.device_array(1 << 20, dtype=np.uint8, stream=stream)
    sim_2000us[4, 256, stream](d3)
    stream.synchronize()
    ev0, ev1 = cuda.event(), cuda.event()
    # The device is kept busy (100 ms) while the host records and launches what is measured, so
    # the events time the kernel, not how late a loaded host got to it.
    for _ in range(50):
        sim_2000us[132, 128](d)
    ev0.record()
    sim_2000us[132, 128](d)
    ev1.record()
    ev1.synchronize()
    ms = cuda.event_elapsed_time(ev0, ev1)
    free, total = cuda.current_context().get_memory_info()
    print(json.dumps({"roundtrip": roundtrip, "pinned_value": pinned_value, "kernel_ms": ms,
                      "free": free, "total": total}))  # fmt: skip


def quota(limit: int) -> None:
    chunk = 64 << 20
    held: list[Any] = []
    try:
        while True:
            held.append(cuda.device_array(chunk, dtype=np.uint8))
            if len(held) * chunk > 2 * limit + (1 << 30):
                print("quota not enforced")
                sys.exit(3)
    except CudaAPIError as e:
        print(f"oom after {len(held)} arrays: {e}")
        assert "CUDA_ERROR_OUT_OF_MEMORY" in str(e), e
    # The program goes on: freeing one array makes room for another.
    held.pop()
    held.append(cuda.device_array(chunk, dtype=np.uint8))
    print(f"allocated={len(held) * chunk}")


def compute(seconds: float) -> None:
    d = cuda.device_array(1024, dtype=np.float32)
    for _ in range(20):  # warm-up: compilation and the controller's first window
        sim_2000us[132, 128](d)
    cuda.synchronize()
    n = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        sim_2000us[132, 128](d)
        n += 1
    cuda.synchronize()
    wall = time.monotonic() - t0
    print(f"share={100.0 * n * 0.002 / wall:.1f} launches={n} wall={wall:.2f}")


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "basic":
        basic()
    elif mode == "quota":
        quota(int(sys.argv[2]))
    else:
        compute(float(sys.argv[2]))

"""A small CUDA program for the demo, written against the driver API through ctypes.

It is an ordinary CUDA client: it loads libcuda.so.1 and resolves each function with dlsym, as
frameworks do, so under the shim it exercises the dlopen+dlsym interception route. It reports what
it sees as JSON lines on stdout for the demo to display.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from typing import Any

from sharing.observe.cpuwait import cpu_wait_ns

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
MIB = 1 << 20
# The share is judged over the phase after this fraction of it (the steady state).
STEADY_AFTER = 0.25


class CudaError(RuntimeError):
    pass


class Cuda:
    """The few driver calls the demo needs, with errors turned into exceptions."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def call(self, name: str, *args: Any) -> int:
        rc = int(getattr(self.lib, name)(*args))
        return rc

    def check(self, name: str, *args: Any) -> None:
        rc = self.call(name, *args)
        if rc != CUDA_SUCCESS:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(msg))
            text = msg.value.decode() if msg.value else "unknown error"
            raise CudaError(f"{name} failed: {text} ({rc})")


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def run(chunk_mib: int, max_chunks: int, kernel: str, seconds: float) -> int:
    cu = Cuda()
    cu.check("cuInit", 0)
    dev = ctypes.c_int()
    cu.check("cuDeviceGet", ctypes.byref(dev), 0)
    ctx = ctypes.c_void_p()
    cu.check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    cu.check("cuCtxSetCurrent", ctx)

    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    cu.check("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
    emit("meminfo", total=total.value, free=free.value)

    # Allocate in chunks until the driver (or the shim) says no.
    ptrs: list[ctypes.c_uint64] = []
    denied = False
    for _ in range(max_chunks):
        p = ctypes.c_uint64()
        rc = cu.call("cuMemAlloc_v2", ctypes.byref(p), ctypes.c_size_t(chunk_mib * MIB))
        if rc == CUDA_ERROR_OUT_OF_MEMORY:
            denied = True
            break
        if rc != CUDA_SUCCESS:
            raise CudaError(f"cuMemAlloc_v2 failed ({rc})")
        ptrs.append(p)
    emit("alloc", granted=len(ptrs), chunk=chunk_mib * MIB, denied=denied)
    for p in ptrs:
        cu.check("cuMemFree_v2", p)

    sms = ctypes.c_int()
    cu.check(
        "cuDeviceGetAttribute", ctypes.byref(sms), CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev
    )
    mod = ctypes.c_void_p()
    image = ctypes.create_string_buffer(b"demo module")
    cu.check("cuModuleLoadData", ctypes.byref(mod), image)
    fn = ctypes.c_void_p()
    cu.check("cuModuleGetFunction", ctypes.byref(fn), mod, kernel.encode())
    launches = 0
    waited = cpu_wait_ns()
    start = time.monotonic()
    deadline = start + seconds
    # The steady state starts at the first synchronisation after the first quarter: before it
    # the cap lets a slice run its burst ahead and learns each kernel's cost (docs/compute.md).
    steady_from = start + seconds * STEADY_AFTER
    steady: tuple[int, float, int] | None = None
    while time.monotonic() < deadline:
        # One wave of `sms` blocks: the kernel's nominal device time per launch.
        cu.check("cuLaunchKernel", fn, sms.value, 1, 1, 128, 1, 1, 0, None, None, None)
        launches += 1
        if launches % 8 == 0:
            cu.check("cuCtxSynchronize")
            now = time.monotonic()
            if steady is None and now >= steady_from:
                steady = (launches, now, cpu_wait_ns())
    cu.check("cuCtxSynchronize")
    end = time.monotonic()
    s_launches, s_start, s_waited = steady if steady is not None else (0, end, cpu_wait_ns())
    emit(
        "done",
        launches=launches,
        seconds=end - start,
        cpu_wait_seconds=(cpu_wait_ns() - waited) / 1e9,
        steady_launches=launches - s_launches,
        steady_seconds=end - s_start,
        steady_cpu_wait_seconds=(cpu_wait_ns() - s_waited) / 1e9,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vgpu-demo-workload")
    p.add_argument("--chunk-mib", type=int, default=1024)
    p.add_argument("--max-chunks", type=int, default=64)
    p.add_argument("--kernel", default="sim_1000us")
    p.add_argument("--seconds", type=float, default=5.0)
    a = p.parse_args(argv)
    try:
        return run(a.chunk_mib, a.max_chunks, a.kernel, a.seconds)
    except (CudaError, OSError, AttributeError) as e:
        emit("error", message=str(e))
        print(f"demo workload: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

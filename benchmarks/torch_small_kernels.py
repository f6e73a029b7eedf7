"""A PyTorch loop of small kernels with allocations through the caching allocator, timed; run by
benchmarks/bench_torch.py with .venv/frameworks' interpreter, with and without the shim.

    torch_small_kernels.py ITERATIONS [CALLGRIND_TOGGLE_LIB]

Each iteration takes two tensors from the caching allocator (four sizes in turn, 4 to 64 KiB),
runs an elementwise kernel on them (one wave: 10 us of simulated device time, well under the
host's time per iteration, so a 90% cap does not bind) and frees them;
every 500 iterations empty_cache() hands the segments back, so the allocator goes to the driver
(cuMemAlloc/cuMemFree, the shim's quota accounting) again. After a warm-up of the same length it
prints the host CPU time and the wall time per iteration of the measured run.

Under `valgrind --tool=callgrind --instr-atstart=no`, CALLGRIND_TOGGLE_LIB (benchmarks/c/
callgrind_toggle.c, built by bench_torch.py) switches callgrind's instrumentation on for the
measured run only, so the instruction count is the loop's, not torch's start-up.
"""

from __future__ import annotations

import ctypes
import sys
import time

import torch

SIZES = (1024, 4096, 8192, 16384)  # floats


def loop(n: int) -> None:
    for i in range(n):
        a = torch.empty(SIZES[i % 4], device="cuda")
        b = torch.empty(SIZES[(i + 1) % 4], device="cuda")
        a[: b.numel()].add_(b[: a.numel()])
        del a, b
        if i % 500 == 499:
            torch.cuda.empty_cache()
    torch.cuda.synchronize()


def main() -> None:
    n = int(sys.argv[1])
    toggle = ctypes.CDLL(sys.argv[2]) if len(sys.argv) > 2 else None
    loop(n)
    if toggle is not None:
        toggle.cg_start()
    c0, w0 = time.process_time_ns(), time.monotonic_ns()
    loop(n)
    c1, w1 = time.process_time_ns(), time.monotonic_ns()
    if toggle is not None:
        toggle.cg_stop()
    print(f"cpu_ns_per_iter={(c1 - c0) / n:.1f} wall_ns_per_iter={(w1 - w0) / n:.1f}", flush=True)


if __name__ == "__main__":
    main()

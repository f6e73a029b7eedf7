/*
 * Micro-benchmarks of the shim's added cost (benchmarks/bench_shim_memory.py runs it with and
 * without libvgpu.so preloaded, under the clock and under callgrind).
 *
 *   shim_bench pair N      N x (cuMemAlloc_v2(4096) + cuMemFree_v2)
 *   shim_bench getinfo N   N x cuMemGetInfo_v2
 *   shim_bench unhooked N  N x cuCtxGetDevice (not hooked: bound straight to the driver)
 *   shim_bench init        one cuInit (startup): prints its wall time
 *   shim_bench big N [H]   N x (cuMemAlloc_v2(2 MiB) + cuMemFree_v2) while holding H MiB allocated
 *                          (in 2 MiB allocations) before the loop (a page of its own each time: every pair is charged;
 *                          benchmarks/bench_burst.py holds the request, so each pair borrows)
 *
 * The measured loop is bench_loop() (noinline) so callgrind can collect it alone
 * (--toggle-collect=bench_loop). Prints "ns_per_op=<float>".
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "vgpu/cuda_api.h"

static int mode;

__attribute__((noinline)) static long bench_loop(long n) {
    long bad = 0;
    for (long i = 0; i < n; i++) {
        if (mode == 0 || mode == 3) {
            CUdeviceptr p;
            bad += cuMemAlloc_v2(&p, mode == 0 ? 4096 : 2 << 20) != CUDA_SUCCESS;
            bad += cuMemFree_v2(p) != CUDA_SUCCESS;
        } else if (mode == 1) {
            size_t f, t;
            bad += cuMemGetInfo_v2(&f, &t) != CUDA_SUCCESS;
        } else {
            CUdevice d;
            bad += cuCtxGetDevice(&d) != CUDA_SUCCESS;
        }
    }
    return bad;
}

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    double t0 = now_ns();
    if (cuInit(0) != CUDA_SUCCESS) return 3;
    double t_init = now_ns() - t0;
    if (!strcmp(argv[1], "init")) {
        printf("init_ns=%.0f\n", t_init);
        return 0;
    }
    mode = !strcmp(argv[1], "pair") ? 0 : !strcmp(argv[1], "getinfo") ? 1 : !strcmp(argv[1], "big") ? 3 : 2;
    long n = argc > 2 ? atol(argv[2]) : 100000;
    CUdevice d;
    CUcontext c;
    if (cuDeviceGet(&d, 0) || cuDevicePrimaryCtxRetain(&c, d) || cuCtxSetCurrent(c)) return 4;
    long held = mode == 3 && argc > 3 ? atol(argv[3]) : 0;
    for (long i = 0; i < held / 2; i++) {
        CUdeviceptr p;
        if (cuMemAlloc_v2(&p, 2 << 20) != CUDA_SUCCESS) return 6; /* kept until exit */
    }
    bench_loop(n / 10 + 1); /* warm up */
    t0 = now_ns();
    long bad = bench_loop(n);
    double t = now_ns() - t0;
    if (bad) return 5;
    printf("ns_per_op=%.1f\n", t / (double)n);
    return 0;
}

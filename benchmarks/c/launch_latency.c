/*
 * Host time of one cuLaunchKernel call, for benchmarks/bench_compute.py (group "latency"): the
 * wall time from the return of one launch to the return of the next, in a tight loop of a 1 us
 * kernel on a stream of its own (a launch-bound program: the device idles between kernels, so
 * this host time is what sets its share). A warm-up first, long enough for the shim to learn the
 * kernel, then N timed launches.
 *
 *   launch_latency N [kernel]
 *
 * Output (one line, key=value, nanoseconds): p50= p90= p99= mean= n=
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "vgpu/cuda_api.h"

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 200000;
    const char *kernel = argc > 2 ? argv[2] : "sim_1us";
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    CUstream s;
    long long *t = n > 0 ? malloc(sizeof *t * (size_t)n) : NULL;
    if (!t || cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx) ||
        cuModuleLoadData(&mod, "simgpu-module") || cuModuleGetFunction(&fn, mod, kernel) ||
        cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)) {
        fprintf(stderr, "launch_latency: setup failed\n");
        return 2;
    }
    for (long i = 0; i < n / 2 + 1000; i++) /* warm-up: the shim learns the kernel's cost */
        if (cuLaunchKernel(fn, 1, 1, 1, 128, 1, 1, 0, s, NULL, NULL)) return 2;
    if (cuCtxSynchronize()) return 2;
    long long prev = now_ns();
    for (long i = 0; i < n; i++) {
        if (cuLaunchKernel(fn, 1, 1, 1, 128, 1, 1, 0, s, NULL, NULL)) {
            fprintf(stderr, "launch_latency: launch failed\n");
            return 2;
        }
        long long x = now_ns();
        t[i] = x - prev;
        prev = x;
    }
    if (cuCtxSynchronize()) return 2;
    double sum = 0;
    for (long i = 0; i < n; i++) sum += (double)t[i];
    qsort(t, (size_t)n, sizeof *t, cmp);
    printf("p50=%lld p90=%lld p99=%lld mean=%.1f n=%ld\n", t[n / 2], t[n * 9 / 10], t[n * 99 / 100], sum / (double)n,
           n);
    free(t);
    return 0;
}

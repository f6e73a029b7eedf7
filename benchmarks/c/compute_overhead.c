/*
 * Launch overhead probe for benchmarks/bench_compute.py: N launches of a 1 us kernel, then one
 * synchronisation. Run under `valgrind --tool=callgrind` with and without the shim, at two values
 * of N: the difference of the instruction counts divided by the difference of N is the cost of
 * one cuLaunchKernel (start-up cancels out).
 *
 *   compute_overhead N
 */
#include <stdio.h>
#include <stdlib.h>

#include "vgpu/cuda_api.h"

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000;
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx) ||
        cuModuleLoadData(&mod, "simgpu-module") || cuModuleGetFunction(&fn, mod, "sim_1us")) {
        fprintf(stderr, "setup failed\n");
        return 2;
    }
    for (long i = 0; i < n; i++)
        if (cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL) != CUDA_SUCCESS) {
            fprintf(stderr, "launch failed\n");
            return 2;
        }
    return cuCtxSynchronize() == CUDA_SUCCESS ? 0 : 2;
}

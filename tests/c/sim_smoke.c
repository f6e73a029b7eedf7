/* Core smoke test of the simulated libcuda: init, device, context, memory, copies, launches. */
#include <string.h>

#include "sim_common.h"

int main(void) {
    CHECK(cuInit(0));
    int n;
    CHECK(cuDeviceGetCount(&n));
    EXPECT(n >= 1);
    CUdevice dev;
    CHECK(cuDeviceGet(&dev, 0));
    char name[128];
    CHECK(cuDeviceGetName(name, sizeof name, dev));
    size_t total;
    CHECK(cuDeviceTotalMem_v2(&total, dev));
    int sms;
    CHECK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
    printf("device %s total=%zu sms=%d\n", name, total, sms);
    CUcontext ctx;
    CHECK(cuCtxCreate_v4(&ctx, NULL, 0, dev));
    size_t fr, tot;
    CHECK(cuMemGetInfo_v2(&fr, &tot));
    CUdeviceptr p;
    CHECK(cuMemAlloc_v2(&p, 1000));
    size_t fr2;
    CHECK(cuMemGetInfo_v2(&fr2, &tot));
    printf("free %zu -> %zu (delta %zu)\n", fr, fr2, fr - fr2);
    EXPECT(fr - fr2 == 1024);
    char buf[1000], out[1000];
    for (int i = 0; i < 1000; i++) buf[i] = (char)i;
    CHECK(cuMemcpyHtoD_v2(p, buf, sizeof buf));
    CHECK(cuMemcpyDtoH_v2(out, p, sizeof out));
    EXPECT(memcmp(buf, out, sizeof buf) == 0);
    printf("roundtrip %zu bytes\n", sizeof buf);
    CUmodule m;
    CHECK(cuModuleLoadData(&m, "x"));
    CUfunction f;
    CHECK(cuModuleGetFunction(&f, m, "sim_1000us"));
    double t0 = now_s();
    for (int i = 0; i < 100; i++) CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    double t1 = now_s();
    CHECK(cuCtxSynchronize());
    double t2 = now_s();
    /* tests/sim/test_cuda_api.py checks the total against the device time (100 ms, or 100 draws
     * of the default 20% spread): a lower bound, which no host load can break */
    printf("100 x 1ms launches: enqueue %.1f ms, total %.1f ms\n", (t1 - t0) * 1e3, (t2 - t0) * 1e3);
    CHECK(cuMemFree_v2(p));
    CHECK(cuCtxDestroy_v2(ctx));
    printf("OK\n");
    return 0;
}

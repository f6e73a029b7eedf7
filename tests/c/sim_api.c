/*
 * The simulated libcuda's API surface in one process: devices, contexts, memory and its
 * accounting, copies, pools, VMM, arrays, modules, launches and the timeline, streams, events,
 * graphs, cuGetProcAddress (every row of vgpu/cuda_procaddr.def), error strings, and that bad
 * arguments are errors, never crashes. Prints "OK" at the end; any failure exits non-zero with
 * the line. Assumes the default device (one H100 80GB, 132 SMs) and SIMGPU_CONTEXT_MEMORY=0.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "sim_common.h"

#define GiB (1ull << 30)
#define MiB (1ull << 20)

static size_t free_mem(void) {
    size_t f, t;
    CHECK(cuMemGetInfo_v2(&f, &t));
    return f;
}

static void test_before_init(void) {
    int v = 0;
    CUdevice d;
    CUcontext c;
    EXPECT_RC(cuDeviceGet(&d, 0), CUDA_ERROR_NOT_INITIALIZED);
    EXPECT_RC(cuCtxGetCurrent(&c), CUDA_ERROR_NOT_INITIALIZED);
    CHECK(cuDriverGetVersion(&v));
    EXPECT(v >= 12000);
    EXPECT_RC(cuInit(1), CUDA_ERROR_INVALID_VALUE);
    void *fn = NULL; /* cuGetProcAddress works before cuInit: the runtime fetches cuInit with it */
    CHECK(cuGetProcAddress_v2("cuInit", &fn, 12000, 0, NULL));
    EXPECT(fn != NULL);
}

static void test_device(void) {
    int n, v, major, minor;
    CUdevice dev;
    CHECK(cuDeviceGetCount(&n));
    EXPECT(n == 1);
    EXPECT_RC(cuDeviceGet(&dev, 1), CUDA_ERROR_INVALID_DEVICE);
    EXPECT_RC(cuDeviceGet(NULL, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuDeviceGet(&dev, 0));
    char name[64];
    CHECK(cuDeviceGetName(name, sizeof name, dev));
    EXPECT(strcmp(name, "NVIDIA H100 80GB HBM3") == 0);
    EXPECT_RC(cuDeviceGetName(NULL, 10, dev), CUDA_ERROR_INVALID_VALUE);
    size_t total;
    CHECK(cuDeviceTotalMem_v2(&total, dev));
    EXPECT(total == 80 * GiB);
    unsigned int total32;
    CHECK(cuDeviceTotalMem(&total32, dev));
    EXPECT(total32 == 0xffffffffu);
    CHECK(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
    EXPECT(v == 132);
    CHECK(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
    CHECK(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
    EXPECT(major == 9 && minor == 0);
    CHECK(cuDeviceComputeCapability(&major, &minor, dev));
    EXPECT(major == 9 && minor == 0);
    EXPECT_RC(cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MAX, dev), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuDeviceGetAttribute(NULL, CU_DEVICE_ATTRIBUTE_WARP_SIZE, dev), CUDA_ERROR_INVALID_VALUE);
    char bus[32];
    CHECK(cuDeviceGetPCIBusId(bus, sizeof bus, dev));
    EXPECT(strcmp(bus, "0000:18:00.0") == 0);
    CUdevice d2 = -1;
    CHECK(cuDeviceGetByPCIBusId(&d2, "00000000:18:00.0"));
    EXPECT(d2 == 0);
    EXPECT_RC(cuDeviceGetByPCIBusId(&d2, "0000:99:00.0"), CUDA_ERROR_INVALID_DEVICE);
    CUuuid u;
    CHECK(cuDeviceGetUuid_v2(&u, dev));
    EXPECT((unsigned char)u.bytes[0] == 0x5a && (unsigned char)u.bytes[1] == 0x1d);
    EXPECT_RC(cuDeviceGetUuid(NULL, dev), CUDA_ERROR_INVALID_VALUE);
}

static void test_contexts(void) {
    CUdevice dev = 0;
    CUcontext cur = (CUcontext)1, a, b, p1, p2;
    CHECK(cuCtxGetCurrent(&cur));
    EXPECT(cur == NULL);
    size_t f, t;
    EXPECT_RC(cuMemGetInfo_v2(&f, &t), CUDA_ERROR_INVALID_CONTEXT);
    CUdeviceptr x;
    EXPECT_RC(cuMemAlloc_v2(&x, 16), CUDA_ERROR_INVALID_CONTEXT);
    CHECK(cuCtxCreate_v4(&a, NULL, 0, dev));
    CHECK(cuCtxGetCurrent(&cur));
    EXPECT(cur == a);
    CHECK(cuCtxCreate_v2(&b, 0, dev));
    CHECK(cuCtxGetCurrent(&cur));
    EXPECT(cur == b);
    CHECK(cuCtxPopCurrent_v2(&cur));
    EXPECT(cur == b);
    CHECK(cuCtxGetCurrent(&cur));
    EXPECT(cur == a);
    CHECK(cuCtxPushCurrent_v2(b));
    CUdevice d = -1;
    CHECK(cuCtxGetDevice(&d));
    EXPECT(d == 0);
    CHECK(cuCtxGetDevice_v2(&d, a));
    CHECK(cuCtxDestroy_v2(b));
    CHECK(cuCtxGetCurrent(&cur));
    EXPECT(cur == a);
    EXPECT_RC(cuCtxDestroy_v2(b), CUDA_ERROR_INVALID_CONTEXT);
    EXPECT_RC(cuCtxPushCurrent_v2(b), CUDA_ERROR_INVALID_CONTEXT);
    EXPECT_RC(cuCtxCreate_v4(NULL, NULL, 0, dev), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuCtxCreate_v2(&b, 0, 7), CUDA_ERROR_INVALID_DEVICE);
    /* memory of a destroyed context returns */
    size_t before = free_mem();
    CUcontext c3;
    CHECK(cuCtxCreate_v3(&c3, NULL, 0, 0, dev));
    CUdeviceptr q;
    CHECK(cuMemAlloc_v2(&q, 5 * GiB));
    EXPECT(free_mem() == before - 5 * GiB);
    CHECK(cuCtxDestroy_v2(c3));
    EXPECT(free_mem() == before);
    CHECK(cuCtxDestroy_v2(a));
    /* primary context: retain/release counting, reset */
    CHECK(cuDevicePrimaryCtxRetain(&p1, dev));
    CHECK(cuDevicePrimaryCtxRetain(&p2, dev));
    EXPECT(p1 == p2);
    unsigned flags;
    int active;
    CHECK(cuDevicePrimaryCtxGetState(dev, &flags, &active));
    EXPECT(active == 1);
    CHECK(cuCtxSetCurrent(p1));
    CHECK(cuDevicePrimaryCtxRelease_v2(dev));
    CHECK(cuDevicePrimaryCtxGetState(dev, &flags, &active));
    EXPECT(active == 1);
    CHECK(cuDevicePrimaryCtxSetFlags_v2(dev, 0x4));
    CHECK(cuDevicePrimaryCtxGetState(dev, &flags, &active));
    EXPECT(flags == 0x4);
    EXPECT_RC(cuDevicePrimaryCtxSetFlags_v2(dev, 0x1000), CUDA_ERROR_INVALID_VALUE);
}

static void test_memory(void) {
    size_t f0 = free_mem();
    CUdeviceptr p, q;
    CHECK(cuMemAlloc_v2(&p, 1));
    EXPECT(f0 - free_mem() == 512); /* charged in 512-byte units */
    EXPECT(p % 256 == 0);
    CHECK(cuMemAlloc_v2(&q, 513));
    EXPECT(f0 - free_mem() == 512 + 1024);
    CHECK(cuMemFree_v2(p));
    CHECK(cuMemFree_v2(q));
    EXPECT(free_mem() == f0);
    EXPECT_RC(cuMemAlloc_v2(&p, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuMemAlloc_v2(NULL, 16), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuMemAlloc_v2(&p, 81 * GiB), CUDA_ERROR_OUT_OF_MEMORY);
    EXPECT_RC(cuMemFree_v2(0x1234), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuMemFree_v2(0), CUDA_SUCCESS); /* free(NULL): the runtime's cudaFree(0) */
    /* OOM exactly at the pool size, within one 512-byte granule */
    CHECK(cuMemAlloc_v2(&p, f0 - 512));
    EXPECT(free_mem() == 512);
    EXPECT_RC(cuMemAlloc_v2(&q, 513), CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(cuMemAlloc_v2(&q, 512));
    EXPECT(free_mem() == 0);
    CHECK(cuMemFree_v2(q));
    /* an 80 GiB device on a small machine: the memory is committed lazily */
    char *host = (char *)(uintptr_t)p;
    (void)host;
    CHECK(cuMemsetD8_v2(p + f0 - 512 - 4096, 0x5a, 4096));
    unsigned char tail[16];
    CHECK(cuMemcpyDtoH_v2(tail, p + f0 - 512 - 16, 16));
    EXPECT(tail[15] == 0x5a);
    CHECK(cuMemFree_v2(p));
    EXPECT(free_mem() == f0);
    /* legacy 32-bit ABI */
    CUdeviceptr_v1 p32;
    unsigned int fr32, tot32;
    CHECK(cuMemAlloc(&p32, 4096));
    EXPECT(p32 != 0);
    CHECK(cuMemGetInfo(&fr32, &tot32));
    EXPECT(tot32 == 0xffffffffu);
    CUdeviceptr_v1 b32;
    unsigned int s32;
    CHECK(cuMemGetAddressRange(&b32, &s32, p32 + 10));
    EXPECT(b32 == p32 && s32 == 4096);
    CHECK(cuMemsetD32(p32, 0xdeadbeef, 1024));
    unsigned int w;
    CHECK(cuMemcpyDtoH(&w, p32 + 8, 4));
    EXPECT(w == 0xdeadbeef);
    CHECK(cuMemFree(p32));
    unsigned int pitch32;
    CHECK(cuMemAllocPitch(&p32, &pitch32, 100, 10, 4));
    EXPECT(pitch32 == 512);
    CHECK(cuMemFree(p32));
    /* pitch, managed, host */
    size_t pitch;
    CHECK(cuMemAllocPitch_v2(&p, &pitch, 1000, 3, 8));
    EXPECT(pitch == 1024);
    EXPECT(f0 - free_mem() == 3072);
    CHECK(cuMemFree_v2(p));
    EXPECT_RC(cuMemAllocPitch_v2(&p, &pitch, 1000, 3, 3), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemAllocManaged(&p, 1 * MiB, CU_MEM_ATTACH_GLOBAL));
    EXPECT(f0 - free_mem() == 1 * MiB);
    CHECK(cuMemFree_v2(p));
    EXPECT_RC(cuMemAllocManaged(&p, 16, 7), CUDA_ERROR_INVALID_VALUE);
    void *h;
    CHECK(cuMemAllocHost_v2(&h, 1 * MiB));
    EXPECT(free_mem() == f0); /* pinned host memory is not device memory */
    memset(h, 1, 1 * MiB);
    EXPECT_RC(cuMemFree_v2((CUdeviceptr)(uintptr_t)h), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemFreeHost(h));
    EXPECT_RC(cuMemFreeHost(h), CUDA_ERROR_INVALID_VALUE);
    /* queries */
    CHECK(cuMemAlloc_v2(&p, 10000));
    CUdeviceptr base;
    size_t size;
    CHECK(cuMemGetAddressRange_v2(&base, &size, p + 9999));
    EXPECT(base == p && size == 10000);
    EXPECT_RC(cuMemGetAddressRange_v2(&base, &size, p + 10000 + 1 * GiB), CUDA_ERROR_NOT_FOUND);
    unsigned int mt = 0;
    CHECK(cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p + 5));
    EXPECT(mt == CU_MEMORYTYPE_DEVICE);
    int ord = -1;
    CHECK(cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p));
    EXPECT(ord == 0);
    EXPECT_RC(cuPointerGetAttribute(NULL, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemFree_v2(p));
    EXPECT_RC(cuMemGetInfo_v2(NULL, &size), CUDA_ERROR_INVALID_VALUE);
}

static void test_copies(void) {
    enum { N = 1 << 20 };
    unsigned char *a = malloc(N), *b = malloc(N);
    for (int i = 0; i < N; i++) a[i] = (unsigned char)(i * 7 + 3);
    CUdeviceptr d1, d2;
    CHECK(cuMemAlloc_v2(&d1, N));
    CHECK(cuMemAlloc_v2(&d2, N));
    CHECK(cuMemcpyHtoD_v2(d1, a, N));
    CHECK(cuMemcpyDtoD_v2(d2, d1, N));
    memset(b, 0, N);
    CHECK(cuMemcpyDtoH_v2(b, d2, N));
    EXPECT(memcmp(a, b, N) == 0);
    CUstream s;
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    memset(b, 0, N);
    CHECK(cuMemcpyHtoDAsync_v2(d1, a + 1, N - 1, s));
    CHECK(cuMemcpyDtoDAsync_v2(d2, d1, N - 1, s));
    CHECK(cuMemcpyDtoHAsync_v2(b, d2, N - 1, s));
    CHECK(cuStreamSynchronize(s));
    EXPECT(memcmp(a + 1, b, N - 1) == 0);
    CHECK(cuMemcpyHtoD_v2_ptds(d1, a, 100));
    CHECK(cuMemcpyDtoH_v2_ptds(b, d1, 100));
    EXPECT(memcmp(a, b, 100) == 0);
    CHECK(cuMemcpyHtoDAsync_v2_ptsz(d1, a, 100, NULL));
    CHECK(cuMemcpyDtoHAsync_v2_ptsz(b, d1, 100, CU_STREAM_PER_THREAD));
    CHECK(cuStreamSynchronize_ptsz(NULL));
    /* unified copies with host pointers */
    CHECK(cuMemcpy((CUdeviceptr)(uintptr_t)b, d1, 64));
    EXPECT(memcmp(a, b, 64) == 0);
    CHECK(cuMemcpyAsync(d2, (CUdeviceptr)(uintptr_t)a, 64, s));
    /* memsets */
    CHECK(cuMemsetD8_v2(d1, 0xab, N));
    CHECK(cuMemcpyDtoH_v2(b, d1, N));
    EXPECT(b[0] == 0xab && b[N - 1] == 0xab);
    CHECK(cuMemsetD32Async(d1, 0x01020304, N / 4, s));
    CHECK(cuStreamSynchronize(s));
    uint32_t w;
    CHECK(cuMemcpyDtoH_v2(&w, d1 + N - 4, 4));
    EXPECT(w == 0x01020304);
    EXPECT_RC(cuMemsetD32_v2(d1 + 1, 0, 4), CUDA_ERROR_INVALID_VALUE);
    /* bad ranges are errors, not crashes */
    EXPECT_RC(cuMemcpyHtoD_v2(d1 + 1, a, N), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuMemcpyDtoH_v2(b, 0x10, 16), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuMemcpyHtoD_v2(d1, NULL, 16), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuMemsetD8_v2(d1, 0, N + 1), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuMemcpy(d1 + N - 8, (CUdeviceptr)(uintptr_t)a, 16), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemFree_v2(d1));
    EXPECT_RC(cuMemcpyDtoH_v2(b, d1, 16), CUDA_ERROR_INVALID_VALUE); /* freed */
    CHECK(cuMemFree_v2(d2));
    CHECK(cuStreamDestroy_v2(s));
    free(a);
    free(b);
}

static void test_pools(void) {
    size_t f0 = free_mem();
    CUmemoryPool def, cur;
    CHECK(cuDeviceGetDefaultMemPool(&def, 0));
    CHECK(cuDeviceGetMemPool(&cur, 0));
    EXPECT(def == cur);
    CUstream s;
    CHECK(cuStreamCreate(&s, 0));
    CUdeviceptr p;
    CHECK(cuMemAllocAsync(&p, 3 * MiB, s));
    EXPECT(f0 - free_mem() == 3 * MiB);
    CHECK(cuMemFreeAsync(p, s));
    EXPECT(f0 - free_mem() == 3 * MiB); /* still reserved by the pool */
    cuuint64_t v;
    CHECK(cuMemPoolGetAttribute(def, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &v));
    EXPECT(v == 3 * MiB);
    CHECK(cuMemPoolGetAttribute(def, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &v));
    EXPECT(v == 0);
    CUdeviceptr p2;
    CHECK(cuMemAllocAsync(&p2, 3 * MiB - 100, s)); /* reuses the free block */
    EXPECT(p2 == p);
    EXPECT(f0 - free_mem() == 3 * MiB);
    CHECK(cuMemFreeAsync(p2, s));
    CHECK(cuStreamSynchronize(s)); /* threshold 0: released at synchronisation */
    EXPECT(free_mem() == f0);
    /* a release threshold keeps memory across synchronisation; TrimTo releases it */
    v = 64 * MiB;
    CHECK(cuMemPoolSetAttribute(def, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &v));
    CHECK(cuMemAllocAsync(&p, 8 * MiB, s));
    CHECK(cuMemFreeAsync(p, s));
    CHECK(cuStreamSynchronize(s));
    EXPECT(f0 - free_mem() == 8 * MiB);
    CHECK(cuMemPoolTrimTo(def, 0));
    EXPECT(free_mem() == f0);
    v = 0;
    CHECK(cuMemPoolSetAttribute(def, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &v));
    EXPECT_RC(cuMemPoolSetAttribute(def, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &v), CUDA_ERROR_INVALID_VALUE);
    /* explicit pool */
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = 0;
    CUmemoryPool pool;
    CHECK(cuMemPoolCreate(&pool, &props));
    CHECK(cuMemAllocFromPoolAsync(&p, 1 * MiB, pool, s));
    CHECK(cuMemAllocFromPoolAsync_ptsz(&p2, 1 * MiB, pool, NULL));
    EXPECT(f0 - free_mem() == 2 * MiB);
    CHECK(cuMemFreeAsync(p, s));
    CHECK(cuMemFree_v2(p2)); /* a synchronous free of pool memory also returns it to the pool */
    CHECK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, &v));
    EXPECT(v == 2 * MiB);
    CHECK(cuMemPoolDestroy(pool));
    EXPECT(free_mem() == f0);
    EXPECT_RC(cuMemPoolDestroy(def), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuMemAllocFromPoolAsync(&p, 16, pool, s), CUDA_ERROR_INVALID_VALUE);
    props.location.id = 3;
    EXPECT_RC(cuMemPoolCreate(&pool, &props), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuMemPoolCreate(NULL, &props), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuStreamDestroy_v2(s));
}

static void test_vmm(void) {
    size_t f0 = free_mem();
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    size_t gran;
    /* the page size, SIMGPU_ALLOC_GRANULARITY (default 2 MiB, NVIDIA's) */
    const char *knob = getenv("SIMGPU_ALLOC_GRANULARITY");
    size_t page = knob ? (size_t)strtoull(knob, NULL, 10) : 2 * MiB;
    CHECK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    EXPECT(gran == page);
    CHECK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    EXPECT(gran == page);
    CUmemGenericAllocationHandle h;
    EXPECT_RC(cuMemCreate(&h, page + page / 2, &prop, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuMemCreate(&h, 4 * MiB, &prop, 0));
    EXPECT(f0 - free_mem() == 4 * MiB); /* charged at create */
    CUdeviceptr va;
    CHECK(cuMemAddressReserve(&va, 8 * MiB, 0, 0, 0));
    EXPECT(va % page == 0);
    CHECK(cuMemMap(va, 4 * MiB, 0, h, 0));
    CHECK(cuMemMap(va + 4 * MiB, 2 * MiB, 2 * MiB, h, 0));               /* aliases the second half */
    EXPECT_RC(cuMemMap(va, 2 * MiB, 0, h, 0), CUDA_ERROR_INVALID_VALUE); /* already mapped */
    unsigned char x = 7;
    EXPECT_RC(cuMemcpyHtoD_v2(va, &x, 1), CUDA_ERROR_INVALID_VALUE); /* no access yet */
    CUmemAccessDesc acc = {.location = {CU_MEM_LOCATION_TYPE_DEVICE, 0}, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CHECK(cuMemSetAccess(va, 6 * MiB, &acc, 1));
    x = 42;
    CHECK(cuMemcpyHtoD_v2(va + 2 * MiB + 5, &x, 1));
    unsigned char y = 0;
    CHECK(cuMemcpyDtoH_v2(&y, va + 4 * MiB + 5, 1));
    EXPECT(y == 42); /* both mappings see one physical allocation */
    CHECK(cuMemUnmap(va, 4 * MiB));
    EXPECT(f0 - free_mem() == 4 * MiB); /* unmapping does not release */
    CHECK(cuMemRelease(h));
    /* released but still mapped at va + 4 MiB: NVIDIA's driver frees at the last unmap */
    EXPECT(f0 - free_mem() == 4 * MiB);
    CHECK(cuMemcpyDtoH_v2(&y, va + 4 * MiB + 5, 1)); /* still mapped: pages live on */
    EXPECT(y == 42);
    EXPECT_RC(cuMemRelease(h), CUDA_ERROR_INVALID_VALUE);                /* released once is all */
    EXPECT_RC(cuMemMap(va, 2 * MiB, 0, h, 0), CUDA_ERROR_INVALID_VALUE); /* nor mapped again */
    CUmemGenericAllocationHandle again = 0;
    CHECK(cuMemRetainAllocationHandle(&again, (void *)(uintptr_t)(va + 4 * MiB + 5))); /* the mapping names it */
    EXPECT(again == h);
    CHECK(cuMemRelease(again));
    EXPECT(f0 - free_mem() == 4 * MiB);
    EXPECT_RC(cuMemUnmap(va + 4 * MiB, page), CUDA_ERROR_INVALID_VALUE); /* part of a mapping */
    EXPECT_RC(cuMemUnmap(va + 4 * MiB + page, 2 * MiB), CUDA_ERROR_INVALID_VALUE);
    EXPECT(f0 - free_mem() == 4 * MiB);
    CHECK(cuMemUnmap(va + 4 * MiB, 2 * MiB));
    EXPECT(free_mem() == f0); /* released and unmapped: freed */
    EXPECT_RC(cuMemUnmap(va, 2 * MiB), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuMemRelease(h), CUDA_ERROR_INVALID_VALUE);
    /* one unmap of a range holding several mappings of a released handle frees it */
    CHECK(cuMemCreate(&h, 2 * MiB, &prop, 0));
    CHECK(cuMemMap(va, 2 * MiB, 0, h, 0));
    CHECK(cuMemMap(va + 2 * MiB, 2 * MiB, 0, h, 0));
    CHECK(cuMemRelease(h));
    EXPECT(f0 - free_mem() == 2 * MiB);
    CHECK(cuMemUnmap(va, 4 * MiB));
    EXPECT(free_mem() == f0);
    /* cuMemAddressFree unmaps what is left, and so frees a released handle */
    CHECK(cuMemCreate(&h, 2 * MiB, &prop, 0));
    CHECK(cuMemMap(va + 6 * MiB, 2 * MiB, 0, h, 0));
    CHECK(cuMemRelease(h));
    EXPECT(f0 - free_mem() == 2 * MiB);
    CHECK(cuMemAddressFree(va, 8 * MiB));
    EXPECT(free_mem() == f0);
    EXPECT_RC(cuMemCreate(NULL, 2 * MiB, &prop, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuMemCreate(&h, 2 * MiB, NULL, 0), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuMemCreate(&h, 82 * GiB, &prop, 0), CUDA_ERROR_OUT_OF_MEMORY);
}

static void test_arrays(void) {
    size_t f0 = free_mem();
    CUDA_ARRAY_DESCRIPTOR d = {.Width = 1000, .Height = 1000, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 4};
    CUarray a;
    CHECK(cuArrayCreate_v2(&a, &d));
    /* pitch align(16000, 512) = 16384, * 1000 rows = 16384000, rounded to 2 MiB = 16777216 */
    EXPECT(f0 - free_mem() == 16777216);
    CHECK(cuArrayDestroy(a));
    EXPECT(free_mem() == f0);
    EXPECT_RC(cuArrayDestroy(a), CUDA_ERROR_INVALID_HANDLE);
    CUDA_ARRAY3D_DESCRIPTOR d3 = {
        .Width = 64, .Height = 64, .Depth = 64, .Format = CU_AD_FORMAT_UNSIGNED_INT8, .NumChannels = 1};
    CHECK(cuArray3DCreate_v2(&a, &d3));
    EXPECT(f0 - free_mem() == 2 * MiB); /* 512 * 64 * 64 = 2 MiB exactly */
    CHECK(cuArrayDestroy(a));
    CUDA_ARRAY_DESCRIPTOR_v1 d1 = {.Width = 16, .Height = 0, .Format = CU_AD_FORMAT_HALF, .NumChannels = 2};
    CHECK(cuArrayCreate(&a, &d1));
    CHECK(cuArrayDestroy(a));
    d.NumChannels = 3;
    EXPECT_RC(cuArrayCreate_v2(&a, &d), CUDA_ERROR_INVALID_VALUE);
    d3.Flags = CUDA_ARRAY3D_CUBEMAP;
    d3.Depth = 5;
    EXPECT_RC(cuArray3DCreate_v2(&a, &d3), CUDA_ERROR_INVALID_VALUE);
    CUmipmappedArray m;
    d3.Flags = 0;
    d3.Depth = 0;
    CHECK(cuMipmappedArrayCreate(&m, &d3, 7));
    CHECK(cuMipmappedArrayDestroy(m));
    EXPECT_RC(cuMipmappedArrayCreate(&m, &d3, 8), CUDA_ERROR_INVALID_VALUE);
    EXPECT(free_mem() == f0);
}

static CUfunction get_function(const char *name) {
    CUmodule m;
    CUfunction f, f2;
    CHECK(cuModuleLoadData(&m, "\x7f"
                               "ELF any image"));
    CHECK(cuModuleGetFunction(&f, m, name));
    CHECK(cuModuleGetFunction(&f2, m, name));
    EXPECT(f == f2);
    return f;
}

static void test_modules_and_launches(void) {
    CUfunction f = get_function("sim_2000us");
    CUfunction quick = get_function("anything_else");
    CUmodule m;
    EXPECT_RC(cuModuleLoad(&m, "/nonexistent/module.cubin"), CUDA_ERROR_FILE_NOT_FOUND);
    CHECK(cuModuleLoad(&m, "/proc/self/exe"));
    CHECK(cuModuleUnload(m));
    EXPECT_RC(cuModuleUnload(m), CUDA_ERROR_INVALID_HANDLE);
    EXPECT_RC(cuModuleLoadData(&m, NULL), CUDA_ERROR_INVALID_VALUE);
    CUlibrary lib;
    CUkernel k;
    CUfunction kf;
    CHECK(cuLibraryLoadData(&lib, "fatbin", NULL, NULL, 0, NULL, NULL, 0));
    CHECK(cuLibraryGetKernel(&k, lib, "_Z9sim_500usPf")); /* mangled name: 500 us */
    CHECK(cuKernelGetFunction(&kf, k));

    CUevent e0, e1;
    CHECK(cuEventCreate(&e0, 0));
    CHECK(cuEventCreate(&e1, 0));
    float ms;
    /* Each first event is recorded behind a 50 ms warm-up kernel, so it completes when the
     * warm-up does and the events span device time alone: recorded on an idle device it would
     * complete at once and also span the host's time until the launch (a loaded machine can
     * deschedule the thread for longer than the bounds allow). */
    CUfunction warm = get_function("sim_50000us");
    /* 264 blocks on 132 SMs = 2 waves of 2 ms */
    CHECK(cuLaunchKernel(warm, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    CHECK(cuEventRecord(e0, NULL));
    CHECK(cuLaunchKernel(f, 264, 1, 1, 128, 1, 1, 0, NULL, NULL, NULL));
    CHECK(cuEventRecord(e1, NULL));
    CHECK(cuEventSynchronize(e1));
    CHECK(cuEventElapsedTime_v2(&ms, e0, e1));
    EXPECT(ms > 3.99f && ms < 4.2f);
    /* 133 blocks: still 2 waves; a kernel launched as CUkernel (library) */
    CHECK(cuLaunchKernel(warm, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    CHECK(cuEventRecord(e0, NULL));
    CHECK(cuLaunchKernel((CUfunction)k, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    CHECK(cuLaunchKernel(kf, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    CHECK(cuLaunchKernel(quick, 133, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    CHECK(cuEventRecord(e1, NULL));
    CHECK(cuStreamSynchronize(NULL));
    CHECK(cuEventElapsedTime(&ms, e0, e1));
    EXPECT(ms > 1.019f && ms < 1.2f); /* 0.5 + 0.5 + 2 x 0.010 */
    /* launch config variants */
    CUlaunchAttribute attr;
    memset(&attr, 0, sizeof attr);
    attr.id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attr.value.cooperative = 1;
    CUlaunchConfig cfg = {.gridDimX = 132,
                          .gridDimY = 1,
                          .gridDimZ = 1,
                          .blockDimX = 1024,
                          .blockDimY = 1,
                          .blockDimZ = 1,
                          .hStream = NULL,
                          .attrs = &attr,
                          .numAttrs = 1};
    CHECK(cuLaunchKernelEx(&cfg, quick, NULL, NULL));
    CHECK(cuLaunchKernelEx_ptsz(&cfg, quick, NULL, NULL));
    cfg.gridDimX = 265;
    EXPECT_RC(cuLaunchKernelEx(&cfg, quick, NULL, NULL), CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE);
    EXPECT_RC(cuLaunchKernelEx(NULL, quick, NULL, NULL), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuLaunchCooperativeKernel(quick, 264, 1, 1, 1024, 1, 1, 0, NULL, NULL));
    EXPECT_RC(cuLaunchCooperativeKernel_ptsz(quick, 265, 1, 1, 1024, 1, 1, 0, NULL, NULL),
              CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE);
    CHECK(cuLaunchKernel_ptsz(quick, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
    EXPECT_RC(cuLaunchKernel(quick, 0, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuLaunchKernel(quick, 1, 1, 1, 1025, 1, 1, 0, NULL, NULL, NULL), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL), CUDA_ERROR_INVALID_HANDLE);
    CHECK(cuCtxSynchronize());
    CHECK(cuLibraryUnload(lib));
    EXPECT_RC(cuLaunchKernel(kf, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL), CUDA_ERROR_INVALID_HANDLE);

    /* streams: query, sync, waits, pacing */
    CUstream s1, s2;
    CHECK(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING));
    CHECK(cuStreamCreateWithPriority(&s2, 0, -3));
    CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s1, NULL, NULL));
    EXPECT_RC(cuStreamQuery(s1), CUDA_ERROR_NOT_READY);
    EXPECT_RC(cuEventQuery(e1), CUDA_SUCCESS);
    CHECK(cuEventRecord(e1, s1));
    EXPECT_RC(cuEventQuery(e1), CUDA_ERROR_NOT_READY);
    EXPECT_RC(cuEventElapsedTime(&ms, e0, e1), CUDA_ERROR_NOT_READY);
    CHECK(cuStreamWaitEvent(s2, e1, 0));
    CHECK(cuStreamSynchronize(s2)); /* s2 waits for s1's kernel through the event */
    EXPECT_RC(cuStreamQuery(s1), CUDA_SUCCESS);
    double t0 = now_s();
    for (int i = 0; i < 200; i++) /* 400 ms of work: the launch loop is paced by the device */
        CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s2, NULL, NULL));
    double t1 = now_s();
    EXPECT(t1 - t0 > 0.3);
    CHECK(cuStreamSynchronize(s2));
    double t2 = now_s();
    EXPECT(t2 - t0 > 0.399); /* a lower bound only: a loaded host can always take longer */
    CUevent nt;
    CHECK(cuEventCreate(&nt, CU_EVENT_DISABLE_TIMING));
    CHECK(cuEventRecord(nt, s2));
    EXPECT_RC(cuEventElapsedTime(&ms, e0, nt), CUDA_ERROR_INVALID_HANDLE);
    EXPECT_RC(cuEventCreate(&nt, 0x100), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuEventElapsedTime(NULL, e0, e1), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuEventDestroy_v2(nt));
    EXPECT_RC(cuEventRecord(nt, s2), CUDA_ERROR_INVALID_HANDLE);
    CHECK(cuStreamDestroy_v2(s1));
    CHECK(cuStreamDestroy_v2(s2));
    EXPECT_RC(cuStreamSynchronize(s1), CUDA_ERROR_INVALID_HANDLE);
    CHECK(cuEventDestroy_v2(e0));
    CHECK(cuEventDestroy(e1));
}

static void test_graphs(void) {
    CUfunction f = get_function("sim_1000us");
    CUstream s;
    CHECK(cuStreamCreate(&s, 0));
    CUdeviceptr d;
    CHECK(cuMemAlloc_v2(&d, 4096));
    CHECK(cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CUstreamCaptureStatus st;
    CHECK(cuStreamIsCapturing(s, &st));
    EXPECT(st == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    for (int i = 0; i < 5; i++) CHECK(cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL));
    CHECK(cuMemsetD32Async(d, 0x11223344, 1024, s));
    unsigned int host = 0;
    CHECK(cuMemcpyDtoHAsync_v2(&host, d + 8, 4, s));
    EXPECT(host == 0); /* captured, not run: the copy did not happen */
    EXPECT_RC(cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_ERROR_ILLEGAL_STATE);
    CUgraph g;
    CHECK(cuStreamEndCapture(s, &g));
    size_t n = 0;
    CHECK(cuGraphGetNodes(g, NULL, &n));
    EXPECT(n == 7);
    CUgraphNode nodes[8];
    n = 8;
    CHECK(cuGraphGetNodes(g, nodes, &n));
    EXPECT(n == 7 && nodes[7] == NULL);
    CUgraphExec ge;
    CHECK(cuGraphInstantiateWithFlags(&ge, g, 0));
    CUevent a, b;
    CHECK(cuEventCreate(&a, 0));
    CHECK(cuEventCreate(&b, 0));
    CHECK(cuLaunchKernel(get_function("sim_50000us"), 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL)); /* see above */
    CHECK(cuEventRecord(a, s));
    CHECK(cuGraphLaunch(ge, s));
    CHECK(cuGraphLaunch(ge, s));
    CHECK(cuEventRecord(b, s));
    CHECK(cuStreamSynchronize(s));
    float ms;
    CHECK(cuEventElapsedTime_v2(&ms, a, b));
    EXPECT(ms > 9.99f && ms < 10.5f); /* two launches of five 1 ms kernels, in order */
    EXPECT(host == 0x11223344);
    CUgraphExec ge2;
    char log[16] = "x";
    CHECK(cuGraphInstantiate(&ge2, g, NULL, log, sizeof log));
    EXPECT(log[0] == 0);
    CHECK(cuGraphLaunch_ptsz(ge2, NULL));
    CHECK(cuGraphExecDestroy(ge2));
    CHECK(cuGraphInstantiate_v2(&ge2, g, NULL, NULL, 0));
    CHECK(cuGraphExecDestroy(ge2));
    CHECK(cuGraphExecDestroy(ge));
    CHECK(cuGraphDestroy(g));
    /* synchronising a capturing stream invalidates the capture */
    CHECK(cuStreamBeginCapture_v2_ptsz(s, CU_STREAM_CAPTURE_MODE_RELAXED));
    EXPECT_RC(cuStreamSynchronize(s), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    EXPECT_RC(cuStreamEndCapture(s, &g), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    EXPECT(g == NULL);
    EXPECT_RC(cuStreamBeginCapture_v2(NULL, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    CHECK(cuStreamBeginCapture(s));
    CHECK(cuStreamEndCapture_ptsz(s, &g));
    CHECK(cuGraphDestroy(g));
    CHECK(cuGraphCreate(&g, 0));
    CHECK(cuGraphInstantiateWithFlags(&ge, g, 0));
    CHECK(cuGraphLaunch(ge, s)); /* empty graph */
    CHECK(cuGraphExecDestroy(ge));
    CHECK(cuGraphDestroy(g));
    EXPECT_RC(cuGraphCreate(&g, 1), CUDA_ERROR_INVALID_VALUE);
    /* a graph whose memory was freed since capture fails instead of writing freed memory */
    CHECK(cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CHECK(cuMemsetD8Async(d, 1, 16, s));
    CHECK(cuStreamEndCapture(s, &g));
    CHECK(cuGraphInstantiateWithFlags(&ge, g, 0));
    CHECK(cuMemFree_v2(d));
    EXPECT_RC(cuGraphLaunch(ge, s), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuGraphExecDestroy(ge));
    CHECK(cuGraphDestroy(g));
    /* destroyed graphs are invalid handles, not freed memory */
    EXPECT_RC(cuGraphLaunch(ge, s), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuGraphExecDestroy(ge), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuGraphDestroy(g), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuGraphInstantiateWithFlags(&ge, g, 0), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuStreamDestroy_v2(s));
    CHECK(cuEventDestroy_v2(a));
    CHECK(cuEventDestroy_v2(b));
}

static void *lib_handle;

static void test_procaddr(void) {
    lib_handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    EXPECT(lib_handle != NULL);
    int rows = 0;
    const char *pa = getenv("SIMGPU_PROCADDR");
    int internal_off = pa && strcmp(pa, "exported") == 0;
    /* Every row: asking at exactly its version yields its symbol (or, with the per-thread flag,
     * its per-thread symbol); asking just below a later row of the same name still yields it. */
#define CU_PROC(b, v, s, p)                                                                                            \
    do {                                                                                                               \
        void *fn = NULL;                                                                                               \
        CUdriverProcAddressQueryResult qr = (CUdriverProcAddressQueryResult)99;                                        \
        CHECK(cuGetProcAddress_v2(#b, &fn, v, CU_GET_PROC_ADDRESS_DEFAULT, &qr));                                      \
        EXPECT(qr == CU_GET_PROC_ADDRESS_SUCCESS);                                                                     \
        EXPECT(fn != dlsym(lib_handle, #s) || internal_off); /* an internal entry point */                             \
        if (entry_target(fn) != dlsym(lib_handle, #s)) {                                                               \
            fprintf(stderr, "FAIL %s@%d -> not %s\n", #b, v, #s);                                                      \
            exit(1);                                                                                                   \
        }                                                                                                              \
        const char *pt = sizeof(#p) > 1 ? #p : #s;                                                                     \
        CHECK(cuGetProcAddress_v2(#b, &fn, v, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &qr));                    \
        if (entry_target(fn) != dlsym(lib_handle, pt)) {                                                               \
            fprintf(stderr, "FAIL %s@%d per-thread -> not %s\n", #b, v, pt);                                           \
            exit(1);                                                                                                   \
        }                                                                                                              \
        CHECK(cuGetProcAddress_v2(#b, &fn, v, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &qr));                                \
        EXPECT(entry_target(fn) == dlsym(lib_handle, #s));                                                             \
        CHECK(cuGetProcAddress(#b, &fn, v, 0));                                                                        \
        EXPECT(entry_target(fn) == dlsym(lib_handle, #s));                                                             \
        rows++;                                                                                                        \
    } while (0);
#include "vgpu/cuda_procaddr.def"
#undef CU_PROC
    printf("procaddr rows checked: %d\n", rows);
    EXPECT(rows > 150);
    void *fn = (void *)1;
    CUdriverProcAddressQueryResult qr;
    /* the highest row <= the version asked for */
    CHECK(cuGetProcAddress_v2("cuMemAlloc", &fn, 12080, 0, &qr));
    EXPECT(entry_target(fn) == dlsym(lib_handle, "cuMemAlloc_v2"));
    CHECK(cuGetProcAddress_v2("cuMemAlloc", &fn, 3010, 0, &qr));
    EXPECT(entry_target(fn) == dlsym(lib_handle, "cuMemAlloc"));
    CHECK(cuGetProcAddress_v2("cuCtxCreate", &fn, 12040, 0, &qr));
    EXPECT(entry_target(fn) == dlsym(lib_handle, "cuCtxCreate_v3"));
    CHECK(cuGetProcAddress_v2("cuGraphInstantiate", &fn, 12080, 0, &qr));
    EXPECT(entry_target(fn) == dlsym(lib_handle, "cuGraphInstantiateWithFlags"));
    CHECK(cuGetProcAddress_v2("cuLaunchKernel", &fn, 6050, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &qr));
    EXPECT(entry_target(fn) == dlsym(lib_handle, "cuLaunchKernel")); /* no per-thread form before CUDA 7.0 */
    CHECK(cuGetProcAddress_v2("cuLaunchKernel", &fn, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &qr));
    EXPECT(entry_target(fn) == dlsym(lib_handle, "cuLaunchKernel_ptsz"));
    CHECK(cuGetProcAddress_v2("cuMemcpyHtoD", &fn, 12000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &qr));
    EXPECT(entry_target(fn) == dlsym(lib_handle, "cuMemcpyHtoD_v2_ptds"));
    /* the returned pointer is callable */
    CUresult (*get_count)(int *) = NULL;
    CHECK(cuGetProcAddress_v2("cuDeviceGetCount", (void **)&get_count, 12000, 0, &qr));
    int n = 0;
    CHECK(get_count(&n));
    EXPECT(n == 1);
    /* too old a version for every row */
    fn = (void *)1;
    EXPECT_RC(cuGetProcAddress_v2("cuMemAllocAsync", &fn, 11010, 0, &qr), CUDA_ERROR_NOT_FOUND);
    EXPECT(qr == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT && fn == NULL);
    EXPECT_RC(cuGetProcAddress_v2("cuGetProcAddress", &fn, 11020, 0, &qr), CUDA_ERROR_NOT_FOUND);
    EXPECT(qr == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
    /* unknown names, and versioned names are not base names */
    EXPECT_RC(cuGetProcAddress_v2("cuNoSuchFunction", &fn, 12080, 0, &qr), CUDA_ERROR_NOT_FOUND);
    EXPECT(qr == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    EXPECT_RC(cuGetProcAddress_v2("cuMemAlloc_v2", &fn, 12080, 0, &qr), CUDA_ERROR_NOT_FOUND);
    EXPECT(qr == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    EXPECT_RC(cuGetProcAddress("cuNoSuchFunction", &fn, 12080, 0), CUDA_ERROR_NOT_FOUND);
    EXPECT_RC(cuGetProcAddress_v2(NULL, &fn, 12080, 0, &qr), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuGetProcAddress_v2("cuInit", NULL, 12080, 0, &qr), CUDA_ERROR_INVALID_VALUE);
    EXPECT_RC(cuGetProcAddress_v2("cuInit", &fn, 12080, 8, &qr), CUDA_ERROR_INVALID_VALUE);
    CHECK(cuGetProcAddress_v2("cuInit", &fn, 12080, 0, NULL)); /* status is optional */
}

/* NULL out-pointers (and required in-pointers) are CUDA_ERROR_INVALID_VALUE, never a crash. */
static void test_null_arguments(void) {
    const CUresult IV = CUDA_ERROR_INVALID_VALUE;
    CUstream s;
    CUevent e;
    CUgraph g;
    CUmodule m;
    CUlibrary l;
    CUdeviceptr p;
    CUmemoryPool pool;
    CHECK(cuStreamCreate(&s, 0));
    CHECK(cuEventCreate(&e, 0));
    CHECK(cuGraphCreate(&g, 0));
    CHECK(cuModuleLoadData(&m, "img"));
    CHECK(cuLibraryLoadData(&l, "img", NULL, NULL, 0, NULL, NULL, 0));
    EXPECT_RC(cuDriverGetVersion(NULL), IV);
    EXPECT_RC(cuDeviceGetCount(NULL), IV);
    EXPECT_RC(cuDeviceTotalMem_v2(NULL, 0), IV);
    EXPECT_RC(cuDeviceTotalMem(NULL, 0), IV);
    EXPECT_RC(cuDeviceComputeCapability(NULL, NULL, 0), IV);
    EXPECT_RC(cuDeviceGetPCIBusId(NULL, 13, 0), IV);
    EXPECT_RC(cuDeviceGetByPCIBusId(NULL, "0000:18:00.0"), IV);
    EXPECT_RC(cuDeviceGetByPCIBusId((CUdevice *)&p, NULL), IV);
    EXPECT_RC(cuDevicePrimaryCtxRetain(NULL, 0), IV);
    EXPECT_RC(cuDevicePrimaryCtxGetState(0, NULL, NULL), IV);
    EXPECT_RC(cuCtxGetCurrent(NULL), IV);
    EXPECT_RC(cuCtxGetDevice(NULL), IV);
    EXPECT_RC(cuCtxCreate_v3(NULL, NULL, 0, 0, 0), IV);
    EXPECT_RC(cuMemAlloc(NULL, 16), IV);
    EXPECT_RC(cuMemAllocPitch_v2(&p, NULL, 16, 16, 4), IV);
    EXPECT_RC(cuMemAllocManaged(NULL, 16, CU_MEM_ATTACH_GLOBAL), IV);
    EXPECT_RC(cuMemAllocHost_v2(NULL, 16), IV);
    EXPECT_RC(cuMemGetInfo(NULL, NULL), IV);
    EXPECT_RC(cuMemAllocAsync(NULL, 16, s), IV);
    EXPECT_RC(cuMemAllocFromPoolAsync(NULL, 16, NULL, s), IV);
    EXPECT_RC(cuDeviceGetDefaultMemPool(NULL, 0), IV);
    EXPECT_RC(cuDeviceGetMemPool(NULL, 0), IV);
    CHECK(cuDeviceGetDefaultMemPool(&pool, 0));
    EXPECT_RC(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, NULL), IV);
    EXPECT_RC(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, NULL), IV);
    EXPECT_RC(cuMemGetAllocationGranularity(NULL, NULL, CU_MEM_ALLOC_GRANULARITY_MINIMUM), IV);
    EXPECT_RC(cuMemAddressReserve(NULL, 2 << 20, 0, 0, 0), IV);
    EXPECT_RC(cuMemSetAccess(0, 2 << 20, NULL, 1), IV);
    EXPECT_RC(cuArrayCreate_v2(NULL, NULL), IV);
    EXPECT_RC(cuArray3DCreate_v2(NULL, NULL), IV);
    EXPECT_RC(cuMipmappedArrayCreate(NULL, NULL, 1), IV);
    EXPECT_RC(cuMemcpyDtoH_v2(NULL, 0, 16), IV);
    EXPECT_RC(cuModuleLoad(NULL, "/proc/self/exe"), IV);
    EXPECT_RC(cuModuleGetFunction(NULL, m, "f"), IV);
    EXPECT_RC(cuModuleGetFunction((CUfunction *)&p, m, NULL), IV);
    EXPECT_RC(cuModuleLoadDataEx(&m, "img", 1, NULL, NULL), IV);
    EXPECT_RC(cuLibraryLoadData(NULL, "img", NULL, NULL, 0, NULL, NULL, 0), IV);
    EXPECT_RC(cuLibraryGetKernel(NULL, l, "k"), IV);
    EXPECT_RC(cuKernelGetFunction(NULL, NULL), IV);
    EXPECT_RC(cuStreamCreate(NULL, 0), IV);
    EXPECT_RC(cuStreamCreateWithPriority(NULL, 0, 0), IV);
    EXPECT_RC(cuStreamIsCapturing(s, NULL), IV);
    EXPECT_RC(cuStreamEndCapture(s, NULL), IV);
    EXPECT_RC(cuEventCreate(NULL, 0), IV);
    EXPECT_RC(cuEventElapsedTime(NULL, e, e), IV);
    EXPECT_RC(cuGraphCreate(NULL, 0), IV);
    EXPECT_RC(cuGraphGetNodes(g, NULL, NULL), IV);
    EXPECT_RC(cuGraphInstantiateWithFlags(NULL, g, 0), IV);
    EXPECT_RC(cuGraphInstantiate(NULL, g, NULL, NULL, 0), IV);
    EXPECT_RC(cuGetErrorString(CUDA_SUCCESS, NULL), IV);
    EXPECT_RC(cuGetExportTable(NULL, NULL), IV);
    EXPECT_RC(cuPointerGetAttribute(NULL, CU_POINTER_ATTRIBUTE_CONTEXT, 0), IV);
    EXPECT_RC(cuLaunchKernelEx_ptsz(NULL, NULL, NULL, NULL), IV);
    CHECK(cuGraphDestroy(g));
    CHECK(cuEventDestroy_v2(e));
    CHECK(cuStreamDestroy_v2(s));
    CHECK(cuModuleUnload(m));
    CHECK(cuLibraryUnload(l));
}

static void test_errors(void) {
    const char *s = NULL;
    CHECK(cuGetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &s));
    EXPECT(strcmp(s, "CUDA_ERROR_OUT_OF_MEMORY") == 0);
    CHECK(cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY, &s));
    EXPECT(strcmp(s, "out of memory") == 0);
    CHECK(cuGetErrorString(CUDA_SUCCESS, &s));
    EXPECT(strcmp(s, "no error") == 0);
    EXPECT_RC(cuGetErrorString((CUresult)12345, &s), CUDA_ERROR_INVALID_VALUE);
    EXPECT(s == NULL);
    EXPECT_RC(cuGetErrorName(CUDA_SUCCESS, NULL), CUDA_ERROR_INVALID_VALUE);
    const void *tbl;
    CUuuid id = {{0}};
    EXPECT_RC(cuGetExportTable(&tbl, &id), CUDA_ERROR_INVALID_VALUE);
}

int main(void) {
    test_before_init();
    CHECK(cuInit(0));
    test_device();
    test_contexts(); /* leaves the primary context current */
    test_memory();
    test_copies();
    test_pools();
    test_vmm();
    test_arrays();
    test_modules_and_launches();
    test_graphs();
    test_procaddr();
    test_errors();
    test_null_arguments();
    CHECK(cuDevicePrimaryCtxRelease_v2(0));
    CHECK(cuDevicePrimaryCtxReset_v2(0));
    CUcontext c;
    CHECK(cuCtxGetCurrent(&c));
    EXPECT(c == NULL); /* the reset primary context is no longer usable */
    printf("OK\n");
    return 0;
}

/* Run under tests/c/sim_interpose_lib.c: see tests/sim/test_interposition.py. */
#include <dlfcn.h>

#include "sim_common.h"

int main(void) {
    int *frees = dlsym(RTLD_DEFAULT, "interposed_free_calls");
    int *allocs = dlsym(RTLD_DEFAULT, "interposed_alloc_calls");
    EXPECT(frees && allocs);
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuCtxCreate_v2(&ctx, 0, 0));
    CUdeviceptr p;
    CHECK(cuMemAlloc_v2(&p, 4096)); /* the application's own calls: seen once each */
    CHECK(cuMemFree_v2(p));
    printf("own _v2 calls: allocs=%d frees=%d\n", *allocs, *frees);
    CUdeviceptr_v1 p32;
    CHECK(cuMemAlloc(&p32, 4096)); /* legacy entry point: the simulator must not route it */
    CHECK(cuMemFree(p32));         /* through the interposer's _v2 functions */
    CHECK(cuMemAllocAsync(&p, 4096, NULL));
    CHECK(cuMemFreeAsync(p, NULL));
    printf("after legacy and async calls: allocs=%d frees=%d\n", *allocs, *frees);
    /* cuGetProcAddress hands out the simulator's functions, not the interposer's */
    void *fn = NULL;
    CHECK(cuGetProcAddress_v2("cuMemFree", &fn, 12000, 0, NULL));
    void *sim = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    EXPECT(sim != NULL);
    printf("cuGetProcAddress(cuMemFree): simulator's=%d interposer's=%d\n",
           entry_target(fn) == dlsym(sim, "cuMemFree_v2"), fn == dlsym(RTLD_DEFAULT, "cuMemFree_v2"));
    CHECK(((CUresult (*)(CUdeviceptr *, size_t))dlsym(sim, "cuMemAlloc_v2"))(&p, 64));
    CHECK(((CUresult (*)(CUdeviceptr))fn)(p));
    printf("after the simulator's own functions: allocs=%d frees=%d\n", *allocs, *frees);
    return 0;
}

/* Run under tests/c/sim_interpose_lib.c: see tests/sim/test_interposition.py. */
#include <dlfcn.h>

#include "sim_common.h"

int main(void)
{
    int *frees = dlsym(RTLD_DEFAULT, "interposed_free_calls");
    int *allocs = dlsym(RTLD_DEFAULT, "interposed_alloc_calls");
    EXPECT(frees && allocs);
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuCtxCreate_v2(&ctx, 0, 0));
    CUdeviceptr p;
    CHECK(cuMemAlloc_v2(&p, 4096)); /* the application's own call: seen once */
    EXPECT(*allocs == 1);
    CHECK(cuMemFree_v2(p));
    EXPECT(*frees == 1);
    CUdeviceptr_v1 p32;
    CHECK(cuMemAlloc(&p32, 4096)); /* legacy entry point: the simulator must not route it */
    CHECK(cuMemFree(p32));         /* through the interposer's _v2 functions */
    CHECK(cuMemAllocAsync(&p, 4096, NULL));
    CHECK(cuMemFreeAsync(p, NULL));
    EXPECT(*allocs == 1 && *frees == 1);
    /* cuGetProcAddress hands out the simulator's functions, not the interposer's */
    void *fn = NULL;
    CHECK(cuGetProcAddress_v2("cuMemFree", &fn, 12000, 0, NULL));
    void *sim = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    EXPECT(sim && entry_target(fn) == dlsym(sim, "cuMemFree_v2") && fn != dlsym(RTLD_DEFAULT, "cuMemFree_v2"));
    CHECK(((CUresult(*)(CUdeviceptr *, size_t))dlsym(sim, "cuMemAlloc_v2"))(&p, 64));
    CHECK(((CUresult(*)(CUdeviceptr))fn)(p));
    EXPECT(*allocs == 1 && *frees == 1);
    printf("OK\n");
    return 0;
}

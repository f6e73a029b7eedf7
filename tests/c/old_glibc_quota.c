/*
 * One allocation of argv[1] bytes, as a program built against an old glibc makes it
 * (tests/shim/test_old_glibc.py): linked with the driver, or with -DBY_DLOPEN loading it with
 * dlopen (then libpthread arrives only as the driver's dependency). Prints "alloc=<CUresult>".
 */
#include <stdio.h>
#include <stdlib.h>

#include "vgpu/cuda_api.h"

#ifdef BY_DLOPEN
#include <dlfcn.h>
#define CALL(name, type) ((type)dlsym(h, #name))
#else
#define CALL(name, type) name
#endif

int main(int argc, char **argv) {
    if (argc != 2) return 2;
#ifdef BY_DLOPEN
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) return printf("dlopen: %s\n", dlerror()), 1;
#endif
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr p;
    CUresult rc = CALL(cuInit, CUresult (*)(unsigned))(0);
    if (rc == CUDA_SUCCESS) rc = CALL(cuDeviceGet, CUresult (*)(CUdevice *, int))(&dev, 0);
    if (rc == CUDA_SUCCESS) rc = CALL(cuDevicePrimaryCtxRetain, CUresult (*)(CUcontext *, CUdevice))(&ctx, dev);
    if (rc == CUDA_SUCCESS) rc = CALL(cuCtxSetCurrent, CUresult (*)(CUcontext))(ctx);
    if (rc == CUDA_SUCCESS)
        rc = CALL(cuMemAlloc_v2, CUresult (*)(CUdeviceptr *, size_t))(&p, strtoull(argv[1], NULL, 0));
    printf("alloc=%d\n", (int)rc);
    return 0;
}

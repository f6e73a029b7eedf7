/*
 * A stand-in interposer (LD_PRELOAD) for tests/sim/test_interposition.py: it defines
 * cuMemFree_v2 and cuMemAlloc_v2, counts calls and forwards to the next definition (the
 * simulator). The simulator must never call them itself.
 */
#define _GNU_SOURCE 1
#include <dlfcn.h>

#include "vgpu/cuda_api.h"

int interposed_free_calls, interposed_alloc_calls;

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    interposed_free_calls++;
    CUresult (*next)(CUdeviceptr) = (CUresult (*)(CUdeviceptr))dlsym(RTLD_NEXT, "cuMemFree_v2");
    return next(dptr);
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    interposed_alloc_calls++;
    CUresult (*next)(CUdeviceptr *, size_t) = (CUresult (*)(CUdeviceptr *, size_t))dlsym(RTLD_NEXT, "cuMemAlloc_v2");
    return next(dptr, bytesize);
}

/*
 * Page-locked host memory: cuMemHostAlloc (portable, mapped, write-combined), cuMemHostRegister of
 * the application's own memory, mapped device pointers and flags. Host memory is not device memory:
 * nothing is charged (as on hardware, where pinned memory costs host RAM only). With unified
 * addressing the device pointer of mapped host memory is the host address itself, as on 64-bit
 * Linux with a real GPU.
 */
#include "ctxstack.h"
#include "init.h"
#include "memory.h"

#define HOSTALLOC_FLAGS (CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED)
#define HOSTREGISTER_FLAGS                                                                                             \
    (CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_IOMEMORY |                        \
     CU_MEMHOSTREGISTER_READ_ONLY)

SIM_EXPORT CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) {
    if (!pp || (Flags & ~HOSTALLOC_FLAGS)) return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr p;
    CUresult rc = sim_alloc_memory(&p, bytesize, ALLOC_HOST, Flags | CU_MEMHOSTALLOC_DEVICEMAP);
    if (rc == CUDA_SUCCESS) *pp = (void *)(uintptr_t)p;
    return rc;
}

SIM_EXPORT CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags) {
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (!p || bytesize == 0 || (Flags & ~HOSTREGISTER_FLAGS)) return CUDA_ERROR_INVALID_VALUE;
    if (Flags & CU_MEMHOSTREGISTER_IOMEMORY) return CUDA_ERROR_NOT_SUPPORTED; /* no PCIe BAR to map */
    uintptr_t b = (uintptr_t)p;
    if (b + bytesize < b) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&G.lock);
    int overlap = sim_alloc_overlaps(b, bytesize);
    if (overlap) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    }
    sim_alloc a = {.base = b,
                   .size = bytesize,
                   .dev = c->dev,
                   .kind = ALLOC_HOST_REGISTERED,
                   .ctx = c,
                   .host_flags = Flags | CU_MEMHOSTREGISTER_DEVICEMAP};
    int ok = sim_alloc_insert(&a) == 0;
    pthread_mutex_unlock(&G.lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

SIM_EXPORT CUresult cuMemHostUnregister(void *p) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&G.lock);
    sim_alloc a;
    if (sim_alloc_find((uintptr_t)p, &a) != 0 || a.base != (uintptr_t)p || a.kind != ALLOC_HOST_REGISTERED) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    }
    sim_alloc_remove(a.base, NULL);
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

static CUresult find_host(void *p, sim_alloc *a) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    int found = sim_alloc_find((uintptr_t)p, a) == 0;
    pthread_mutex_unlock(&G.lock);
    if (!found || (a->kind != ALLOC_HOST && a->kind != ALLOC_HOST_REGISTERED)) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags) {
    if (!pdptr || !p || Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    sim_alloc a;
    if ((rc = find_host(p, &a)) != CUDA_SUCCESS) return rc;
    *pdptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemHostGetFlags(unsigned int *pFlags, void *p) {
    if (!pFlags || !p) return CUDA_ERROR_INVALID_VALUE;
    sim_alloc a;
    CUresult rc = find_host(p, &a);
    if (rc == CUDA_SUCCESS) *pFlags = a.host_flags;
    return rc;
}

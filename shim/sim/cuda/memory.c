/*
 * Device memory: cuMemAlloc & co, host (pinned) memory, memory info and pointer queries.
 *
 * Device pointers are host addresses backed by lazily committed memory (mmap MAP_NORESERVE for
 * anything from 64 KiB, malloc below), so copies round-trip data and an 80 GiB device fits on a
 * small machine as long as the program does not write all of it. Every allocation is recorded in
 * a sorted table (base -> size, charge, kind, context) used to validate the pointers of copies,
 * frees and queries: a bad device pointer is an error code, never a crash.
 *
 * Charging, as NVIDIA's driver takes device memory (SIMGPU_ALLOC_GRANULARITY, the page size G,
 * default 2 MiB): an allocation of at least G/2 gets pages of its own (its size rounded up to G);
 * a smaller one is sub-allocated, in SIM_ALLOC_ALIGN (512 B) units, from pages the process shares
 * between its small allocations on that device: the process is charged whole pages for them
 * (ceil(sum of the small allocations / G) pages; a page returns when the sum falls below it).
 * With G = 512 every allocation is charged its size rounded up to 512 B. The device pool is
 * shared by all processes; OOM when it cannot hold the pages. (Managed memory is charged at allocation, as if resident on the device.) Host memory
 * (cuMemAllocHost) is not charged. The legacy 32-bit entry points (cuMemAlloc, cuMemAllocPitch,
 * cuMemGetAddressRange, ...) get addresses below 4 GiB (MAP_32BIT) so they fit CUdeviceptr_v1.
 */
#define _GNU_SOURCE 1 /* MAP_32BIT, MAP_NORESERVE */
#include "memory.h"

#include "arrays.h"
#include "ctxstack.h"
#include "init.h"
#include "stream.h"

#include "../common/state.h"
#include "../common/util.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define SMALL_ALLOC_LIMIT (64u << 10)

static sim_alloc *tab;
static size_t ntab, captab;
static uint64_t small_live[SIM_MAX_DEVICES]; /* sub-allocated bytes per device (G.lock) */
static void (*owner_release[ALLOC_GRAPH + 1])(const sim_alloc *a);

void sim_alloc_set_release(int kind, void (*release)(const sim_alloc *a)) { owner_release[kind] = release; }

static int is_small(uint64_t size) { return G.alloc_gran > SIM_ALLOC_ALIGN && size < G.alloc_gran / 2; }

static uint64_t pages(uint64_t bytes) { return (bytes + G.alloc_gran - 1) / G.alloc_gran; }

/* Device bytes a new allocation of `size` adds (G.lock held; `*unit`: its share if small). */
static uint64_t charge_for(int dev, uint64_t size, uint64_t *unit) {
    if (!is_small(size)) {
        *unit = 0;
        return sim_align_up(size, G.alloc_gran > SIM_ALLOC_ALIGN ? G.alloc_gran : SIM_ALLOC_ALIGN);
    }
    *unit = sim_align_up(size, SIM_ALLOC_ALIGN);
    return (pages(small_live[dev] + *unit) - pages(small_live[dev])) * G.alloc_gran;
}

/* index of the first entry with base > p */
static size_t upper(uintptr_t p) {
    size_t lo = 0, hi = ntab;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (tab[mid].base <= p)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

int sim_alloc_insert(const sim_alloc *a) {
    if (ntab == captab) {
        size_t nc = captab ? captab * 2 : 256;
        sim_alloc *nt = realloc(tab, nc * sizeof *nt);
        if (!nt) return -1;
        tab = nt;
        captab = nc;
    }
    size_t i = upper(a->base);
    memmove(&tab[i + 1], &tab[i], (ntab - i) * sizeof *tab);
    tab[i] = *a;
    ntab++;
    return 0;
}

int sim_alloc_find(uintptr_t p, sim_alloc *out) {
    size_t i = upper(p);
    if (i == 0) return -1;
    const sim_alloc *a = &tab[i - 1];
    if (p >= a->base + (a->size ? a->size : 1)) return -1;
    if (out) *out = *a;
    return 0;
}

int sim_alloc_overlaps(uintptr_t b, size_t n) {
    size_t i = upper(b + n - 1); /* the last entry starting at or before the range's end */
    return i > 0 && tab[i - 1].base + (tab[i - 1].size ? tab[i - 1].size : 1) > b;
}

int sim_range_meets_allocation(uintptr_t b, size_t n) {
    pthread_mutex_lock(&G.lock);
    int r = sim_alloc_overlaps(b, n);
    pthread_mutex_unlock(&G.lock);
    return r;
}

int sim_alloc_remove(uintptr_t base, sim_alloc *out) {
    size_t i = upper(base);
    if (i == 0 || tab[i - 1].base != base) return -1;
    if (out) *out = tab[i - 1];
    memmove(&tab[i - 1], &tab[i], (ntab - i) * sizeof *tab);
    ntab--;
    return 0;
}

static void *backing_alloc(size_t size, int *mmapped, int low32) {
    if (low32) {
#ifdef MAP_32BIT
        void *p =
            mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_32BIT, -1, 0);
        *mmapped = 1;
        return p == MAP_FAILED ? NULL : p;
#else
        return NULL;
#endif
    }
    if (size >= SMALL_ALLOC_LIMIT) {
        void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        *mmapped = 1;
        return p == MAP_FAILED ? NULL : p;
    }
    *mmapped = 0;
    /* 512-byte aligned like the real allocator's minimum alignment (>= 256 B guaranteed by CUDA) */
    return aligned_alloc(SIM_ALLOC_ALIGN, sim_align_up(size ? size : 1, SIM_ALLOC_ALIGN));
}

void *sim_backing_alloc(size_t size, int *mmapped) { return backing_alloc(size, mmapped, 0); }

void sim_backing_free(void *p, size_t size, int mmapped) {
    if (!p) return;
    if (mmapped)
        munmap(p, size);
    else
        free(p);
}

/* Allocate, charge and record. G.lock is taken here. */
static CUresult alloc_device(CUdeviceptr *out, size_t size, int kind, int low32, unsigned host_flags) {
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (size == 0) return CUDA_ERROR_INVALID_VALUE;
    if (size > (1ull << 52)) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&G.lock);
    uint64_t unit = 0, charge = kind == ALLOC_HOST ? 0 : charge_for(c->dev, size, &unit);
    if (charge && sim_mem_charge(G.slot, sim_phys(c->dev), charge, G.cfg->dev[c->dev].memory) != 0) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (unit) small_live[c->dev] += unit;
    int mm = 0;
    void *p = backing_alloc(size, &mm, low32);
    sim_alloc a = {.base = (uintptr_t)p,
                   .size = size,
                   .charged = unit ? unit : charge,
                   .dev = c->dev,
                   .kind = kind,
                   .mmapped = mm,
                   .ctx = c,
                   .host_flags = host_flags,
                   .small = unit != 0};
    if (!p || sim_alloc_insert(&a) != 0) {
        sim_backing_free(p, size, mm);
        if (unit) small_live[c->dev] -= unit;
        sim_mem_uncharge(G.slot, sim_phys(c->dev), charge);
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_unlock(&G.lock);
    *out = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

CUresult sim_alloc_memory(CUdeviceptr *out, size_t size, int kind, unsigned host_flags) {
    return alloc_device(out, size, kind, 0, host_flags);
}

SIM_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    return alloc_device(dptr, bytesize, ALLOC_DEVICE, 0, 0);
}

SIM_EXPORT CUresult cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize) {
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr p;
    CUresult rc = alloc_device(&p, bytesize, ALLOC_DEVICE, 1, 0);
    if (rc == CUDA_SUCCESS) *dptr = (CUdeviceptr_v1)p;
    return rc;
}

SIM_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    if (!dptr || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)) return CUDA_ERROR_INVALID_VALUE;
    return alloc_device(dptr, bytesize, ALLOC_MANAGED, 0, 0);
}

static CUresult alloc_pitch(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned elem, int low32) {
    if (!dptr || !pitch || width == 0 || height == 0) return CUDA_ERROR_INVALID_VALUE;
    if (elem != 4 && elem != 8 && elem != 16) return CUDA_ERROR_INVALID_VALUE;
    if (width > (1ull << 40) || height > (1ull << 40)) return CUDA_ERROR_OUT_OF_MEMORY;
    size_t p = sim_align_up(width, SIM_PITCH_ALIGN);
    if (height > (1ull << 52) / p) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = alloc_device(dptr, p * height, ALLOC_DEVICE, low32, 0);
    if (rc == CUDA_SUCCESS) *pitch = p;
    return rc;
}

SIM_EXPORT CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes, size_t Height,
                                       unsigned int ElementSizeBytes) {
    return alloc_pitch(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes, 0);
}

SIM_EXPORT CUresult cuMemAllocPitch(CUdeviceptr_v1 *dptr, unsigned int *pPitch, unsigned int WidthInBytes,
                                    unsigned int Height, unsigned int ElementSizeBytes) {
    if (!dptr || !pPitch) return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr p;
    size_t pitch;
    CUresult rc = alloc_pitch(&p, &pitch, WidthInBytes, Height, ElementSizeBytes, 1);
    if (rc == CUDA_SUCCESS) {
        *dptr = (CUdeviceptr_v1)p;
        *pPitch = (unsigned int)pitch;
    }
    return rc;
}

static void release_locked(const sim_alloc *a) {
    if (a->kind != ALLOC_HOST_REGISTERED) /* the application's own memory */
        sim_backing_free((void *)a->base, a->size, a->mmapped);
    uint64_t charged = a->charged;
    if (a->small) { /* whole shared pages come back once the small allocations no longer fill them */
        uint64_t before = pages(small_live[a->dev]);
        small_live[a->dev] -= a->charged < small_live[a->dev] ? a->charged : small_live[a->dev];
        charged = (before - pages(small_live[a->dev])) * G.alloc_gran;
    }
    sim_mem_uncharge(G.slot, sim_phys(a->dev), charged);
}

void sim_alloc_release_locked(const sim_alloc *a) { release_locked(a); }

SIM_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (dptr == 0) { /* as free(NULL): the runtime's cudaFree(0) idiom (cuBLAS relies on it) */
        struct CUctx_st *c;
        return sim_get_ctx(&c);
    }
    pthread_mutex_lock(&G.lock);
    sim_alloc a;
    if (sim_alloc_find((uintptr_t)dptr, &a) != 0 || a.base != (uintptr_t)dptr ||
        (a.kind != ALLOC_DEVICE && a.kind != ALLOC_MANAGED && a.kind != ALLOC_POOL && a.kind != ALLOC_GRAPH)) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (owner_release[a.kind]) {
        owner_release[a.kind](&a); /* pool memory stays reserved in its pool (pools.c, gmempool.c) */
        pthread_mutex_unlock(&G.lock);
        return CUDA_SUCCESS;
    }
    sim_alloc_remove(a.base, NULL);
    release_locked(&a);
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemFree(CUdeviceptr_v1 dptr) { return cuMemFree_v2((CUdeviceptr)dptr); }

CUresult sim_free_ctx_allocations(struct CUctx_st *ctx) {
    /* G.lock held. Pool blocks belong to their (device-wide) pool and are left alone. */
    size_t w = 0;
    for (size_t r = 0; r < ntab; r++) {
        sim_alloc *a = &tab[r];
        if (a->ctx == ctx && (a->kind == ALLOC_DEVICE || a->kind == ALLOC_MANAGED || a->kind == ALLOC_HOST ||
                              a->kind == ALLOC_HOST_REGISTERED || a->kind == ALLOC_MODULE))
            release_locked(a);
        else
            tab[w++] = *a;
    }
    ntab = w;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemGetInfo_v2(size_t *free_, size_t *total) {
    if (!free_ || !total) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    uint64_t tot = G.cfg->dev[c->dev].memory;
    uint64_t used = sim_mem_used(sim_phys(c->dev), G.slot);
    *total = tot;
    *free_ = used >= tot ? 0 : tot - used;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemGetInfo(unsigned int *free_, unsigned int *total) {
    if (!free_ || !total) return CUDA_ERROR_INVALID_VALUE;
    size_t f, t;
    CUresult rc = cuMemGetInfo_v2(&f, &t);
    if (rc == CUDA_SUCCESS) { /* the 32-bit ABI saturates */
        *free_ = f > 0xffffffffu ? 0xffffffffu : (unsigned int)f;
        *total = t > 0xffffffffu ? 0xffffffffu : (unsigned int)t;
    }
    return rc;
}

SIM_EXPORT CUresult cuMemAllocHost_v2(void **pp, size_t bytesize) {
    if (!pp) return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr p;
    CUresult rc = alloc_device(&p, bytesize, ALLOC_HOST, 0, 0);
    if (rc == CUDA_SUCCESS) *pp = (void *)(uintptr_t)p;
    return rc;
}

SIM_EXPORT CUresult cuMemAllocHost(void **pp, unsigned int bytesize) { return cuMemAllocHost_v2(pp, bytesize); }

SIM_EXPORT CUresult cuMemFreeHost(void *p) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&G.lock);
    sim_alloc a;
    if (sim_alloc_find((uintptr_t)p, &a) != 0 || a.base != (uintptr_t)p || a.kind != ALLOC_HOST) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    sim_alloc_remove(a.base, NULL);
    release_locked(&a);
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

CUresult sim_check_device_range(CUdeviceptr p, size_t n) {
    sim_alloc a;
    pthread_mutex_lock(&G.lock);
    int found = sim_alloc_find((uintptr_t)p, &a) == 0;
    pthread_mutex_unlock(&G.lock);
    if (!found || (a.kind == ALLOC_VMM_MAP && !a.accessible)) return CUDA_ERROR_INVALID_VALUE;
    if (n > a.size || (uintptr_t)p - a.base > a.size - n) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    sim_alloc a;
    pthread_mutex_lock(&G.lock);
    int found = sim_alloc_find((uintptr_t)dptr, &a) == 0;
    pthread_mutex_unlock(&G.lock);
    if (!found || a.kind == ALLOC_HOST || a.kind == ALLOC_HOST_REGISTERED) return CUDA_ERROR_NOT_FOUND;
    if (pbase) *pbase = (CUdeviceptr)a.base;
    if (psize) *psize = a.size;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemGetAddressRange(CUdeviceptr_v1 *pbase, unsigned int *psize, CUdeviceptr_v1 dptr) {
    CUdeviceptr b;
    size_t s;
    CUresult rc = cuMemGetAddressRange_v2(&b, &s, (CUdeviceptr)dptr);
    if (rc != CUDA_SUCCESS) return rc;
    if (b > 0xffffffffull || s > 0xffffffffull)
        return CUDA_ERROR_INVALID_VALUE; /* not representable in the 32-bit ABI */
    if (pbase) *pbase = (CUdeviceptr_v1)b;
    if (psize) *psize = (unsigned int)s;
    return CUDA_SUCCESS;
}

/* The allocation holding ptr (1), or 0 if the driver knows no such pointer. */
static int pointer_alloc(CUdeviceptr ptr, sim_alloc *a) {
    pthread_mutex_lock(&G.lock);
    int found = sim_alloc_find((uintptr_t)ptr, a) == 0;
    pthread_mutex_unlock(&G.lock);
    return found;
}

/* One attribute of a known allocation (found) or of an unknown pointer (the "not device memory"
 * answers of cuPointerGetAttributes); CUDA_ERROR_INVALID_VALUE for an attribute not modelled.
 * `lenient` (cuPointerGetAttributes) answers NULL where cuPointerGetAttribute refuses: the host
 * address of device memory the host cannot reach. */
static CUresult pointer_attr(void *data, int attribute, CUdeviceptr ptr, const sim_alloc *a, int found, int lenient) {
    int host_visible = found && (a->kind == ALLOC_HOST || a->kind == ALLOC_HOST_REGISTERED || a->kind == ALLOC_MANAGED);
    switch (attribute) {
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        if (found && !host_visible && !lenient) return CUDA_ERROR_INVALID_VALUE;
        *(void **)data = host_visible ? (void *)(uintptr_t)ptr : NULL;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(int *)data = found && a->kind == ALLOC_MANAGED; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_CONTEXT: *(CUcontext *)data = found ? a->ctx : NULL; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *(unsigned int *)data = !found                                                      ? 0
                                : a->kind == ALLOC_HOST || a->kind == ALLOC_HOST_REGISTERED ? CU_MEMORYTYPE_HOST
                                                                                            : CU_MEMORYTYPE_DEVICE;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)data = found ? ptr : 0; return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = found ? a->dev : -1; return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

SIM_EXPORT CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    sim_alloc a;
    if (!pointer_alloc(ptr, &a)) return CUDA_ERROR_INVALID_VALUE;
    return pointer_attr(data, (int)attribute, ptr, &a, 1, 0);
}

/* Each attribute as cuPointerGetAttribute answers it; for a pointer the driver does not know,
 * every attribute reads as "not device memory" (0 / NULL) rather than an error, as documented. */
SIM_EXPORT CUresult cuPointerGetAttributes(unsigned int numAttributes, CUpointer_attribute *attributes, void **data,
                                           CUdeviceptr ptr) {
    if (!numAttributes || !attributes || !data) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    sim_alloc a;
    int found = pointer_alloc(ptr, &a);
    for (unsigned i = 0; i < numAttributes; i++) {
        if (!data[i]) return CUDA_ERROR_INVALID_VALUE;
        if ((rc = pointer_attr(data[i], (int)attributes[i], ptr, &a, found, 1)) != CUDA_SUCCESS) return rc;
    }
    return CUDA_SUCCESS;
}

/* A prefetch of managed memory is a hint: the simulated device and the host share one copy, so
 * there is nothing to move; the range, device and stream are checked as the driver checks them. */
static CUresult prefetch(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream, int ptds) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!devPtr || !count) return CUDA_ERROR_INVALID_VALUE;
    if (dstDevice != -1 /* CU_DEVICE_CPU */ && (rc = sim_check_device(dstDevice)) != CUDA_SUCCESS) return rc;
    struct CUstream_st *s;
    if ((rc = sim_resolve_stream(hStream, ptds, &s)) != CUDA_SUCCESS) return rc;
    return sim_check_device_range(devPtr, count);
}

SIM_EXPORT CUresult cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream) {
    return prefetch(devPtr, count, dstDevice, hStream, 0);
}
SIM_EXPORT CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr devPtr, size_t count, CUdevice dstDevice, CUstream hStream) {
    return prefetch(devPtr, count, dstDevice, hStream, 1);
}

/* The CUDA 12.2 form (the only cuMemPrefetchAsync of CUDA 13): a memory location and flags. */
static CUresult prefetch_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location, unsigned int flags,
                            CUstream hStream, int ptds) {
    if (flags) return CUDA_ERROR_INVALID_VALUE;
    switch (location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE: return prefetch(devPtr, count, location.id, hStream, ptds);
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: return prefetch(devPtr, count, -1, hStream, ptds);
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

SIM_EXPORT CUresult cuMemPrefetchAsync_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location, unsigned int flags,
                                          CUstream hStream) {
    return prefetch_v2(devPtr, count, location, flags, hStream, 0);
}
SIM_EXPORT CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr devPtr, size_t count, CUmemLocation location,
                                               unsigned int flags, CUstream hStream) {
    return prefetch_v2(devPtr, count, location, flags, hStream, 1);
}

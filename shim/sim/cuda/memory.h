/*
 * Device memory (memory.c): the allocation table, allocating and releasing device, managed and
 * host memory, and the backing of every allocation.
 */
#ifndef VGPU_SIM_CUDA_MEMORY_H
#define VGPU_SIM_CUDA_MEMORY_H

#include "objects.h"

#include <stddef.h>
#include <stdint.h>

enum {
    ALLOC_DEVICE = 1,
    ALLOC_MANAGED,
    ALLOC_HOST,
    ALLOC_POOL,
    ALLOC_VMM_MAP,
    ALLOC_HOST_REGISTERED,
    ALLOC_MODULE,
    ALLOC_GRAPH
};
typedef struct {
    uintptr_t base;
    size_t size;      /* usable bytes */
    uint64_t charged; /* bytes charged on the device (0 for host / VMM maps) */
    int dev;
    int kind;
    int mmapped;    /* backing from mmap (else malloc) */
    int accessible; /* VMM maps: cuMemSetAccess done */
    struct CUctx_st *ctx;
    struct CUmemPoolHandle_st *pool;
    unsigned host_flags;                 /* cuMemHostAlloc / cuMemHostRegister flags */
    int small;                           /* sub-allocated from shared pages (charged bytes: its share) */
    CUmemGenericAllocationHandle handle; /* VMM maps: the handle mapped */
} sim_alloc;
int sim_alloc_insert(const sim_alloc *a);              /* G.lock held */
int sim_alloc_remove(uintptr_t base, sim_alloc *out);  /* exact base; G.lock held */
int sim_alloc_find(uintptr_t p, sim_alloc *out);       /* containing p; G.lock held */
int sim_alloc_overlaps(uintptr_t b, size_t n);         /* any entry meets [b, b+n); G.lock held */
int sim_range_meets_allocation(uintptr_t b, size_t n); /* the same, taking G.lock */
void *sim_backing_alloc(size_t size, int *mmapped);
/* Allocate (and charge, unless host memory) in the current context; G.lock is taken inside. */
CUresult sim_alloc_memory(CUdeviceptr *out, size_t size, int kind, unsigned host_flags);
/* Release one allocation's backing and charge (registered host memory: only the record). */
void sim_alloc_release_locked(const sim_alloc *a);
void sim_backing_free(void *p, size_t size, int mmapped);
/* Is [p, p+n) inside one allocation the device may access (device, managed, pool, mapped VMM)? */
CUresult sim_check_device_range(CUdeviceptr p, size_t n);
CUresult sim_free_ctx_allocations(struct CUctx_st *ctx); /* context destroy */

/* cuMemFree of an allocation of `kind` whose memory belongs to a pool of its own (stream-ordered
 * pools, the graph memory pool) hands it to `release` (G.lock held, its entry still in the table). */
void sim_alloc_set_release(int kind, void (*release)(const sim_alloc *a));

#endif

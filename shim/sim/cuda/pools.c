/*
 * Memory pools and the stream-ordered allocator, modelled like the real driver:
 *
 *  - a pool's memory is charged to the device when the pool first reserves it; a freed block
 *    stays reserved in the pool (still charged, so cuMemGetInfo and NVML count it as used) and
 *    is reused by later allocations of a similar size (best fit, at most twice the request);
 *  - at every synchronisation (stream, context or event) a pool releases free blocks until its
 *    reserved memory is at most its release threshold (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
 *    default 0: release everything free at the next synchronisation);
 *  - cuMemPoolTrimTo releases free blocks down to the size asked for;
 *  - sizes are rounded up to SIM_ALLOC_ALIGN (512 B), like cuMemAlloc.
 *
 * Allocation and free happen at the call, not in stream order (there is no device to order them
 * on); a block freed with cuMemFreeAsync can be reused by the next allocation at once, which a
 * correct stream-ordered program cannot tell apart. Pools are per device and per process.
 * On a capturing stream both become graph memory nodes instead (graphmem.c).
 */
#include "graphmem.h"
#include "init.h"
#include "memory.h"
#include "stream.h"

#include "../common/state.h"

#include <stdlib.h>
#include <string.h>

typedef struct pool_block {
    uintptr_t base;
    size_t size;
    uint64_t charged;
    int mmapped;
    struct pool_block *next;
} pool_block;

struct CUmemPoolHandle_st {
    uint32_t magic, gen;
    int dev;
    int is_default;
    uint64_t threshold;
    uint64_t reserved, reserved_high, used, used_high;
    uint64_t max_size;
    int reuse[3];
    pool_block *free_list;
    struct CUmemPoolHandle_st *next;
};

static struct CUmemPoolHandle_st *pools; /* every pool ever created (G.lock) */

static struct CUmemPoolHandle_st *pool_new(int dev, int is_default, uint64_t max_size) {
    struct CUmemPoolHandle_st *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->dev = dev;
    p->is_default = is_default;
    p->max_size = max_size;
    p->reuse[0] = p->reuse[1] = p->reuse[2] = 1;
    p->gen = sim_gen();
    p->magic = MAGIC_POOL;
    p->next = pools;
    pools = p;
    return p;
}

static struct CUmemPoolHandle_st *default_pool_locked(int dev) {
    if (!G.default_pool[dev] || !SIM_VALID(G.default_pool[dev], MAGIC_POOL)) G.default_pool[dev] = pool_new(dev, 1, 0);
    if (!G.current_pool[dev] || !SIM_VALID(G.current_pool[dev], MAGIC_POOL)) G.current_pool[dev] = G.default_pool[dev];
    return G.current_pool[dev];
}

static void release_block(struct CUmemPoolHandle_st *p, pool_block *b) {
    sim_backing_free((void *)b->base, b->size, b->mmapped);
    sim_mem_uncharge(G.slot, sim_phys(p->dev), b->charged);
    p->reserved -= b->charged;
    free(b);
}

static void trim_locked(struct CUmemPoolHandle_st *p, uint64_t keep) {
    while (p->reserved > keep && p->free_list) {
        pool_block *b = p->free_list;
        p->free_list = b->next;
        release_block(p, b);
    }
}

/* At a synchronisation (stream.c): every pool of the device down to its release threshold. */
static void trim_device(int dev) {
    pthread_mutex_lock(&G.lock);
    for (struct CUmemPoolHandle_st *p = pools; p; p = p->next)
        if (p->dev == dev && p->gen == sim_gen()) trim_locked(p, p->magic == MAGIC_POOL ? p->threshold : 0);
    pthread_mutex_unlock(&G.lock);
}

/* Back into its pool (reserved). G.lock held. */
static void free_block(const sim_alloc *a) {
    struct CUmemPoolHandle_st *p = a->pool;
    pool_block *b = malloc(sizeof *b);
    p->used -= a->charged;
    if (!b) { /* cannot keep it: give it back */
        sim_backing_free((void *)a->base, a->size, a->mmapped);
        sim_mem_uncharge(G.slot, sim_phys(p->dev), a->charged);
        p->reserved -= a->charged;
        return;
    }
    *b = (pool_block){
        .base = a->base, .size = a->size, .charged = a->charged, .mmapped = a->mmapped, .next = p->free_list};
    p->free_list = b;
    if (p->magic != MAGIC_POOL) trim_locked(p, 0); /* a destroyed pool keeps nothing */
}

/* cuMemFree of a pool block (memory.c hands it over). G.lock held. */
static void free_entry(const sim_alloc *a) {
    sim_alloc_remove(a->base, NULL);
    free_block(a);
}

__attribute__((constructor)) static void pools_ctor(void) {
    sim_alloc_set_release(ALLOC_POOL, free_entry);
    sim_stream_on_sync(trim_device);
}

static CUresult pool_alloc(struct CUmemPoolHandle_st *pool, size_t bytes, CUdeviceptr *out, struct CUctx_st *ctx) {
    if (bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    if (bytes > (1ull << 52)) return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t charge = sim_align_up(bytes, SIM_ALLOC_ALIGN);
    pthread_mutex_lock(&G.lock);
    if (!pool) pool = default_pool_locked(ctx->dev);
    if (!SIM_VALID(pool, MAGIC_POOL)) {
        pthread_mutex_unlock(&G.lock);
        return pool ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_OUT_OF_MEMORY;
    }
    pool_block **best = NULL;
    for (pool_block **b = &pool->free_list; *b; b = &(*b)->next)
        if ((*b)->charged >= charge && (*b)->charged <= 2 * charge && (!best || (*b)->charged < (*best)->charged))
            best = b;
    sim_alloc a = {.dev = pool->dev, .kind = ALLOC_POOL, .ctx = ctx, .pool = pool};
    if (best) {
        pool_block *b = *best;
        *best = b->next;
        a.base = b->base;
        a.size = b->size;
        a.charged = b->charged;
        a.mmapped = b->mmapped;
        free(b);
    } else {
        if ((pool->max_size && pool->reserved + charge > pool->max_size) ||
            sim_mem_charge(G.slot, sim_phys(pool->dev), charge, G.cfg->dev[pool->dev].memory) != 0) {
            pthread_mutex_unlock(&G.lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        void *p = sim_backing_alloc(charge, &a.mmapped);
        if (!p) {
            sim_mem_uncharge(G.slot, sim_phys(pool->dev), charge);
            pthread_mutex_unlock(&G.lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        a.base = (uintptr_t)p;
        a.size = charge;
        a.charged = charge;
        pool->reserved += charge;
        if (pool->reserved > pool->reserved_high) pool->reserved_high = pool->reserved;
    }
    if (sim_alloc_insert(&a) != 0) {
        pool_block tmp = {.base = a.base, .size = a.size, .charged = a.charged, .mmapped = a.mmapped};
        pool_block *b = malloc(sizeof *b);
        if (b) {
            *b = tmp;
            release_block(pool, b);
        }
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pool->used += a.charged;
    if (pool->used > pool->used_high) pool->used_high = pool->used;
    pthread_mutex_unlock(&G.lock);
    *out = (CUdeviceptr)a.base;
    return CUDA_SUCCESS;
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t bytes, struct CUmemPoolHandle_st *pool, CUstream h, int ptds,
                            int explicit_pool) {
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s;
    CUresult rc = sim_resolve_stream(h, ptds, &s);
    if (rc != CUDA_SUCCESS) return rc;
    if (explicit_pool && !SIM_VALID(pool, MAGIC_POOL)) return CUDA_ERROR_INVALID_VALUE;
    if (sim_gmem_capture_alloc(s, explicit_pool ? pool->dev : s->ctx->dev, bytes, dptr, &rc))
        return rc; /* captured: an alloc node, memory only when the graph runs (graphmem.c) */
    return pool_alloc(pool, bytes, dptr, s->ctx);
}

SIM_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return alloc_async(dptr, bytesize, NULL, hStream, 0, 0);
}
SIM_EXPORT CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return alloc_async(dptr, bytesize, NULL, hStream, 1, 0);
}
SIM_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream) {
    return alloc_async(dptr, bytesize, pool, hStream, 0, 1);
}
SIM_EXPORT CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                                 CUstream hStream) {
    return alloc_async(dptr, bytesize, pool, hStream, 1, 1);
}

static CUresult free_async(CUdeviceptr dptr, CUstream h, int ptds) {
    struct CUstream_st *s;
    CUresult rc = sim_resolve_stream(h, ptds, &s);
    if (rc != CUDA_SUCCESS) return rc;
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    if (sim_gmem_capture_free(s, dptr, &rc)) return rc; /* captured: a free node */
    return cuMemFree_v2(dptr);                          /* pool blocks go back to their pool, others are released */
}

SIM_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) { return free_async(dptr, hStream, 0); }
SIM_EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) { return free_async(dptr, hStream, 1); }

SIM_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev) {
    if (!pool_out) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_device(dev);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    default_pool_locked(dev);
    struct CUmemPoolHandle_st *p = G.default_pool[dev];
    pthread_mutex_unlock(&G.lock);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    *pool_out = p;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_device(dev);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    struct CUmemPoolHandle_st *p = default_pool_locked(dev);
    pthread_mutex_unlock(&G.lock);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    *pool = p;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps) {
    if (!pool || !poolProps) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (poolProps->allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
        poolProps->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
        return CUDA_ERROR_INVALID_VALUE; /* host pools are not modelled */
    if (sim_check_device(poolProps->location.id) != CUDA_SUCCESS) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&G.lock);
    if (sim_ensure_slot() < 0) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    struct CUmemPoolHandle_st *p = pool_new(poolProps->location.id, 0, poolProps->maxSize);
    pthread_mutex_unlock(&G.lock);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    *pool = p;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    if (!SIM_VALID(pool, MAGIC_POOL) || pool->is_default) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    /* Free blocks go now; blocks still allocated are released when freed (the struct stays). */
    trim_locked(pool, 0);
    pool->magic = MAGIC_DEAD;
    for (int d = 0; d < SIM_MAX_DEVICES; d++)
        if (G.current_pool[d] == pool) G.current_pool[d] = G.default_pool[d];
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    if (!SIM_VALID(pool, MAGIC_POOL)) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    trim_locked(pool, minBytesToKeep);
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

static CUresult pool_attr(CUmemoryPool pool, CUmemPool_attribute attr, void *value, int set) {
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    if (!SIM_VALID(pool, MAGIC_POOL)) {
        pthread_mutex_unlock(&G.lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    rc = CUDA_SUCCESS;
    cuuint64_t *u64 = value;
    int *i32 = value;
    switch ((int)attr) {
    case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
    case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
        if (set)
            pool->reuse[attr - 1] = *i32 != 0;
        else
            *i32 = pool->reuse[attr - 1];
        break;
    case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
        if (set)
            pool->threshold = *u64;
        else
            *u64 = pool->threshold;
        break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
        if (set)
            rc = CUDA_ERROR_INVALID_VALUE;
        else
            *u64 = pool->reserved;
        break;
    case CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH: /* setting resets the watermark (only 0 is allowed) */
        if (set)
            rc = *u64 ? CUDA_ERROR_INVALID_VALUE : ((pool->reserved_high = pool->reserved), CUDA_SUCCESS);
        else
            *u64 = pool->reserved_high;
        break;
    case CU_MEMPOOL_ATTR_USED_MEM_CURRENT:
        if (set)
            rc = CUDA_ERROR_INVALID_VALUE;
        else
            *u64 = pool->used;
        break;
    case CU_MEMPOOL_ATTR_USED_MEM_HIGH:
        if (set)
            rc = *u64 ? CUDA_ERROR_INVALID_VALUE : ((pool->used_high = pool->used), CUDA_SUCCESS);
        else
            *u64 = pool->used_high;
        break;
    default: rc = CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_unlock(&G.lock);
    return rc;
}

SIM_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    return pool_attr(pool, attr, value, 1);
}
SIM_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    return pool_attr(pool, attr, value, 0);
}

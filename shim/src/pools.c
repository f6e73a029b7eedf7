/*
 * Stream-ordered allocation (cuMemAllocAsync, cuMemAllocFromPoolAsync and their _ptsz forms).
 *
 * A pool keeps freed blocks reserved (charged on the device) until a synchronisation or a trim
 * releases them down to its release threshold, so "what the slice takes" is the pools'
 * reserved memory, not the sum of live allocations. Each pool the process uses is charged its
 * reserved bytes (CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, the driver's own figure):
 *   - an allocation reserves its size first (refused over quota), then settles the pool's
 *     charge to what the pool reserves afterwards (less if a cached block was reused);
 *   - a free settles the pool's charge (a pool that released memory at once returns it);
 *   - a refusal, cuMemGetInfo and cuMemPoolTrimTo settle every pool of the device first, and a
 *     refusal also trims them, so memory a pool merely caches never causes an OOM (the
 *     spurious OOM of high-water-mark accounting) and never lets the slice exceed its quota;
 *   - the allocating pool itself (whose lock the refusal path cannot take) first serves the
 *     request from its own freed blocks when it holds enough (kept only if its reservation did
 *     not grow past the quota), else is trimmed before the request is refused.
 * Between a synchronisation that releases pool memory and the next settle, the charge is higher
 * than the device's use: conservative, and corrected before any refusal.
 * The size reserved before the driver is asked is what the driver reports it takes for such an
 * allocation (vgpu_mem_estimate: its page, or its alignment for a small one); the pool's own
 * figure replaces it at once, and growth beyond it (a pool reserving in larger chunks) must fit
 * the quota too or the allocation is undone.
 */
#include <pthread.h>
#include <stdlib.h>

#include "pools.h"
#include "devices.h"
#include "graphmem.h"
#include "hooks.h"
#include "init.h"
#include "region.h"
#include "reserve.h"
#include "symbols.h"
#include "track.h"

struct pool_acct {
    CUmemoryPool pool;
    int dev;            /* app-visible device index */
    int destroyed;      /* cuMemPoolDestroy returned while allocations were outstanding */
    uint64_t charged;   /* bytes charged to the region for this pool */
    uint64_t live;      /* bytes of its allocations not yet freed (what a destroyed pool keeps) */
    pthread_mutex_t mu; /* serialises this pool's allocate/settle in this process */
    struct pool_acct *next;
};

static pthread_mutex_t list_mu = PTHREAD_MUTEX_INITIALIZER;
static struct pool_acct *pools;
static pthread_once_t pools_once = PTHREAD_ONCE_INIT;

typedef CUresult (*pool_attr_fn)(CUmemoryPool, CUmemPool_attribute, void *);
typedef CUresult (*ctx_dev_fn)(CUdevice *);

static pool_attr_fn get_attr(void) {
    static pool_attr_fn f;
    if (f == NULL) f = (pool_attr_fn)vgpu_cuda_sym("cuMemPoolGetAttribute");
    return f;
}

static void pools_register(void);

static struct pool_acct *pool_acct(CUmemoryPool pool, int dev) {
    if (dev >= 0) pthread_once(&pools_once, pools_register);
    pthread_mutex_lock(&list_mu);
    struct pool_acct *a = pools;
    while (a && a->pool != pool) a = a->next;
    if (a == NULL && dev >= 0 && (a = calloc(1, sizeof *a)) != NULL) {
        a->pool = pool;
        a->dev = dev;
        pthread_mutex_init(&a->mu, NULL);
        a->next = pools;
        pools = a;
    }
    pthread_mutex_unlock(&list_mu);
    return a;
}

/* a->mu held: bring the pool's charge to what the pool reserves now */
static void settle_locked(struct pool_acct *a) {
    if (a->destroyed) return; /* no attributes to ask: its allocations return one by one */
    cuuint64_t r = 0;
    pool_attr_fn f = get_attr();
    if (f == NULL || f(a->pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &r) != CUDA_SUCCESS) return;
    if (r < a->charged) {
        vgpu_mem_release(a->dev, a->charged - r);
        a->charged = r;
    } else if (r > a->charged) {
        /* grown behind our back (cannot happen through the hooks): account it, never refuse */
        uint64_t used;
        if (vgpu_region_charge(a->dev, r - a->charged, 0, &used) == 0) a->charged = r;
    }
}

/* Settle every (idle) pool of device index dev to what it reserves; trim them first if trim.
 * Nonzero if some charge was returned (reserve.c calls it before a refusal and for cuMemGetInfo). */
static int pools_settle(int dev, int trim) {
    int released = 0;
    pthread_mutex_lock(&list_mu);
    for (struct pool_acct *a = pools; a; a = a->next) {
        if (a->dev != dev || pthread_mutex_trylock(&a->mu) != 0) continue; /* busy: its owner settles it */
        uint64_t before = a->charged;
        if (trim && real_cuMemPoolTrimTo) real_cuMemPoolTrimTo(a->pool, 0);
        settle_locked(a);
        released |= a->charged < before;
        pthread_mutex_unlock(&a->mu);
    }
    pthread_mutex_unlock(&list_mu);
    return released;
}

static void pools_atfork_child(void) {
    /* the parent's pools are not the child's (and their mutexes may be held by parent threads) */
    pthread_mutex_init(&list_mu, NULL);
    pools = NULL;
}

/* Once, at the first pool: settled by reserve.c, forgotten in a fork child. */
static void pools_register(void) {
    vgpu_mem_add_settle(pools_settle);
    pthread_atfork(NULL, NULL, pools_atfork_child);
}

typedef CUresult (*alloc_async_fn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*alloc_pool_fn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
typedef CUresult (*free_async_fn)(CUdeviceptr, CUstream);

/* Bytes the pool holds freed (reserved but not in use): what it can serve without reserving more. */
static uint64_t pool_cached(struct pool_acct *a) {
    cuuint64_t r = 0, u = 0;
    pool_attr_fn f = get_attr();
    if (f == NULL || f(a->pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &r) != CUDA_SUCCESS ||
        f(a->pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &u) != CUDA_SUCCESS || u > r)
        return 0;
    return r - u;
}

/* a->mu held. The slice is full, yet this pool holds freed blocks (its release threshold keeps
 * them, e.g. UINT64_MAX as cuda.core sets it): the driver serves the request from them without
 * reserving more, so the slice's use does not change. Allocate, and keep the allocation only if
 * the pool's reservation did not grow past what the quota allows. 1 if *dptr is allocated. */
static int alloc_from_cache(struct pool_acct *a, CUdeviceptr *dptr, size_t bytesize, alloc_async_fn fa,
                            alloc_pool_fn fp, CUstream s) {
    if (pool_cached(a) < bytesize) return 0;
    if ((fa ? fa(dptr, bytesize, s) : fp(dptr, bytesize, a->pool, s)) != CUDA_SUCCESS) return 0;
    cuuint64_t r = 0;
    pool_attr_fn f = get_attr();
    uint64_t used;
    if (f && f(a->pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &r) == CUDA_SUCCESS &&
        (r <= a->charged || vgpu_mem_charge_bounded(a->dev, r - a->charged, &used) == 0)) {
        if (r > a->charged) a->charged = r;
        return 1;
    }
    real_cuMemFreeAsync(*dptr, s); /* it took new memory the quota cannot hold */
    return 0;
}

static CUresult charged_alloc(struct pool_acct *a, CUdeviceptr *dptr, size_t bytesize, alloc_async_fn fa,
                              alloc_pool_fn fp, CUstream s) {
    pthread_mutex_lock(&a->mu);
    settle_locked(a); /* a synchronisation may have released cached blocks */
    uint64_t want = vgpu_mem_estimate(a->dev, bytesize), used;
    CUresult rc = CUDA_SUCCESS;
    int allocated = 0;
    if (vgpu_mem_charge_bounded(a->dev, want, &used) != 0) {
        /* Refused as it stands. The refusal path (vgpu_mem_reserve) settles and trims the other
         * pools but cannot touch this one, whose lock we hold: reuse its freed blocks, or trim
         * it, here. */
        allocated = alloc_from_cache(a, dptr, bytesize, fa, fp, s);
        if (!allocated) {
            if (real_cuMemPoolTrimTo) real_cuMemPoolTrimTo(a->pool, 0);
            settle_locked(a);
            rc = vgpu_mem_reserve(a->dev, want);
        }
    }
    if (rc != CUDA_SUCCESS) {
        pthread_mutex_unlock(&a->mu);
        return rc;
    }
    if (!allocated) {
        a->charged += want;
        rc = fa ? fa(dptr, bytesize, s) : fp(dptr, bytesize, a->pool, s);
    }
    if (rc == CUDA_SUCCESS && !allocated) {
        cuuint64_t r = 0;
        pool_attr_fn f = get_attr();
        if (f && f(a->pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &r) == CUDA_SUCCESS && r > a->charged) {
            /* the pool reserved more than asked: that too must fit the quota */
            if (vgpu_mem_reserve(a->dev, r - a->charged) == CUDA_SUCCESS) {
                a->charged = r;
            } else {
                real_cuMemFreeAsync(*dptr, s);
                if (real_cuMemPoolTrimTo) real_cuMemPoolTrimTo(a->pool, 0);
                rc = CUDA_ERROR_OUT_OF_MEMORY;
            }
        }
    }
    if (rc == CUDA_SUCCESS && vgpu_track_add_aux(VGPU_TRACK_ASYNC, *dptr, a->dev, want, (uint64_t)(uintptr_t)a) != 0) {
        real_cuMemFreeAsync(*dptr, s);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc == CUDA_SUCCESS) a->live += want;
    settle_locked(a); /* reused cache: less than provisionally charged; failure: back to before */
    pthread_mutex_unlock(&a->mu);
    return rc;
}

static struct pool_acct *current_pool(int *dev) {
    static ctx_dev_fn ctx_dev;
    if (ctx_dev == NULL) ctx_dev = (ctx_dev_fn)vgpu_cuda_sym("cuCtxGetDevice");
    CUdevice d;
    CUmemoryPool pool;
    if (ctx_dev == NULL || ctx_dev(&d) != CUDA_SUCCESS || (*dev = vgpu_device_index(d)) < 0) return NULL;
    /* (an unaccounted device: *dev is VGPU_DEVICE_UNACCOUNTED, the caller decides) */
    if (real_cuDeviceGetMemPool == NULL || real_cuDeviceGetMemPool(&pool, d) != CUDA_SUCCESS) return NULL;
    return pool_acct(pool, *dev);
}

static CUresult alloc_async(alloc_async_fn real, CUdeviceptr *dptr, size_t bytesize, CUstream s) {
    VGPU_HOOK_OPEN(real);
    CUresult st;
    int dev = -1;
    struct pool_acct *a = NULL;
    if (!vgpu_mem_active() || dptr == NULL || bytesize == 0 ||
        vgpu_graphmem_capturing(s, real == real_cuMemAllocAsync_ptsz)) /* captured: graphmem.c */
        return real(dptr, bytesize, s);
    if ((a = current_pool(&dev)) == NULL && dev != VGPU_DEVICE_UNACCOUNTED)
        return real(dptr, bytesize, s); /* no context or device: the driver's error */
    if (a == NULL) return (st = vgpu_mem_unaccounted()) != CUDA_SUCCESS ? st : real(dptr, bytesize, s);
    return charged_alloc(a, dptr, bytesize, real, NULL, s);
}

static CUresult alloc_pool(alloc_pool_fn real, CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream s) {
    VGPU_HOOK_OPEN(real);
    CUresult st;
    struct pool_acct *a;
    int dev = -1;
    if (!vgpu_mem_active() || dptr == NULL || bytesize == 0 || pool == NULL ||
        vgpu_graphmem_capturing(s, real == real_cuMemAllocFromPoolAsync_ptsz))
        return real(dptr, bytesize, pool, s);
    if ((a = pool_acct(pool, -1)) == NULL) { /* a pool not seen created: the current device's */
        dev = vgpu_current_device_index();
        if (dev == VGPU_DEVICE_UNACCOUNTED)
            return (st = vgpu_mem_unaccounted()) != CUDA_SUCCESS ? st : real(dptr, bytesize, pool, s);
        if ((a = pool_acct(pool, dev)) == NULL) return real(dptr, bytesize, pool, s);
    }
    return charged_alloc(a, dptr, bytesize, NULL, real, s);
}

/* A stream-ordered allocation was freed (cuMemFreeAsync, or cuMemFree which may free them too). */
static void after_free(struct pool_acct *a, uint64_t size) {
    pthread_mutex_lock(&a->mu);
    a->live -= size < a->live ? size : a->live;
    int last = 0;
    if (a->destroyed) { /* the pool is gone: this allocation's bytes are returned as it goes */
        uint64_t b = size < a->charged ? size : a->charged;
        vgpu_mem_release(a->dev, b);
        a->charged -= b;
        last = a->live == 0;
    } else {
        settle_locked(a);
    }
    pthread_mutex_unlock(&a->mu);
    if (last) {
        vgpu_mem_release(a->dev, a->charged);
        free(a);
    }
}

static CUresult free_async(free_async_fn real, CUdeviceptr dptr, CUstream s) {
    VGPU_HOOK_OPEN(real);
    int dev;
    uint64_t size, pa;
    if (!vgpu_mem_active() || !vgpu_track_take_aux(VGPU_TRACK_ASYNC, dptr, &dev, &size, &pa)) return real(dptr, s);
    CUresult rc = real(dptr, s);
    if (rc != CUDA_SUCCESS)
        vgpu_track_add_aux(VGPU_TRACK_ASYNC, dptr, dev, size, pa);
    else
        after_free((struct pool_acct *)(uintptr_t)pa, size);
    return rc;
}

CUresult vgpu_pools_free_sync(CUdeviceptr dptr, CUresult (*real_free)(CUdeviceptr)) {
    int dev;
    uint64_t size, pa;
    if (!vgpu_track_take_aux(VGPU_TRACK_ASYNC, dptr, &dev, &size, &pa)) return real_free(dptr);
    CUresult rc = real_free(dptr);
    if (rc != CUDA_SUCCESS)
        vgpu_track_add_aux(VGPU_TRACK_ASYNC, dptr, dev, size, pa);
    else
        after_free((struct pool_acct *)(uintptr_t)pa, size);
    return rc;
}

CUresult hook_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return alloc_async(real_cuMemAllocAsync, dptr, bytesize, hStream);
}
CUresult hook_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return alloc_async(real_cuMemAllocAsync_ptsz, dptr, bytesize, hStream);
}
CUresult hook_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream) {
    return alloc_pool(real_cuMemAllocFromPoolAsync, dptr, bytesize, pool, hStream);
}
CUresult hook_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream hStream) {
    return alloc_pool(real_cuMemAllocFromPoolAsync_ptsz, dptr, bytesize, pool, hStream);
}
CUresult hook_cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    return free_async(real_cuMemFreeAsync, dptr, hStream);
}
CUresult hook_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    return free_async(real_cuMemFreeAsync_ptsz, dptr, hStream);
}

/* ---- pool lifetime: learn each pool's device; a destroyed pool's charge goes back ---- */

CUresult hook_cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *poolProps) {
    VGPU_HOOK_OPEN(real_cuMemPoolCreate);
    CUresult rc = real_cuMemPoolCreate(pool, poolProps);
    if (rc == CUDA_SUCCESS && vgpu_mem_active() && pool != NULL && poolProps != NULL &&
        poolProps->location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        pool_acct(*pool, vgpu_device_index(poolProps->location.id));
    return rc;
}

CUresult hook_cuMemPoolDestroy(CUmemoryPool pool) {
    VGPU_HOOK_OPEN(real_cuMemPoolDestroy);
    CUresult rc = real_cuMemPoolDestroy(pool);
    if (rc != CUDA_SUCCESS || !vgpu_mem_active()) return rc;
    pthread_mutex_lock(&list_mu);
    struct pool_acct **pp = &pools, *a;
    while ((a = *pp) != NULL && a->pool != pool) pp = &a->next;
    if (a != NULL) *pp = a->next;
    pthread_mutex_unlock(&list_mu);
    if (a == NULL) return rc;
    /* The driver frees a destroyed pool's memory once its last allocation is freed: until then
     * the live allocations stay charged (and the record stays, for their frees). */
    pthread_mutex_lock(&a->mu);
    uint64_t cached = a->charged > a->live ? a->charged - a->live : 0;
    vgpu_mem_release(a->dev, cached);
    a->charged -= cached;
    a->destroyed = 1;
    int last = a->live == 0;
    pthread_mutex_unlock(&a->mu);
    if (last) {
        vgpu_mem_release(a->dev, a->charged);
        free(a);
    }
    return rc;
}

CUresult hook_cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    VGPU_HOOK_OPEN(real_cuMemPoolTrimTo);
    CUresult rc = real_cuMemPoolTrimTo(pool, minBytesToKeep);
    struct pool_acct *a;
    if (rc == CUDA_SUCCESS && vgpu_mem_active() && (a = pool_acct(pool, -1)) != NULL) {
        pthread_mutex_lock(&a->mu);
        settle_locked(a);
        pthread_mutex_unlock(&a->mu);
    }
    return rc;
}

CUresult hook_cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev) {
    VGPU_HOOK_OPEN(real_cuDeviceGetDefaultMemPool);
    CUresult rc = real_cuDeviceGetDefaultMemPool(pool_out, dev);
    if (rc == CUDA_SUCCESS && pool_out != NULL && vgpu_mem_active()) pool_acct(*pool_out, vgpu_device_index(dev));
    return rc;
}

CUresult hook_cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    VGPU_HOOK_OPEN(real_cuDeviceGetMemPool);
    CUresult rc = real_cuDeviceGetMemPool(pool, dev);
    if (rc == CUDA_SUCCESS && pool != NULL && vgpu_mem_active()) pool_acct(*pool, vgpu_device_index(dev));
    return rc;
}

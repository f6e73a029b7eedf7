/*
 * Contexts: the primary context of each device (retained/released by the runtime) and explicit
 * ones (cuCtxCreate); the per-thread stack of current contexts is ctxstack.c's.
 *
 * Creating a context claims this process's node slot (so NVML lists the process) and charges
 * SIMGPU_CONTEXT_MEMORY bytes of device memory (default 500 MiB: a CUDA 12 context on an H100
 * takes a few hundred MiB of device memory before the program allocates anything, which
 * cuMemGetInfo and NVML's per-process used memory show). Creation then takes
 * SIMGPU_CONTEXT_CREATE_MS more (default 0), during which the memory is already taken (NVML shows
 * it) and the call has not returned: a real driver allocates the context's memory early in a
 * creation that takes tens to hundreds of ms, seconds when it first brings up a GPU. Destroying it (or releasing the primary context to zero, or resetting it) waits for its
 * work, frees every allocation made in it and returns that memory.
 *
 * Context structures are never returned to malloc: a stale handle then fails validation (magic
 * cleared) instead of touching freed memory.
 */
#include "context.h"

#include "ctxstack.h"
#include "ctxstore.h"
#include "init.h"
#include "memory.h"
#include "stream.h"

#include "../common/state.h"
#include "../common/util.h"

#include <stdlib.h>
#include <string.h>

#define CTX_FLAGS_MASK 0xffu /* scheduling, map-host, lmem-resize, coredump, sync-memops */

static unsigned primary_flags[SIM_MAX_DEVICES];

void sim_contexts_after_fork(void) { memset(primary_flags, 0, sizeof primary_flags); }

#define CREATE_MS_MAX 10000

/* SIMGPU_CONTEXT_CREATE_MS: how long a context's creation takes after its memory is taken. */
static uint64_t context_create_ns(void) {
    static _Atomic uint64_t cached = UINT64_MAX; /* read once per process */
    uint64_t v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v != UINT64_MAX) return v;
    uint64_t ms = sim_env_u64("SIMGPU_CONTEXT_CREATE_MS", 0);
    if (ms > CREATE_MS_MAX) {
        sim_log("environment SIMGPU_CONTEXT_CREATE_MS=%llu is out of range; allowed: 0 .. %d milliseconds; using 0",
                (unsigned long long)ms, CREATE_MS_MAX);
        ms = 0;
    }
    atomic_store_explicit(&cached, ms * 1000000ull, memory_order_relaxed);
    return ms * 1000000ull;
}

/* The rest of a context's creation, its memory taken (G.lock not held). */
static void creation_time(void) {
    uint64_t ns = context_create_ns();
    if (ns) sim_sleep_until_ns(sim_now_ns() + ns);
}

/* Bring up a (new or inactive primary) context: slot, context memory, legacy stream. G.lock held. */
static CUresult ctx_activate_locked(struct CUctx_st *c, int dev, unsigned flags) {
    if (sim_ensure_slot() < 0) return CUDA_ERROR_OPERATING_SYSTEM;
    if (G.ctx_mem && sim_mem_charge(G.slot, sim_phys(dev), G.ctx_mem, G.cfg->dev[dev].memory) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    c->charged = G.ctx_mem;
    c->dev = dev;
    c->flags = flags;
    c->serial = ++G.ctx_serial;
    atomic_store(&c->tail_all, 0);
    atomic_store(&c->tail_blocking, 0);
    c->gen = sim_gen();
    c->magic = MAGIC_CTX;
    c->legacy = sim_stream_new(c, STREAM_LEGACY, 0, 0);
    if (!c->legacy) {
        sim_mem_uncharge(G.slot, sim_phys(dev), c->charged);
        c->magic = MAGIC_DEAD;
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    sim_ctx_count(G.slot, sim_phys(dev), +1);
    G.live_contexts++;
    return CUDA_SUCCESS;
}

/* Tear down a context's resources (after its work finished). G.lock held. */
static void ctx_deactivate_locked(struct CUctx_st *c) {
    c->serial = ++G.ctx_serial; /* its streams, events and modules die with it */
    sim_free_ctx_allocations(c);
    sim_mem_uncharge(G.slot, sim_phys(c->dev), c->charged);
    c->charged = 0;
    sim_ctx_count(G.slot, sim_phys(c->dev), -1);
    G.live_contexts--;
    if (c->legacy) {
        sim_stream_release(c->legacy);
        c->legacy = NULL;
    }
}

static void wait_ctx_idle(struct CUctx_st *c) { sim_lane_wait(c, atomic_load(&c->tail_all)); }

static CUresult ctx_create(CUcontext *pctx, unsigned flags, CUdevice dev) {
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_device(dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (flags & ~CTX_FLAGS_MASK) return CUDA_ERROR_INVALID_VALUE;
    if (sim_ctx_stack_full()) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c = calloc(1, sizeof *c);
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&G.lock);
    rc = ctx_activate_locked(c, dev, flags);
    pthread_mutex_unlock(&G.lock);
    if (rc != CUDA_SUCCESS) {
        free(c); /* never published */
        return rc;
    }
    creation_time();
    sim_ctx_push(c); /* a new context is pushed onto the calling thread's stack */
    *pctx = c;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams, unsigned int flags,
                                   CUdevice dev) {
    if (ctxCreateParams) {
        if (ctxCreateParams->cigParams)
            return CUDA_ERROR_NOT_SUPPORTED; /* CUDA in graphics (CIG) needs a graphics API */
        if (ctxCreateParams->numExecAffinityParams < 0 ||
            (ctxCreateParams->numExecAffinityParams > 0 && !ctxCreateParams->execAffinityParams))
            return CUDA_ERROR_INVALID_VALUE;
        /* SM-count affinity is accepted and not modelled (every launch uses the whole device). */
    }
    return ctx_create(pctx, flags, dev);
}

SIM_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams, unsigned int flags,
                                   CUdevice dev) {
    if (numParams < 0 || (numParams > 0 && !paramsArray)) return CUDA_ERROR_INVALID_VALUE;
    return ctx_create(pctx, flags, dev);
}

SIM_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    return ctx_create(pctx, flags, dev);
}
SIM_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    return ctx_create(pctx, flags, dev);
}

SIM_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    if (!SIM_VALID(ctx, MAGIC_CTX) || ctx->is_primary) return CUDA_ERROR_INVALID_CONTEXT;
    wait_ctx_idle(ctx);
    sim_ctxstore_end(ctx);
    pthread_mutex_lock(&G.lock);
    if (ctx->magic == MAGIC_CTX) {
        ctx_deactivate_locked(ctx);
        ctx->magic = MAGIC_DEAD;
    }
    pthread_mutex_unlock(&G.lock);
    sim_ctx_drop(ctx);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxDestroy(CUcontext ctx) { return cuCtxDestroy_v2(ctx); }

SIM_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_device(dev);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    struct CUctx_st *c = G.primary[dev];
    if (!c) {
        c = calloc(1, sizeof *c);
        if (!c) {
            pthread_mutex_unlock(&G.lock);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        c->is_primary = 1;
        G.primary[dev] = c;
    }
    int activated = 0;
    if (c->retain == 0) {
        rc = ctx_activate_locked(c, dev, primary_flags[dev]);
        activated = rc == CUDA_SUCCESS;
    }
    if (rc == CUDA_SUCCESS) {
        c->retain++;
        *pctx = c;
    }
    if (activated) creation_time(); /* under the lock: the process's other retains wait for it, as with the driver */
    pthread_mutex_unlock(&G.lock);
    return rc;
}

static CUresult primary_release(CUdevice dev, int reset) {
    CUresult rc = sim_check_device(dev);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    struct CUctx_st *c = G.primary[dev];
    int active = c && c->retain > 0;
    pthread_mutex_unlock(&G.lock);
    if (!active) return reset ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    if (reset || c->retain == 1) {
        wait_ctx_idle(c);
        sim_ctxstore_end(c);
    }
    pthread_mutex_lock(&G.lock);
    if (c->retain > 0) {
        c->retain = reset ? 0 : c->retain - 1;
        if (c->retain == 0) ctx_deactivate_locked(c);
    }
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) { return primary_release(dev, 0); }
SIM_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { return primary_release(dev, 0); }
SIM_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) { return primary_release(dev, 1); }
SIM_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev) { return primary_release(dev, 1); }

SIM_EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_device(dev);
    if (rc != CUDA_SUCCESS) return rc;
    pthread_mutex_lock(&G.lock);
    *flags = primary_flags[dev];
    *active = G.primary[dev] && G.primary[dev]->retain > 0;
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags) {
    CUresult rc = sim_check_device(dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (flags & ~CTX_FLAGS_MASK) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&G.lock);
    primary_flags[dev] = flags;
    if (G.primary[dev]) G.primary[dev]->flags = flags;
    pthread_mutex_unlock(&G.lock);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags) {
    /* Before CUDA 11 this failed on an active primary context. */
    CUresult rc = sim_check_device(dev);
    if (rc != CUDA_SUCCESS) return rc;
    if (G.primary[dev] && G.primary[dev]->retain > 0) return CUDA_ERROR_ILLEGAL_STATE;
    return cuDevicePrimaryCtxSetFlags_v2(dev, flags);
}

static CUresult ctx_sync(struct CUctx_st *c) {
    wait_ctx_idle(c);
    sim_after_sync(c);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxSynchronize(void) {
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    return rc != CUDA_SUCCESS ? rc : ctx_sync(c);
}

SIM_EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx) {
    if (!ctx) return cuCtxSynchronize();
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!sim_ctx_usable(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    return ctx_sync(ctx);
}

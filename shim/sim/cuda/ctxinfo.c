/*
 * Context queries and settings real clients make at start-up: limits (stack, printf FIFO, malloc
 * heap, ...), cache configuration, flags, API version, stream priority range; stream queries
 * (priority, flags, context); host callbacks in stream order. Limits and cache preferences are
 * kept per context and read back; they change nothing the simulator models.
 */
#include "ctxstack.h"
#include "init.h"
#include "smlimits.h"
#include "stream.h"

#include <string.h>

/* Stream priorities as on NVIDIA GPUs since Volta: 0 (least) .. -5 (greatest). */
#define PRIO_LEAST    0
#define PRIO_GREATEST (-5)

static size_t limits_default[CU_LIMIT_MAX] = {
    [CU_LIMIT_STACK_SIZE] = 1024,
    [CU_LIMIT_PRINTF_FIFO_SIZE] = 1048576,
    [CU_LIMIT_MALLOC_HEAP_SIZE] = 8388608,
    [CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH] = 2,
    [CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT] = 2048,
    [CU_LIMIT_MAX_L2_FETCH_GRANULARITY] = 64,
    [CU_LIMIT_PERSISTING_L2_CACHE_SIZE] = 0,
};

/* A limit the driver does not know is an invalid value, as on NVIDIA's driver (cuBLASLt asks a
 * CUDA 13 limit and takes CUDA_ERROR_INVALID_VALUE for "an older driver", any other error as a
 * failed initialisation that leaves it without a device). The CIG shared-memory fallback exists
 * only on CUDA-in-graphics contexts, which the simulator cannot create. */
static CUresult check_limit(CUlimit limit) {
    if ((unsigned)limit >= CU_LIMIT_MAX) return CUDA_ERROR_INVALID_VALUE;
    if ((unsigned)limit > CU_LIMIT_PERSISTING_L2_CACHE_SIZE) return CUDA_ERROR_UNSUPPORTED_LIMIT;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetLimit(size_t *pvalue, CUlimit limit) {
    if (!pvalue) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    switch ((int)limit) {
    case CU_LIMIT_SHMEM_SIZE: /* no context here is a CIG one: all of an SM's shared memory is CUDA's */
        *pvalue = (size_t)sim_sm_limits_of(G.cfg->dev[c->dev].cc_major, G.cfg->dev[c->dev].cc_minor).smem;
        return CUDA_SUCCESS;
    case CU_LIMIT_CIG_ENABLED: *pvalue = 0; return CUDA_SUCCESS;
    default: break;
    }
    rc = check_limit(limit);
    if (rc != CUDA_SUCCESS) return rc;
    *pvalue = c->limit_set[limit] ? c->limits[limit] : limits_default[limit];
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxSetLimit(CUlimit limit, size_t value) {
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (limit == CU_LIMIT_SHMEM_SIZE || limit == CU_LIMIT_CIG_ENABLED) return CUDA_ERROR_INVALID_VALUE; /* query-only */
    rc = check_limit(limit);
    if (rc != CUDA_SUCCESS) return rc;
    if (limit == CU_LIMIT_MAX_L2_FETCH_GRANULARITY && value != 0 && value != 32 && value != 64 && value != 128)
        return CUDA_ERROR_INVALID_VALUE;
    c->limits[limit] = value;
    c->limit_set[limit] = 1;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetCacheConfig(CUfunc_cache *pconfig) {
    if (!pconfig) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc == CUDA_SUCCESS) *pconfig = (CUfunc_cache)c->cache_config;
    return rc;
}

SIM_EXPORT CUresult cuCtxSetCacheConfig(CUfunc_cache config) {
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if ((unsigned)config > CU_FUNC_CACHE_PREFER_EQUAL) return CUDA_ERROR_INVALID_VALUE;
    c->cache_config = (int)config;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetFlags(unsigned int *flags) {
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc == CUDA_SUCCESS) *flags = c->flags;
    return rc;
}

/* ctx itself when given (validated), else the calling thread's current context. */
static CUresult given_or_current(CUcontext ctx, struct CUctx_st **out) {
    if (!ctx) return sim_get_ctx(out);
    if (!SIM_VALID(ctx, MAGIC_CTX)) return CUDA_ERROR_INVALID_CONTEXT;
    *out = ctx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult rc = given_or_current(ctx, &c);
    if (rc != CUDA_SUCCESS) return rc;
    *version = 3020; /* every context created through the _v2 API reports 3020 */
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetId(CUcontext ctx, unsigned long long *ctxId) {
    if (!ctxId) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult rc = given_or_current(ctx, &c);
    if (rc != CUDA_SUCCESS) return rc;
    *ctxId = c->serial; /* unique in the process: a new activation of a primary context is a new id */
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetStreamPriorityRange(int *leastPriority, int *greatestPriority) {
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    if (leastPriority) *leastPriority = PRIO_LEAST;
    if (greatestPriority) *greatestPriority = PRIO_GREATEST;
    return CUDA_SUCCESS;
}

enum { GET_PRIORITY, GET_FLAGS, GET_CTX };

static CUresult stream_get(CUstream h, int ptds, int what, void *out) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s;
    CUresult rc = sim_resolve_stream(h, ptds, &s);
    if (rc != CUDA_SUCCESS) return rc;
    if (what == GET_PRIORITY)
        *(int *)out = s->priority;
    else if (what == GET_FLAGS)
        *(unsigned *)out = s->flags;
    else
        *(CUcontext *)out = s->ctx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamGetPriority(CUstream hStream, int *priority) {
    return stream_get(hStream, 0, GET_PRIORITY, priority);
}
SIM_EXPORT CUresult cuStreamGetPriority_ptsz(CUstream hStream, int *priority) {
    return stream_get(hStream, 1, GET_PRIORITY, priority);
}
SIM_EXPORT CUresult cuStreamGetFlags(CUstream hStream, unsigned int *flags) {
    return stream_get(hStream, 0, GET_FLAGS, flags);
}
SIM_EXPORT CUresult cuStreamGetFlags_ptsz(CUstream hStream, unsigned int *flags) {
    return stream_get(hStream, 1, GET_FLAGS, flags);
}
SIM_EXPORT CUresult cuStreamGetCtx(CUstream hStream, CUcontext *pctx) { return stream_get(hStream, 0, GET_CTX, pctx); }
SIM_EXPORT CUresult cuStreamGetCtx_ptsz(CUstream hStream, CUcontext *pctx) {
    return stream_get(hStream, 1, GET_CTX, pctx);
}

/* Host work in stream order: the simulator waits (sleeps) until the stream's queued work would be
 * done, then runs the function on the calling thread; later work on the stream is queued after it
 * returns. (The real driver runs it on a driver thread and returns at once: a documented limit.) */
static CUresult host_call(CUstream h, int ptds, void (*fn)(CUstream, CUresult, void *), CUhostFn hostfn, void *user) {
    struct CUstream_st *s;
    CUresult rc = sim_resolve_stream(h, ptds, &s);
    if (rc != CUDA_SUCCESS) return rc;
    if (s->capturing) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* host nodes are not modelled */
    rc = sim_stream_wait(s);
    if (rc != CUDA_SUCCESS) return rc;
    if (fn)
        fn(h, CUDA_SUCCESS, user);
    else
        hostfn(user);
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuStreamAddCallback(CUstream hStream, CUstreamCallback callback, void *userData,
                                        unsigned int flags) {
    if (!callback || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    return host_call(hStream, 0, callback, NULL, userData);
}

SIM_EXPORT CUresult cuStreamAddCallback_ptsz(CUstream hStream, CUstreamCallback callback, void *userData,
                                             unsigned int flags) {
    if (!callback || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    return host_call(hStream, 1, callback, NULL, userData);
}

SIM_EXPORT CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData) {
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    return host_call(hStream, 0, NULL, fn, userData);
}

SIM_EXPORT CUresult cuLaunchHostFunc_ptsz(CUstream hStream, CUhostFn fn, void *userData) {
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    return host_call(hStream, 1, NULL, fn, userData);
}

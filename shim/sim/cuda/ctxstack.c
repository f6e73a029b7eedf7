/*
 * The calling thread's stack of current contexts (cuCtxGetCurrent, cuCtxSetCurrent, push and pop),
 * and the current context every call that works in one looks up.
 */
#include "ctxstack.h"

#include "init.h"

#define CTX_STACK_MAX 64

static __thread struct CUctx_st *tls_stack[CTX_STACK_MAX];
static __thread int tls_depth;

void sim_ctxstack_after_fork(void) { tls_depth = 0; }

int sim_ctx_usable(const struct CUctx_st *c) { return SIM_VALID(c, MAGIC_CTX) && !(c->is_primary && c->retain == 0); }

struct CUctx_st *sim_current_ctx(void) {
    if (tls_depth <= 0) return NULL;
    struct CUctx_st *c = tls_stack[tls_depth - 1];
    return sim_ctx_usable(c) ? c : NULL;
}

CUresult sim_get_ctx(struct CUctx_st **out) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    struct CUctx_st *c = sim_current_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    *out = c;
    return CUDA_SUCCESS;
}

int sim_ctx_stack_full(void) { return tls_depth >= CTX_STACK_MAX; }

void sim_ctx_push(struct CUctx_st *c) { tls_stack[tls_depth++] = c; }

void sim_ctx_drop(struct CUctx_st *c) {
    /* Only the calling thread's stack can be fixed up; other threads fail validation later. */
    int w = 0;
    for (int r = 0; r < tls_depth; r++)
        if (tls_stack[r] != c) tls_stack[w++] = tls_stack[r];
    tls_depth = w;
}

SIM_EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx) {
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    *pctx = sim_current_ctx();
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!ctx) {
        if (tls_depth > 0) tls_depth--;
        return CUDA_SUCCESS;
    }
    if (!sim_ctx_usable(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if (tls_depth == 0)
        tls_stack[tls_depth++] = ctx;
    else
        tls_stack[tls_depth - 1] = ctx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!ctx || !sim_ctx_usable(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if (tls_depth >= CTX_STACK_MAX) return CUDA_ERROR_INVALID_VALUE;
    tls_stack[tls_depth++] = ctx;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxPushCurrent(CUcontext ctx) { return cuCtxPushCurrent_v2(ctx); }

SIM_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (tls_depth <= 0) return CUDA_ERROR_INVALID_CONTEXT;
    struct CUctx_st *c = tls_stack[--tls_depth];
    if (pctx) *pctx = c;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxPopCurrent(CUcontext *pctx) { return cuCtxPopCurrent_v2(pctx); }

SIM_EXPORT CUresult cuCtxGetDevice(CUdevice *device) {
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    struct CUctx_st *c;
    CUresult rc = sim_get_ctx(&c);
    if (rc != CUDA_SUCCESS) return rc;
    *device = c->dev;
    return CUDA_SUCCESS;
}

SIM_EXPORT CUresult cuCtxGetDevice_v2(CUdevice *device, CUcontext ctx) {
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (!ctx) return cuCtxGetDevice(device);
    CUresult rc = sim_check_init();
    if (rc != CUDA_SUCCESS) return rc;
    if (!sim_ctx_usable(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    *device = ctx->dev;
    return CUDA_SUCCESS;
}

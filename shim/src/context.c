/*
 * The context's own footprint (VGPU_CONTEXT_RESERVE bytes per context, default 0): charged before
 * a context is created, returned when it is destroyed. Primary contexts are charged at the
 * process's first retain of a device and returned when its last retain is released or reset.
 */
#include <pthread.h>

#include "shim_internal.h"

static pthread_mutex_t primary_mu = PTHREAD_MUTEX_INITIALIZER;
static int primary_refs[VGPU_MAX_DEVICES];

static int reserve_on(void) { return vgpu_mem_active() && vgpu_config()->context_reserve != 0; }

CUresult hook_cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real_cuDevicePrimaryCtxRetain == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int idx;
    if (!reserve_on() || pctx == NULL || (idx = vgpu_device_index(dev)) < 0) return real_cuDevicePrimaryCtxRetain(pctx, dev);
    uint64_t r = vgpu_config()->context_reserve;
    /* serialised per process: the first retain charges exactly once */
    pthread_mutex_lock(&primary_mu);
    CUresult rc = CUDA_SUCCESS;
    int first = primary_refs[idx] == 0;
    if (first) rc = vgpu_mem_reserve(idx, r);
    if (rc == CUDA_SUCCESS) {
        rc = real_cuDevicePrimaryCtxRetain(pctx, dev);
        if (rc == CUDA_SUCCESS) primary_refs[idx]++;
        else if (first) vgpu_mem_release(idx, r);
    }
    pthread_mutex_unlock(&primary_mu);
    return rc;
}

static CUresult primary_drop(CUresult (*real)(CUdevice), CUdevice dev, int reset) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int idx;
    if (!reserve_on() || (idx = vgpu_device_index(dev)) < 0) return real(dev);
    pthread_mutex_lock(&primary_mu);
    CUresult rc = real(dev);
    if (rc == CUDA_SUCCESS && primary_refs[idx] > 0) {
        primary_refs[idx] = reset ? 0 : primary_refs[idx] - 1;
        if (primary_refs[idx] == 0) vgpu_mem_release(idx, vgpu_config()->context_reserve);
    }
    pthread_mutex_unlock(&primary_mu);
    return rc;
}

CUresult hook_cuDevicePrimaryCtxRelease_v2(CUdevice dev) { return vgpu_modules_primary_gone(dev, 0, primary_drop(real_cuDevicePrimaryCtxRelease_v2, dev, 0)); }
CUresult hook_cuDevicePrimaryCtxRelease(CUdevice dev) { return vgpu_modules_primary_gone(dev, 0, primary_drop(real_cuDevicePrimaryCtxRelease, dev, 0)); }
CUresult hook_cuDevicePrimaryCtxReset_v2(CUdevice dev) { return vgpu_modules_primary_gone(dev, 1, primary_drop(real_cuDevicePrimaryCtxReset_v2, dev, 1)); }
CUresult hook_cuDevicePrimaryCtxReset(CUdevice dev) { return vgpu_modules_primary_gone(dev, 1, primary_drop(real_cuDevicePrimaryCtxReset, dev, 1)); }

/* ---- created contexts ---- */

static CUresult ctx_pre(CUcontext *pctx, CUdevice dev, int *idx) {
    *idx = -1;
    if (!reserve_on() || pctx == NULL || (*idx = vgpu_device_index(dev)) < 0) return CUDA_SUCCESS;
    return vgpu_mem_reserve(*idx, vgpu_config()->context_reserve);
}

static CUresult ctx_post(CUresult rc, CUcontext *pctx, int idx) {
    if (idx < 0) return rc;
    uint64_t r = vgpu_config()->context_reserve;
    if (rc != CUDA_SUCCESS) vgpu_mem_release(idx, r);
    else if (vgpu_track_add(VGPU_TRACK_CTX, (uint64_t)(uintptr_t)*pctx, idx, r) != 0) vgpu_mem_release(idx, r);
    return rc;
}

#define CTX_CREATE(real, call)                                                                     \
    CUresult st = vgpu_init();                                                                     \
    if (st != CUDA_SUCCESS) return st;                                                             \
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;                                             \
    int idx;                                                                                       \
    if ((st = ctx_pre(pctx, dev, &idx)) != CUDA_SUCCESS) return st;                                \
    return ctx_post(call, pctx, idx);

CUresult hook_cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *p, unsigned int flags, CUdevice dev) {
    CTX_CREATE(real_cuCtxCreate_v4, real_cuCtxCreate_v4(pctx, p, flags, dev))
}
CUresult hook_cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *a, int n, unsigned int flags, CUdevice dev) {
    CTX_CREATE(real_cuCtxCreate_v3, real_cuCtxCreate_v3(pctx, a, n, flags, dev))
}
CUresult hook_cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    CTX_CREATE(real_cuCtxCreate_v2, real_cuCtxCreate_v2(pctx, flags, dev))
}
CUresult hook_cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    CTX_CREATE(real_cuCtxCreate, real_cuCtxCreate(pctx, flags, dev))
}

static CUresult ctx_destroy(CUresult (*real)(CUcontext), CUcontext ctx) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    if (real == NULL) return CUDA_ERROR_NOT_SUPPORTED;
    int idx;
    uint64_t bytes, key = (uint64_t)(uintptr_t)ctx;
    if (!vgpu_mem_active() || !vgpu_track_take(VGPU_TRACK_CTX, key, &idx, &bytes)) return real(ctx);
    CUresult rc = real(ctx);
    if (rc == CUDA_SUCCESS) vgpu_mem_release(idx, bytes);
    else vgpu_track_add(VGPU_TRACK_CTX, key, idx, bytes);
    return rc;
}

CUresult hook_cuCtxDestroy_v2(CUcontext ctx) { return vgpu_modules_ctx_gone(ctx, ctx_destroy(real_cuCtxDestroy_v2, ctx)); }
CUresult hook_cuCtxDestroy(CUcontext ctx) { return vgpu_modules_ctx_gone(ctx, ctx_destroy(real_cuCtxDestroy, ctx)); }

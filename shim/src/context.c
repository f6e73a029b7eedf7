/*
 * A context's own device memory, charged to the slice: what the driver took for it, measured
 * when it is created (ctxmem.c), at least VGPU_CONTEXT_RESERVE; once the slice has learned it,
 * that size without asking the driver again. Before the context is created, what one on the
 * device is expected to take (the learned size, the handed-over VGPU_CONTEXT_SIZE, the process's
 * last measurement, or the floor) is reserved: one that does not fit is refused before it exists.
 * After, a measured one's reservation is settled to the measurement; one that then does not fit
 * in what is left of the quota is destroyed again (a primary context released) and its creation
 * fails with CUDA_ERROR_OUT_OF_MEMORY. Only then is the measurement published to the slice, whose
 * other processes wait for it before creating theirs (ctxmem.c). A handed-over size
 * (VGPU_CONTEXT_SIZE) is reserved and charged as it is, then settled on the driver's figure by
 * ctxmem.c's verifier, down as well as up, together with the record this file returns at the
 * context's end (settle_context). The charge is returned when the context is destroyed, when
 * the primary context is released to inactive or reset, and when the process dies (its slot).
 * Primary contexts are charged at the process's first retain of a device.
 *
 * NVIDIA's CUDA runtime (PyTorch, CuPy, anything on libcudart) retains the primary context
 * through its private table (exporttab.c), out of the shim's sight; the table cannot be wrapped
 * (the runtime's integrity check covers its address). In a process that was handed that table,
 * a primary context the shim did not charge is adopted at first sight: before the process's next
 * charge or cuMemGetInfo on the device (vgpu_primary_adopt), and in any process at its first
 * cuDevicePrimaryCtxRetain of a device whose primary context is active already, that context is
 * charged as it is: this process's NVML entry less what the process charged, else the size a
 * context on the device is expected to take (learned by the slice, handed over, or the floor);
 * even past the quota (it exists). It counts as one retain. Such a context is charged after it
 * was created, not admitted before: the slice can exceed its quota by one context when it was
 * full already (logged), never by more.
 */
#include <pthread.h>

#include "context.h"
#include "burst.h"
#include "compute.h"
#include "config.h"
#include "ctxmem.h"
#include "devices.h"
#include "hooks.h"
#include "init.h"
#include "log.h"
#include "modules.h"
#include "region.h"
#include "reserve.h"
#include "symbols.h"
#include "track.h"

/* One context creation or teardown at a time in the process: the driver's readings around a
 * creation must not include another one. */
static pthread_mutex_t ctx_mu = PTHREAD_MUTEX_INITIALIZER;
static int primary_refs[VGPU_MAX_DEVICES]; /* written under ctx_mu, read atomically */
static uint64_t primary_charge[VGPU_MAX_DEVICES];
static pthread_t ctx_owner; /* the thread holding ctx_mu (valid while ctx_held) */
static int ctx_held;
static int runtime_route;             /* the runtime's private table was handed out: adopt its contexts */
static int created[VGPU_MAX_DEVICES]; /* live cuCtxCreate* contexts */

static void ctx_lock(void) {
    pthread_mutex_lock(&ctx_mu);
    ctx_owner = pthread_self();
    __atomic_store_n(&ctx_held, 1, __ATOMIC_RELEASE);
}
static void ctx_unlock(void) {
    __atomic_store_n(&ctx_held, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&ctx_mu);
}
static void adopt_locked(int idx, CUdevice dev);
static int primary_active(CUdevice dev);

/* This thread holds ctx_mu (it is charging a context): nothing to adopt, and no lock to take. */
static int ctx_mine(void) {
    return __atomic_load_n(&ctx_held, __ATOMIC_ACQUIRE) && pthread_equal(ctx_owner, pthread_self());
}

#define PRIMARY_KEY UINT64_MAX /* settle_context's key of a device's primary context */

/* A handed-over size verified (ctxmem.c, on its own thread): the context's charge moves from
 * `from` to the driver's figure `to`, with this file's record of it (key: the created context,
 * PRIMARY_KEY the device's primary context, 0 none: a context not charged), so that its
 * destruction returns what it is charged. The record is moved first and only if it still holds
 * `from`: a context destroyed meanwhile returned `from` and nothing more is done; one destroyed
 * just after returns `to`, and the slice's charge moved by the difference here adds up to the
 * same. Up even past the quota (the context exists). */
static int settle_context(int idx, uint64_t key, uint64_t from, uint64_t to) {
    uint64_t expected = from, used = 0;
    int moved = key == 0             ? 0
                : key == PRIMARY_KEY ? __atomic_compare_exchange_n(&primary_charge[idx], &expected, to, 0,
                                                                   __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)
                                     : vgpu_track_move_bytes(VGPU_TRACK_CTX, key, from, to);
    if (moved && to > from) vgpu_region_charge(idx, to - from, 0, &used);
    if (moved && to < from) vgpu_mem_release(idx, from - to);
    return moved;
}

/* Before refusing an allocation: a verification under way may give back a handed-over size that
 * was too large (reserve.c's settle functions; trim has no meaning here). */
static int settle_verification(int idx, int trim) {
    (void)trim;
    return vgpu_ctxmem_wait_verified(idx);
}

/* Before a context is created on idx: reserve what it is expected to take (the slice's learned
 * size: all there is to do), else read the driver. On failure nothing is held. */
static CUresult charge_begin(int idx, CUdevice dev, struct vgpu_ctxmem_probe *p, uint64_t *held) {
    *held = vgpu_ctxmem_expect(p, idx, dev);
    if (p->hinted) vgpu_mem_add_settle(settle_verification); /* registered once */
    p->settle = settle_context;
    if (*held != 0 && vgpu_mem_reserve(idx, *held) != CUDA_SUCCESS) {
        vgpu_ctxmem_cancel(p);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (!p->learned) vgpu_ctxmem_before(p, dev, primary_refs[idx] == 0 && created[idx] == 0);
    return CUDA_SUCCESS;
}

/* After the driver created it: settle the reservation (*held) to what it took. On refusal the
 * caller destroys the context, then returns *held. */
static CUresult charge_end(struct vgpu_ctxmem_probe *p, uint64_t *held) {
    uint64_t c = vgpu_ctxmem_after(p);
    if (c > *held) {
        if (vgpu_mem_reserve(p->dev, c - *held) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    } else if (c < *held) {
        vgpu_mem_release(p->dev, *held - c);
    }
    *held = c;
    return CUDA_SUCCESS;
}

static CUresult primary_release_real(CUdevice dev) {
    if (real_cuDevicePrimaryCtxRelease_v2 != NULL) return real_cuDevicePrimaryCtxRelease_v2(dev);
    if (real_cuDevicePrimaryCtxRelease != NULL) return real_cuDevicePrimaryCtxRelease(dev);
    return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult hook_cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    VGPU_HOOK_OPEN(real_cuDevicePrimaryCtxRetain);
    CUresult st;
    int idx = -1;
    if (!vgpu_mem_active() || pctx == NULL || (idx = vgpu_device_index(dev)) < 0) {
        /* a context is memory too: none on a device the slice cannot account (fail closed) */
        if (idx == VGPU_DEVICE_UNACCOUNTED && (st = vgpu_mem_unaccounted()) != CUDA_SUCCESS) return st;
        return real_cuDevicePrimaryCtxRetain(pctx, dev);
    }
    ctx_lock();
    CUresult rc;
    if (primary_refs[idx] > 0) { /* charged at the first retain */
        rc = real_cuDevicePrimaryCtxRetain(pctx, dev);
        if (rc == CUDA_SUCCESS) __atomic_store_n(&primary_refs[idx], primary_refs[idx] + 1, __ATOMIC_RELEASE);
        ctx_unlock();
        return rc;
    }
    if (primary_active(dev)) { /* retained already, out of sight: charged as it is, then this retain */
        adopt_locked(idx, dev);
        rc = real_cuDevicePrimaryCtxRetain(pctx, dev);
        if (rc == CUDA_SUCCESS) __atomic_store_n(&primary_refs[idx], primary_refs[idx] + 1, __ATOMIC_RELEASE);
        ctx_unlock();
        return rc;
    }
    struct vgpu_ctxmem_probe probe;
    uint64_t held;
    rc = charge_begin(idx, dev, &probe, &held);
    if (rc == CUDA_SUCCESS) {
        rc = real_cuDevicePrimaryCtxRetain(pctx, dev);
        if (rc != CUDA_SUCCESS) {
            vgpu_mem_release(idx, held);
            vgpu_ctxmem_cancel(&probe);
        } else {
            if ((rc = charge_end(&probe, &held)) != CUDA_SUCCESS) {
                primary_release_real(dev);
                vgpu_mem_release(idx, held);
            } else {
                __atomic_store_n(&primary_charge[idx], held, __ATOMIC_SEQ_CST);
                __atomic_store_n(&primary_refs[idx], 1, __ATOMIC_RELEASE);
            }
            probe.key = rc == CUDA_SUCCESS ? PRIMARY_KEY : 0; /* a verification settles primary_charge */
            vgpu_ctxmem_done(&probe);                         /* charged or gone: the slice's others may go on */
        }
    }
    ctx_unlock();
    return rc;
}

static CUresult primary_drop(CUresult (*real)(CUdevice), CUdevice dev, int reset) {
    VGPU_HOOK_OPEN(real);
    int idx;
    if (!vgpu_mem_active() || (idx = vgpu_device_index(dev)) < 0) return real(dev);
    ctx_lock();
    CUresult rc = real(dev);
    if (rc == CUDA_SUCCESS && primary_refs[idx] > 0) {
        __atomic_store_n(&primary_refs[idx], reset ? 0 : primary_refs[idx] - 1, __ATOMIC_RELEASE);
        /* exchanged: a verification settling the charge meanwhile moves it with the slice's */
        if (primary_refs[idx] == 0)
            vgpu_mem_release(idx, __atomic_exchange_n(&primary_charge[idx], 0, __ATOMIC_SEQ_CST));
    }
    ctx_unlock();
    return rc;
}

CUresult hook_cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    return vgpu_compute_ctx_gone(
        vgpu_modules_primary_gone(dev, 0, primary_drop(real_cuDevicePrimaryCtxRelease_v2, dev, 0)));
}
CUresult hook_cuDevicePrimaryCtxRelease(CUdevice dev) {
    return vgpu_compute_ctx_gone(
        vgpu_modules_primary_gone(dev, 0, primary_drop(real_cuDevicePrimaryCtxRelease, dev, 0)));
}
CUresult hook_cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    return vgpu_compute_ctx_gone(
        vgpu_modules_primary_gone(dev, 1, primary_drop(real_cuDevicePrimaryCtxReset_v2, dev, 1)));
}
CUresult hook_cuDevicePrimaryCtxReset(CUdevice dev) {
    return vgpu_compute_ctx_gone(vgpu_modules_primary_gone(dev, 1, primary_drop(real_cuDevicePrimaryCtxReset, dev, 1)));
}

/* ---- primary contexts retained out of sight (the CUDA runtime's private table) ---- */

void vgpu_primary_runtime_route(void) {
    __atomic_store_n(&runtime_route, 1, __ATOMIC_RELEASE);
    vgpu_mem_before_charge(vgpu_primary_adopt); /* every charge adopts first */
}

/* Charge idx's primary context, which exists but was not charged (under ctx_mu, refs 0): what
 * this process's NVML entry says it takes, else what a context on the device is expected to
 * take; even past the quota (it exists). It then counts as one retain. */
static void adopt_locked(int idx, CUdevice dev) {
    struct vgpu_ctxmem_probe probe;
    uint64_t bytes = vgpu_ctxmem_expect(&probe, idx, dev), used = 0;
    if (!probe.learned) {
        uint64_t m = vgpu_ctxmem_existing(&probe, dev), floor = vgpu_config()->context_reserve;
        if (m != 0) bytes = m > floor ? m : floor;
    }
    int over = vgpu_region_charge(idx, bytes, vgpu_burst_bound(idx), &used) != 0; /* a bursting slice: its grant too */
    if (over) vgpu_region_charge(idx, bytes, 0, &used);
    vgpu_ctxmem_done(&probe); /* publishes a measurement, or drops the claim */
    __atomic_store_n(&primary_charge[idx], bytes, __ATOMIC_SEQ_CST);
    __atomic_store_n(&primary_refs[idx], 1, __ATOMIC_RELEASE);
    char b[32];
    vgpu_format_bytes(bytes, b, sizeof b);
    vgpu_log(over ? VGPU_LOG_WARN : VGPU_LOG_DEBUG,
             "device %d: a primary context was retained out of the shim's sight (the CUDA runtime's private "
             "table): charged %s%s",
             idx, b, over ? ", past the quota (allocations are refused until the slice is back under it)" : "");
}

typedef CUresult (*state_fn)(CUdevice, unsigned int *, int *);

/* Is dev's primary context active (retained by someone)? 0 when the driver cannot tell. */
static int primary_active(CUdevice dev) {
    static state_fn state;
    if (state == NULL) state = (state_fn)vgpu_cuda_sym("cuDevicePrimaryCtxGetState");
    unsigned int flags = 0;
    int active = 0;
    return state != NULL && state(dev, &flags, &active) == CUDA_SUCCESS && active;
}

void vgpu_primary_adopt(int idx) {
    if (!__atomic_load_n(&runtime_route, __ATOMIC_ACQUIRE) || idx < 0 || idx >= VGPU_MAX_DEVICES) return;
    if (__atomic_load_n(&primary_refs[idx], __ATOMIC_ACQUIRE) > 0 || ctx_mine()) return; /* charged already */
    CUdevice dev;
    if (vgpu_device_handle(idx, &dev) != 0) return;
    /* Called with other locks held (a pool's, a device's graph pool's) that a context's charge
     * path takes after ctx_mu: never wait for it here. Busy means another thread is creating,
     * retaining or destroying a context: the next charge or cuMemGetInfo adopts. */
    if (pthread_mutex_trylock(&ctx_mu) != 0) return;
    ctx_owner = pthread_self();
    __atomic_store_n(&ctx_held, 1, __ATOMIC_RELEASE);
    if (primary_refs[idx] == 0 && primary_active(dev)) adopt_locked(idx, dev);
    ctx_unlock();
}

/* ---- created contexts ---- */

static CUresult ctx_destroy_real(CUcontext ctx) {
    if (real_cuCtxDestroy_v2 != NULL) return real_cuCtxDestroy_v2(ctx);
    if (real_cuCtxDestroy != NULL) return real_cuCtxDestroy(ctx);
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* The context creation is one of four entry points: each is called through this. */
struct ctx_create_call {
    CUresult (*create)(const struct ctx_create_call *c);
    CUcontext *pctx;
    CUctxCreateParams *params;
    CUexecAffinityParam *affinity;
    int naffinity;
    unsigned int flags;
    CUdevice dev;
};

static CUresult ctx_create(const struct ctx_create_call *c) {
    CUresult st = vgpu_init();
    if (st != CUDA_SUCCESS) return st;
    int idx = -1;
    if (!vgpu_mem_active() || c->pctx == NULL || (idx = vgpu_device_index(c->dev)) < 0) {
        if (idx == VGPU_DEVICE_UNACCOUNTED && (st = vgpu_mem_unaccounted()) != CUDA_SUCCESS) return st;
        return c->create(c);
    }
    ctx_lock();
    struct vgpu_ctxmem_probe probe;
    uint64_t held;
    CUresult rc = charge_begin(idx, c->dev, &probe, &held);
    if (rc == CUDA_SUCCESS) {
        rc = c->create(c);
        if (rc != CUDA_SUCCESS) {
            vgpu_mem_release(idx, held);
            vgpu_ctxmem_cancel(&probe);
        } else {
            if ((rc = charge_end(&probe, &held)) != CUDA_SUCCESS) {
                ctx_destroy_real(*c->pctx); /* nothing of it stays behind */
                *c->pctx = NULL;
                vgpu_mem_release(idx, held);
            } else {
                if (vgpu_track_add(VGPU_TRACK_CTX, (uint64_t)(uintptr_t)*c->pctx, idx, held) != 0)
                    vgpu_mem_release(idx, held); /* cannot be returned later: not charged at all */
                created[idx]++;
            }
            probe.key = rc == CUDA_SUCCESS ? (uint64_t)(uintptr_t)*c->pctx : 0; /* its record's key */
            vgpu_ctxmem_done(&probe); /* charged or gone: the slice's others may go on */
        }
    }
    ctx_unlock();
    return rc;
}

static CUresult create_v4(const struct ctx_create_call *c) {
    return real_cuCtxCreate_v4(c->pctx, c->params, c->flags, c->dev);
}
static CUresult create_v3(const struct ctx_create_call *c) {
    return real_cuCtxCreate_v3(c->pctx, c->affinity, c->naffinity, c->flags, c->dev);
}
static CUresult create_v2(const struct ctx_create_call *c) { return real_cuCtxCreate_v2(c->pctx, c->flags, c->dev); }
static CUresult create_v1(const struct ctx_create_call *c) { return real_cuCtxCreate(c->pctx, c->flags, c->dev); }

/* vgpu_init() resolves the real functions: checked after it (ctx_create), never before. */
#define CTX_CREATE(real, ...)                                                                                          \
    struct ctx_create_call c = {__VA_ARGS__};                                                                          \
    VGPU_HOOK_OPEN(real);                                                                                              \
    return ctx_create(&c);

CUresult hook_cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *p, unsigned int flags,
                             CUdevice dev){CTX_CREATE(real_cuCtxCreate_v4, .create = create_v4, .pctx = pctx,
                                                      .params = p, .flags = flags, .dev = dev)} CUresult
    hook_cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *a, int n, unsigned int flags,
                        CUdevice dev){CTX_CREATE(real_cuCtxCreate_v3, .create = create_v3, .pctx = pctx, .affinity = a,
                                                 .naffinity = n, .flags = flags, .dev = dev)} CUresult
    hook_cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev){
        CTX_CREATE(real_cuCtxCreate_v2, .create = create_v2, .pctx = pctx, .flags = flags, .dev = dev)} CUresult
    hook_cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    CTX_CREATE(real_cuCtxCreate, .create = create_v1, .pctx = pctx, .flags = flags, .dev = dev)
}

static CUresult ctx_destroy(CUresult (*real)(CUcontext), CUcontext ctx) {
    VGPU_HOOK_OPEN(real);
    int idx;
    uint64_t bytes, key = (uint64_t)(uintptr_t)ctx;
    if (!vgpu_mem_active()) return real(ctx);
    ctx_lock();
    CUresult rc;
    if (!vgpu_track_take(VGPU_TRACK_CTX, key, &idx, &bytes)) {
        rc = real(ctx);
    } else if ((rc = real(ctx)) == CUDA_SUCCESS) {
        vgpu_mem_release(idx, bytes);
        if (created[idx] > 0) created[idx]--;
    } else {
        vgpu_track_add(VGPU_TRACK_CTX, key, idx, bytes);
    }
    ctx_unlock();
    return rc;
}

CUresult hook_cuCtxDestroy_v2(CUcontext ctx) {
    return vgpu_compute_ctx_gone(vgpu_modules_ctx_gone(ctx, ctx_destroy(real_cuCtxDestroy_v2, ctx)));
}
CUresult hook_cuCtxDestroy(CUcontext ctx) {
    return vgpu_compute_ctx_gone(vgpu_modules_ctx_gone(ctx, ctx_destroy(real_cuCtxDestroy, ctx)));
}

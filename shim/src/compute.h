/*
 * The compute cap's gate, called by the launch hooks (launch_hooks.c) around the real launch:
 *
 *     struct vgpu_launch L;
 *     vgpu_compute_before(&L, key, grid, stream);   // may sleep (never holding a lock)
 *     CUresult r = real_cuLaunchKernel(...);
 *     vgpu_compute_after(&L, r);
 *
 * key: what the cost is learned for (CUfunction, or CUgraphExec); grid: the launch shape
 * (0 for graphs); stream: the stream the work goes to, with the per-thread default stream spelt
 * CU_STREAM_PER_THREAD for the _ptsz entry points (the measurement events go to the same stream).
 */
#ifndef VGPU_COMPUTE_H
#define VGPU_COMPUTE_H

#include <stdint.h>

#include "vgpu/cuda_api.h"

struct cctx;
struct vgpu_compute_state;

struct vgpu_launch {
    int active; /* the gate charged this launch; after() must see it */
    int dev;
    int slot; /* measurement ring slot, -1 = none */
    int measure_failed;
    uint32_t eff;
    struct cctx *cx;
    struct vgpu_compute_state *st; /* the device's shared state (for after) */
    uintptr_t key;
    uint64_t grid;
    uint64_t cost;
    int64_t step;       /* the cost's wall time in the bucket under eff (vc_wall_ns) */
    int64_t now;        /* host time at the gate */
    int64_t start_done; /* host time by which the start event was seen complete; 0 = not seen */
    CUstream stream;
};

/* A cap is configured and the policy is not off (hidden), for the launch hooks' fast path:
 * written once by the init. */
extern int vgpu_compute_on;
/* Parse the compute cap's settings, once, from vgpu_init (after the configuration, before the
 * region is opened; never when control is disabled): 0, or nonzero after the config-error line. */
int vgpu_compute_init(void);
uint32_t vgpu_compute_cap_permille(int dev);
void vgpu_compute_before(struct vgpu_launch *L, uintptr_t key, uint64_t grid, CUstream stream);
void vgpu_compute_after(struct vgpu_launch *L, CUresult launched);
/* A context may be gone (cuCtxDestroy, a primary context released or reset): called by those
 * hooks (context.c) after the driver's call, whatever it returned (returned unchanged). Drops
 * every thread's cached device of its current context (vgpu_compute_before). */
CUresult vgpu_compute_ctx_gone(CUresult rc);

/* Stream capture (the capture hooks, launch_hooks.c): delta +1 before a capture begins, -1 when
 * one failed to begin or has ended. While the process has none in progress, the gate does not ask
 * the driver whether a launch's stream is capturing. */
void vgpu_compute_captures(int delta);
/* Whether the stream is capturing (1), not (0, also where the driver predates capture), or the
 * driver cannot say (-1). */
int vgpu_compute_stream_capturing(CUstream stream);

/* The launch shape as one number: total blocks, and threads per block in the high bits. */
static inline uint64_t vgpu_launch_shape(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz) {
    uint64_t blocks = (uint64_t)gx * gy * gz;
    uint64_t threads = (uint64_t)bx * by * bz;
    return (blocks & ((1ULL << 44) - 1)) | (threads << 44);
}

#endif

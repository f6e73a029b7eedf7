/* A context's own device memory, learned from the driver (ctxmem.c). */
#ifndef VGPU_CTXMEM_H
#define VGPU_CTXMEM_H

#include <stdint.h>
#include "vgpu/cuda_api.h"

#define VGPU_CTXMEM_PIDS 256
struct vgpu_ctxmem_probe { /* the driver's readings before a context is created */
    int dev, first, have_dev, have_self, have_pids, exact;
    int learned;                 /* the slice knew the size: charge is charged, nothing is read */
    int hinted;                  /* measuring for the slice with VGPU_CONTEXT_SIZE charged: verified by a thread */
    int plugin;                  /* the plugin's VGPU_CONTEXT_SIZE_<i> (limits file) charged: NVML not asked */
    int claimed;                 /* this process measures for the slice: publish (or drop) the claim */
    uint64_t charge, cuda_total; /* cuda_total: the device's memory by the driver, 0 unknown */
    uint64_t dev_used, total, self_used;
    uint64_t pub_bytes;  /* measured by vgpu_ctxmem_after, published by vgpu_ctxmem_done */
    uint32_t pub_source; /* VGPU_CONTEXT_*: UNKNOWN when there is nothing to publish */
    unsigned npids, pids[VGPU_CTXMEM_PIDS];
    /* set by the caller before vgpu_ctxmem_done: how a verification of a handed-over size moves
     * the context's charge from the bytes charged to the driver's figure, down as well as up
     * (context.c: its record of the context, key, and the slice's charge; nonzero if the context
     * was still there to move). Called on the verifier's thread, never under the caller's locks. */
    int (*settle)(int dev, uint64_t key, uint64_t from, uint64_t to);
    uint64_t key;
};
/* Before a context on device index dev is created: what to reserve for it. The slice's learned
 * size when it knows one (p->learned: nothing else to do, vgpu_ctxmem_after returns it), waiting
 * for another process of the slice that is measuring it (as long as it lives); else the
 * estimate, and the caller reads the driver (vgpu_ctxmem_before). Callers serialise context
 * creation in the process; after vgpu_ctxmem_expect, either vgpu_ctxmem_cancel, or
 * vgpu_ctxmem_after then vgpu_ctxmem_done. */
uint64_t vgpu_ctxmem_expect(struct vgpu_ctxmem_probe *p, int dev, CUdevice cudev);
/* Read the driver before creating a context (first: the process has no context on it). */
void vgpu_ctxmem_before(struct vgpu_ctxmem_probe *p, CUdevice cudev, int first);
/* The context was not created (or not reserved for): drop a claim to measure it. */
void vgpu_ctxmem_cancel(struct vgpu_ctxmem_probe *p);
/* After the context was created: the bytes to charge for it (at least VGPU_CONTEXT_RESERVE). */
uint64_t vgpu_ctxmem_after(struct vgpu_ctxmem_probe *p);
/* A context that exists already (created out of the shim's sight): its size from this
 * process's NVML entry, 0 unknown; instead of vgpu_ctxmem_before/after, then vgpu_ctxmem_done. */
uint64_t vgpu_ctxmem_existing(struct vgpu_ctxmem_probe *p, CUdevice cudev);
/* After the caller settled the charge (or destroyed a context that did not fit): publish what
 * was measured for the slice and wake the processes waiting for it. Until then nobody else of
 * the slice creates a context on the device, so a context never exists uncharged beside them. */
void vgpu_ctxmem_done(struct vgpu_ctxmem_probe *p);
/* A verification of a handed-over size on device index dev that is under way, its context
 * created: wait for it (NVML's readings; never for a context not yet created). Nonzero if it gave
 * charge back (the size was too large): a refusal is then retried (reserve.c's settle). */
int vgpu_ctxmem_wait_verified(int dev);

#endif

/*
 * The slice's accounting file as this process uses it (region.c; its layout: vgpu/region.h).
 * It knows nothing of where its settings come from: vgpu_init passes them in.
 */
#ifndef VGPU_REGION_API_H
#define VGPU_REGION_API_H

#include <stdint.h>

#include "vgpu/cuda_api.h"
#include "vgpu/region.h"

/* What the region is opened with: the file, the quota per device and what this process
 * enforces, published in each slot it claims (VGPU_LIMITS_*). */
struct vgpu_region_params {
    const char *path; /* NULL: a private memfd; kept, not copied */
    uint64_t limit[VGPU_MAX_DEVICES];
    uint32_t limits_source;
    uint64_t limits_dev, limits_ino, limits_hash;
};

struct vgpu_region *vgpu_region(void); /* NULL when no region is in use */
/* Open (or create) the region. Returns CUDA_SUCCESS or an error after printing one line. */
CUresult vgpu_region_open(const struct vgpu_region_params *p);
/* The compute cap needs the region even when no memory limit is set (called from its init). */
void vgpu_require_region(void);
int vgpu_region_required(void);
/* Run fn at a normal exit while this process still holds its slot (one function: ctxmem.c's). */
void vgpu_region_on_exit(void (*fn)(void));
/* 0 locked (never fails: a dead, hung or garbage holder is taken over within 2 s; callers keep
 * their check of the result). */
int vgpu_region_lock(void);
void vgpu_region_unlock(void);
/* Reserve bytes on device index dev against limit (0 = none). Returns 0, -1 if over quota
 * (after a dead-slot scan), -2 if the region is unusable (reported). *used_out gets the slice's
 * usage seen at the decision. */
int vgpu_region_charge(int dev, uint64_t bytes, uint64_t limit, uint64_t *used_out);
/* The quota of device index dev (the configuration's: never the writable region's). */
uint64_t vgpu_region_limit(int dev);
void vgpu_region_uncharge(int dev, uint64_t bytes);
/* Count a refusal decided outside vgpu_region_charge (observers read the counters). */
void vgpu_region_count_denial(int dev, uint64_t bytes);
uint64_t vgpu_region_used(int dev);
/* This process's charge on device index dev (UINT64_MAX without a slot: none yet, or exiting). */
uint64_t vgpu_region_mine(int dev);
/* A context's size on device index dev as the slice learned it (vgpu/region.h): the bytes, and in
 * *source how it was measured (VGPU_CONTEXT_*). Tenant-writable: the caller bounds it. */
uint64_t vgpu_region_context(int dev, uint32_t *source);
/* Claim the measurement of dev's context size: 1 ours (publish must follow), 0 a live process of
 * the slice measures it (*seen: its word, to wait on), -1 no slot (measure without a claim). */
int vgpu_region_context_claim(int dev, uint32_t *seen);
/* Sleep until the measurer word of dev changes from seen, at most ns. */
void vgpu_region_context_wait(int dev, uint32_t seen, uint64_t ns);
/* Publish a measurement (source VGPU_CONTEXT_UNKNOWN: none, only drop the claim) of a device of
 * total bytes (0 unknown) and, if claimed, drop our claim and wake the waiters. */
void vgpu_region_context_publish(int dev, uint64_t bytes, uint32_t source, uint64_t total, int claimed);
/* Return the charges of dead processes to the quota (system calls: not on every call). */
void vgpu_region_reclaim_dead(void);
/* Fork child: drop the inherited slot (claim a new one lazily). */
void vgpu_region_atfork_child(void);

#endif

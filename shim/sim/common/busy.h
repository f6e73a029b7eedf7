/*
 * The busy-time rings of the node state (busy.c): written by the scheduler as a device runs,
 * read for utilisation (NVML) and for a process's device time.
 */
#ifndef VGPU_SIM_BUSY_H
#define VGPU_SIM_BUSY_H

#include "state.h"

/* Busy-time accounting of the interval [start, end) (ns) on the device and for the slot. */
void sim_busy_record(int dev, int slot, uint64_t start, uint64_t end);
/* Busy ns in complete buckets of [from, to). slot -1: the whole device. */
uint64_t sim_busy_between(int dev, int slot, uint64_t from, uint64_t to, uint64_t *window_ns);

/* The same sum over a private copy of a ring (n entries of bucket_ns each, as read by an
 * observer of another state: busy time per bucket clamped to the bucket). */
uint64_t sim_busy_sum_copy(const uint64_t *ring, uint64_t n, uint64_t bucket_ns, uint64_t from, uint64_t to,
                           uint64_t *window);

#endif

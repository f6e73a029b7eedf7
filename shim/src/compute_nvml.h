/*
 * What the two halves of the compute cap share: compute.c (per-device state, the launch gate,
 * the measurements) and compute_nvml.c (the NVML outer loop, on its helper thread). Nothing
 * else includes this header.
 *
 * compute.c owns the per-device state; it hands the loop a device once, at attach, and reads
 * back only the loop's correction of the cost estimates (vgpu_compute_cost_factor, kept in the
 * slice's shared state). The loop keeps its own per-device NVML state, touched by its helper
 * thread only.
 */
#ifndef VGPU_COMPUTE_INTERNAL_H
#define VGPU_COMPUTE_INTERNAL_H

#include <errno.h>
#include <stdint.h>
#include <time.h>

#include "vgpu/compute_state.h"

/* CLOCK_MONOTONIC in ns: the clock of tat_ns, want_until_ns and nvml_next_ns. */
static inline int64_t vgpu_compute_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void vgpu_compute_sleep_until(int64_t t)
{
    struct timespec ts = {.tv_sec = t / 1000000000LL, .tv_nsec = t % 1000000000LL};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
        ;
}

/* ------------------------------------------------------------ compute_nvml.c */
/* What a launch is charged per ns of estimated device time: the NVML loop's correction of the
 * slice's cost estimates (1.0 until the loop has acted). Any thread, lock-free. */
double vgpu_compute_cost_factor(const struct vgpu_compute_state *st);
/* Hand device index dev (capped, attached by compute.c) to the loop: its NVML UUID ("GPU-...",
 * "" when unknown: the loop then leaves the device alone) and the slice's shared state. Once
 * per device, before the device is marked attached in compute.c. */
void vgpu_compute_nvml_attach(int dev, const char *uuid, struct vgpu_compute_state *st);
/* Start the helper thread if this process has not tried yet (at most one attempt: a failure
 * is logged and not retried). Any thread; the caller checks that the loop is configured. */
void vgpu_compute_nvml_start(void);
int vgpu_compute_nvml_started(void);
/* In a fork child: the thread did not survive, so the next capped launch starts it again. */
void vgpu_compute_nvml_atfork_child(void);

#endif

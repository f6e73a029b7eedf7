/*
 * The NVML outer loop of the compute cap (compute_nvml.c), as the launch gate (compute.c) uses
 * it: one direction only, compute.c calls these and compute_nvml.c calls nothing of compute.c
 * (both take the time from compute_clock.h).
 *
 * compute.c owns the per-device state; it hands the loop a device once, at attach, and reads
 * back only the loop's correction of the cost estimates (vgpu_compute_cost_factor, kept in the
 * slice's shared state). The loop keeps its own per-device NVML state, touched by its helper
 * thread only.
 */
#ifndef VGPU_COMPUTE_NVML_H
#define VGPU_COMPUTE_NVML_H

#include <stdint.h>

#include "vgpu/compute_state.h"

/* What a launch is charged per ns of estimated device time: the NVML loop's correction of the
 * slice's cost estimates (1.0 until the loop has acted), from its stored value (ppm, 0: none
 * yet; the launch gate compares the stored value to know whether its copy is current). Any
 * thread, lock-free; inline, being on every launch's path. */
static inline uint32_t vgpu_compute_cost_factor_ppm(const struct vgpu_compute_state *st) {
    return __atomic_load_n(&st->nvml_factor_ppm, __ATOMIC_RELAXED);
}
/* The stored factor itself (the loop's own state; without any test bias). */
static inline double vgpu_compute_stored_factor_of(uint32_t ppm) { return ppm ? (double)ppm / 1e6 : 1.0; }
static inline double vgpu_compute_cost_factor_of(uint32_t ppm) {
    double f = vgpu_compute_stored_factor_of(ppm);
#ifdef VGPU_COMPUTE_TEST_BIAS
    /* Test builds only (tests/shim_compute/test_nvml_loop.py): a deliberately wrong estimator,
     * which the NVML loop must correct. Never defined in the product build. */
    f *= (VGPU_COMPUTE_TEST_BIAS);
#endif
    return f;
}
static inline double vgpu_compute_cost_factor(const struct vgpu_compute_state *st) {
    return vgpu_compute_cost_factor_of(vgpu_compute_cost_factor_ppm(st));
}
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

/*
 * The compute cap's clock: CLOCK_MONOTONIC in ns, one clock for every process of a node (the
 * clock of tat_ns, want_until_ns and nvml_next_ns in the shared state), and an absolute sleep on
 * it. Used by the launch gate (compute.c) and the NVML outer loop (compute_nvml.c); depends on
 * nothing of either.
 */
#ifndef VGPU_COMPUTE_CLOCK_H
#define VGPU_COMPUTE_CLOCK_H

#include <errno.h>
#include <stdint.h>
#include <time.h>

static inline int64_t vgpu_compute_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Sleep until CLOCK_MONOTONIC time t (a signal does not cut it short). */
static inline void vgpu_compute_sleep_until(int64_t t) {
    struct timespec ts = {.tv_sec = t / 1000000000LL, .tv_nsec = t % 1000000000LL};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR);
}

#endif

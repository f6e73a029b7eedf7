/* Helpers for the simulator's C test programs (tests/c/sim_*.c). */
#ifndef SIM_TEST_COMMON_H
#define SIM_TEST_COMMON_H

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "entry_target.h"
#include "vgpu/cuda_api.h"

#define CHECK(call)                                                                                                    \
    do {                                                                                                               \
        CUresult rc_ = (call);                                                                                         \
        if (rc_ != CUDA_SUCCESS) {                                                                                     \
            const char *n_ = NULL;                                                                                     \
            cuGetErrorName(rc_, &n_);                                                                                  \
            fprintf(stderr, "FAIL %s:%d: %s -> %d (%s)\n", __FILE__, __LINE__, #call, (int)rc_, n_ ? n_ : "?");        \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)

#define EXPECT_RC(call, want)                                                                                          \
    do {                                                                                                               \
        CUresult rc_ = (call);                                                                                         \
        if (rc_ != (want)) {                                                                                           \
            fprintf(stderr, "FAIL %s:%d: %s -> %d, expected %d\n", __FILE__, __LINE__, #call, (int)rc_, (int)(want));  \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)

#define EXPECT(cond)                                                                                                   \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);                                            \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)

/* got == want, as integers; a mismatch names both values. */
#define EXPECT_EQ(got, want)                                                                                           \
    do {                                                                                                               \
        long long got_ = (long long)(got), want_ = (long long)(want);                                                  \
        if (got_ != want_) {                                                                                           \
            fprintf(stderr, "FAIL %s:%d: %s is %lld, expected %s (%lld)\n", __FILE__, __LINE__, #got, got_, #want,     \
                    want_);                                                                                            \
            exit(1);                                                                                                   \
        }                                                                                                              \
    } while (0)

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

#endif

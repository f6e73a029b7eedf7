/* The one-time setup every hook runs first (init.c). */
#ifndef VGPU_INIT_H
#define VGPU_INIT_H

#include "vgpu/cuda_api.h"

/* Thread-safe, cheap after the first call: CUDA_SUCCESS or the error the process fails closed
 * with (bad config, unusable region). */
CUresult vgpu_init(void);

/* How a hook opens: return vgpu_init's error, or CUDA_ERROR_NOT_SUPPORTED when the driver lacks
 * what the hook calls (`have`: its real_<symbol>, or a test of it). */
#define VGPU_HOOK_OPEN(have)                                                                                           \
    do {                                                                                                               \
        CUresult vgpu_init_rc_ = vgpu_init();                                                                          \
        if (vgpu_init_rc_ != CUDA_SUCCESS) return vgpu_init_rc_;                                                       \
        if (!(have)) return CUDA_ERROR_NOT_SUPPORTED;                                                                  \
    } while (0)

#endif

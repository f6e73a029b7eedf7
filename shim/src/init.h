/* The one-time setup every hook runs first (init.c). */
#ifndef VGPU_INIT_H
#define VGPU_INIT_H

#include "vgpu/cuda_api.h"

/* Thread-safe, cheap after the first call: CUDA_SUCCESS or the error the process fails closed
 * with (bad config, unusable region). */
CUresult vgpu_init(void);

#endif

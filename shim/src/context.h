/* Primary contexts the CUDA runtime retains out of the shim's sight (context.c). */
#ifndef VGPU_CONTEXT_H
#define VGPU_CONTEXT_H

#include "vgpu/cuda_api.h"

/* The runtime's private table was handed out (exporttab.c): from now on adopt such contexts. */
void vgpu_primary_runtime_route(void);
/* Before a charge or a cuMemGetInfo on device index idx: charge its primary context if it is
 * active and the process has not charged it (a no-op outside runtime processes). */
void vgpu_primary_adopt(int idx);

#endif

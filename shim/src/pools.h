/* Memory pools (pools.c): stream-ordered allocations, charged what their pools reserve. */
#ifndef VGPU_POOLS_H
#define VGPU_POOLS_H

#include "vgpu/cuda_api.h"

/* cuMemFree of a pointer that is not a cuMemAlloc one: a stream-ordered allocation is freed
 * and its pool settled; anything else just goes to real_free. */
CUresult vgpu_pools_free_sync(CUdeviceptr dptr, CUresult (*real_free)(CUdeviceptr));

#endif

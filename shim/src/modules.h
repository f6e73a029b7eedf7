/* Module globals (modules.c): charged after the load, returned when their context goes. */
#ifndef VGPU_MODULES_H
#define VGPU_MODULES_H

#include "vgpu/cuda_api.h"

/* A context was destroyed (rc: the driver's answer, returned): its modules' globals go back. */
CUresult vgpu_modules_ctx_gone(CUcontext ctx, CUresult rc);
/* A device's primary context was reset (reset) or released: if it is gone, so are its modules. */
CUresult vgpu_modules_primary_gone(CUdevice dev, int reset, CUresult rc);

#endif

/*
 * The driver API as the simulated libcuda.so.1 exports it: the declarations the shim shares
 * (vgpu/cuda_api.h) and the simulator's own (sim_api_ext.h), every entry point bound inside this
 * library.
 */
#ifndef VGPU_SIM_CUDA_API_H
#define VGPU_SIM_CUDA_API_H

/* Exported, but bound inside this library ("protected"): the simulator never calls its own
 * entry points through the dynamic symbol table, so an interposer (LD_PRELOAD) sees exactly the
 * application's calls, and cuGetProcAddress returns this library's own functions, as the real
 * driver does. */
#define SIM_EXPORT    __attribute__((visibility("protected")))
#define VGPU_CUDA_API extern SIM_EXPORT
#include "vgpu/cuda_api.h"
#include "sim_api_ext.h"

#endif
